"""Tapping TorchScript modules: scripted, traced and loaded, against eager and fx references."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import zoo
from reference import clone, hook_values
from torch import nn

import fxprobe

# TorchScript warns that it is deprecated at every script/trace/save/load.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(12, 16)
        self.act = nn.GELU()
        self.drop = nn.Dropout(0.5)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.flatten(x, 1)
        h = self.act(F.relu(self.fc1(x)))
        return F.softmax(self.fc2(self.drop(h)), dim=-1)


class Branchy(nn.Module):
    """Data-dependent control flow: fx cannot trace it, TorchScript keeps both branches."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.out = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        if bool(h.sum() > 0):
            h = torch.relu(h) * 2
        else:
            h = torch.tanh(h)
        return self.out(h)


class ViewWrite(nn.Module):
    """Writes through a view of a module's output, then an in-place F.relu."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        v = y.view(-1)
        v.mul_(2)
        return F.relu(y, inplace=True)


class Looped(nn.Module):
    """A real loop in the IR: its ops are not sites, and its in-place op runs every turn."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, n: int) -> torch.Tensor:
        y = self.fc(x)
        for _ in range(n):
            y.add_(1.0)
        return y


class FromBuffer(nn.Module):
    """An index computed from a buffer alone: a constant to torchvision's tracer, no site."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("idx", torch.arange(4))
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        i = self.idx.view(-1) + 1
        return self.fc(x)[:, i - 1] * 2


def _fx_values(model: nn.Module, *args: Any) -> tuple[Any, dict[str, Any]]:
    ref = fxprobe.tap(model)
    out = ref(*args)
    return out, {k: clone(v) for k, v in ref.taps.items()}


def _same_as_fx(model: nn.Module, artifact: torch.jit.ScriptModule, *args: Any) -> None:
    expected_out, expected = _fx_values(model, *args)
    tapped = fxprobe.tap(artifact)
    out = tapped(*args)
    assert torch.equal(out, artifact(*args)) and torch.equal(out, expected_out)
    assert fxprobe.sites(artifact) == fxprobe.sites(model)  # the names: the frontends differ
    assert list(tapped.taps) == list(expected)
    for name, value in expected.items():
        assert torch.equal(tapped.taps[name], value), name


@pytest.mark.parametrize("how", ["script", "trace"])
def test_resnet_names_and_values_equal_the_fx_frontend(how: str) -> None:
    model, (x,), _ = zoo.make("resnet")
    artifact = torch.jit.script(model) if how == "script" else torch.jit.trace(model, (x,))
    _same_as_fx(model, artifact, x)


@pytest.mark.parametrize("how", ["script", "trace"])
def test_mlp_names_and_values_equal_the_fx_frontend(how: str) -> None:
    torch.manual_seed(0)
    model, x = MLP().eval(), torch.randn(3, 3, 4)
    artifact = torch.jit.script(model) if how == "script" else torch.jit.trace(model, (x,))
    _same_as_fx(model, artifact, x)


@pytest.mark.parametrize("how", ["script", "trace"])
def test_inplace_model_names_and_values_equal_the_fx_frontend(how: str) -> None:
    model, (x,), _ = zoo.make("inplace")
    artifact = torch.jit.script(model) if how == "script" else torch.jit.trace(model, (x,))
    _same_as_fx(model, artifact, x)


def test_jit_load_round_trip(tmp_path: Path) -> None:
    model, (x,), _ = zoo.make("resnet")
    torch.jit.save(torch.jit.script(model), str(tmp_path / "m.pt"))
    loaded = torch.jit.load(str(tmp_path / "m.pt"))
    _same_as_fx(model, loaded, x)


def test_frozen_module_is_tapped_at_op_level() -> None:
    model, (x,), _ = zoo.make("resnet")
    frozen = torch.jit.freeze(torch.jit.script(model))  # submodules inlined, weights folded
    assert list(fxprobe.sites(frozen))[:4] == ["x", "conv2d", "relu", "max_pool2d"]
    tapped = fxprobe.tap(frozen, ops=["relu", "flatten"])
    assert torch.equal(tapped(x), frozen(x))
    eager = torch.flatten(model.avgpool(model.layer2(model.layer1(model.maxpool(
        model.relu(model.bn1(model.conv1(x))))))), 1)
    torch.testing.assert_close(tapped.taps["flatten"], eager)  # BN folded: rounding differs
    assert torch.equal(model.fc(tapped.taps["flatten"]), tapped(x))


def test_control_flow_both_branches_against_eager() -> None:
    torch.manual_seed(0)
    model = Branchy().eval()
    with torch.no_grad():
        model.fc.weight.copy_(torch.eye(4))
        model.fc.bias.zero_()
    scripted = torch.jit.script(model)
    assert {"fc", "relu", "mul", "tanh", "out"} <= set(fxprobe.sites(scripted))
    tapped = fxprobe.tap(scripted, ops=["fc", "relu", "mul", "tanh", "out"])
    for x, taken, skipped in ((torch.rand(2, 4), "relu", "tanh"),
                              (-torch.rand(2, 4), "tanh", "relu")):
        out = tapped(x)
        h = model.fc(x)
        assert torch.equal(out, model(x))
        assert torch.equal(tapped.taps["fc"], h)
        assert torch.equal(tapped.taps[taken], torch.relu(h) if taken == "relu" else h.tanh())
        assert skipped in tapped.sites[[s.name for s in tapped.sites].index(skipped)].name
        with pytest.raises(fxprobe.SiteNotRunError):
            tapped.taps[skipped]
    # fx falls back to hooks for this model: the module calls still agree.
    _, hooked = hook_values(model, ["fc", "out"], x)
    assert all(torch.equal(tapped.taps[k], v) for k, v in hooked.items())


def test_inplace_hazards_are_copied_only_where_the_ir_shows_them() -> None:
    model, (x,), _ = zoo.make("inplace")
    scripted = torch.jit.script(model)
    tapped = fxprobe.tap(scripted)
    out = tapped(x)
    assert torch.equal(out, model(x))
    bn = model.bn(model.lin(x))  # eager references, step by step
    x2 = bn.relu()
    y = (x2 * 2).relu()
    h = torch.sigmoid((y + 1.0).view(-1))
    expected = {"x": x, "lin": model.lin(x), "bn": bn, "act": x2, "mul": x2 * 2, "relu_": y,
                "view": y.view(-1), "add_": y + 1.0, "sigmoid": h, "relu": h.relu(),
                "add": h.relu() + 1}
    for name, value in expected.items():
        assert torch.equal(tapped.taps[name], value.view_as(tapped.taps[name])), name
    # Overwritten later: bn (by act's relu_) and sigmoid (by F.relu inplace), each by one
    # in-place op that nothing else sees, which now runs out of place; mul (relu_ and the
    # view's add_), relu_ and view (add_ through the view) are copied. As in the fx frontend.
    assert tapped.copied == {"mul", "relu_", "view"} and tapped.outplaced == {"bn", "sigmoid"}
    ref = fxprobe.tap(model)
    ref(x)
    assert (tapped.copied, tapped.outplaced) == (ref.copied, ref.outplaced)
    never = fxprobe.tap(scripted, ops=["bn"], copy="never")
    never(x)
    assert torch.equal(never.taps["bn"], x2)  # what a reference without the copy shows
    always = fxprobe.tap(scripted, ops=["lin", "bn"], copy="always")
    always(x)
    assert always.copied == {"lin", "bn"} and torch.equal(always.taps["bn"], bn)
    assert not always.outplaced and not never.outplaced


def test_write_through_a_view_and_functional_inplace() -> None:
    torch.manual_seed(0)
    model, x = ViewWrite().eval(), torch.randn(3, 4)
    tapped = fxprobe.tap(torch.jit.script(model))
    out = tapped(x)
    y = model.fc(x)
    assert torch.equal(out, model(x))
    assert torch.equal(tapped.taps["fc"], y)
    assert torch.equal(tapped.taps["mul_"], (y * 2).view(-1))
    assert torch.equal(tapped.taps["relu"], F.relu(y * 2))
    assert tapped.copied == {"fc", "view", "mul_"}


def test_selectors_by_type_function_glob_regex_and_where() -> None:
    import re

    model, (x,), _ = zoo.make("resnet")
    scripted = torch.jit.script(model)
    tapped = fxprobe.tap(scripted, ops=[nn.Conv2d, zoo.BasicBlock])
    assert [s.name for s in tapped.sites][:4] == [
        "conv1", "layer1.0.conv1", "layer1.0.conv2", "layer1.0"]
    assert tapped.sites[3].type_name == "zoo.BasicBlock" and tapped.sites[3].op == "BasicBlock"

    def names(ops: Any) -> list[str]:
        return [s.name for s in fxprobe.tap(scripted, ops=ops).sites]

    assert names(torch.flatten) == ["flatten"]
    assert names(nn.ReLU) == [n for n in fxprobe.sites(model).names if "relu" in n]
    assert names(torch.add) == names("layer*.add") == [f"layer{i}.{j}.add" for i in (1, 2)
                                                         for j in (0, 1)]
    assert names(re.compile(r"^layer2\.0\.downsample\.\d$")) == [
        "layer2.0.downsample.0", "layer2.0.downsample.1"]
    assert names(fxprobe.where(lambda s: s.type_name == "zoo.BasicBlock")) == [
        "layer1.0", "layer1.1", "layer2.0", "layer2.1"]
    with pytest.raises(fxprobe.SelectorError, match="layer1.0.conv1"):
        fxprobe.tap(scripted, ops="layer1.0.conv")


def test_a_function_selects_every_spelling() -> None:
    model, _, _ = zoo.make("inplace")
    scripted = torch.jit.script(model)
    # y.relu_() is aten::relu_, F.relu(h, inplace=True) a call of torch.nn.functional.relu.
    for fn in (F.relu, torch.relu, torch.Tensor.relu_):
        expected = [s.name for s in fxprobe.tap(model, ops=fn).sites]
        assert [s.name for s in fxprobe.tap(scripted, ops=fn).sites] == expected == [
            "act", "relu_", "relu"]
    assert [s.op for s in fxprobe.tap(scripted, ops=F.relu).sites] == [
        "ReLU", "aten::relu_", "torch.nn.functional.relu"]


def test_stats_keep_and_to_equal_the_fx_frontend() -> None:
    model, (x,), _ = zoo.make("resnet")
    scripted = torch.jit.script(model)
    ref = fxprobe.tap(model, ops=[nn.Conv2d, torch.add], reduce="stats")
    ref(x)
    tapped = fxprobe.tap(scripted, ops=[nn.Conv2d, torch.add], reduce="stats", keep=2,
                         to="cpu")
    tapped(x)
    tapped(x + 1)
    assert dict(tapped.history[0]) == dict(ref.taps)
    assert isinstance(tapped.taps["conv1"], fxprobe.Stats)
    assert tapped.taps["conv1"] != ref.taps["conv1"]  # the second forward


def test_saved_tapped_module_returns_output_and_taps(tmp_path: Path) -> None:
    model, (x,), _ = zoo.make("resnet")
    tapped = fxprobe.tap(torch.jit.script(model), ops=[nn.Conv2d, "layer*.add"])
    out = tapped(x)
    path = tapped.save(tmp_path / "tapped.pt")
    loaded = torch.jit.load(str(path))
    out2, values = loaded(x)
    assert torch.equal(out2, out) and list(loaded.fxprobe_names) == list(tapped.taps)
    for name, value in zip(loaded.fxprobe_names, values, strict=True):
        assert torch.equal(value, tapped.taps[name])
    again = fxprobe.tap(loaded)
    again(x)
    assert [s.name for s in again.sites] == [s.name for s in tapped.sites]
    assert again.sites[0].module_type is nn.Conv2d
    with pytest.raises(fxprobe.ConfigError, match="already tapped"):
        fxprobe.tap(loaded, ops=nn.Conv2d)


def test_the_users_script_module_is_not_modified() -> None:
    model, (x,), _ = zoo.make("resnet")
    scripted = torch.jit.script(model)
    before = (scripted.code, str(scripted.graph), scripted._c._method_names(),
              [(n, p.data_ptr(), p.clone()) for n, p in scripted.named_parameters()],
              [m.training for m in scripted.modules()], scripted(x))
    tapped = fxprobe.tap(scripted, reduce="stats")
    tapped(x)
    after = (scripted.code, str(scripted.graph), scripted._c._method_names(),
             [(n, p.data_ptr(), p.clone()) for n, p in scripted.named_parameters()],
             [m.training for m in scripted.modules()], scripted(x))
    assert before[:3] == after[:3] and before[4] == after[4]
    assert all(a[:2] == b[:2] and torch.equal(a[2], b[2])
               for a, b in zip(before[3], after[3], strict=True))
    assert torch.equal(before[5], after[5])


def test_summary_and_sites_arguments() -> None:
    model, (x,), _ = zoo.make("resnet")
    scripted = torch.jit.script(model)
    tapped = fxprobe.tap(scripted, ops=["conv1", "flatten"])
    tapped(x)
    lines = str(tapped.summary()).splitlines()
    assert [line.split()[:2] for line in lines[2:4]] == [["conv1", "Conv2d"],
                                                          ["flatten", "aten::flatten"]]
    assert "[2, 16]" in lines[3]
    assert str(fxprobe.summary(scripted)) == str(fxprobe.summary(fxprobe.sites(scripted)))
    with pytest.raises(fxprobe.ConfigError, match="train=True"):
        fxprobe.sites(scripted, train=True)


def _keep_none(module: nn.Module, args: tuple[torch.Tensor], out: torch.Tensor) -> None:
    return None


def test_scripted_forward_hooks_are_refused_and_branches_reduce() -> None:
    torch.manual_seed(0)
    model = Branchy().eval()
    x = torch.rand(2, 4) + 1.0
    with torch.no_grad():
        model.fc.weight.copy_(torch.eye(4))
        model.fc.bias.zero_()
    stats = fxprobe.tap(torch.jit.script(model), ops=["relu", "tanh"], reduce="stats")
    stats(x)
    assert list(stats.taps) == ["relu"]  # statistics computed inside the branch taken
    assert stats.taps["relu"] == fxprobe.StatsBatch.from_tensors({"r": x.relu()})["r"]
    model.fc.register_forward_hook(_keep_none)
    with pytest.raises(fxprobe.UnsupportedModelError, match="forward hooks"):
        fxprobe.tap(torch.jit.script(model))


@pytest.mark.parametrize("kwargs, word", [
    ({"fn": lambda s, v: None}, "fn="), ({"grad": True}, "grad="),
    ({"capture": "input"}, "capture="), ({"reduce": "sample"}, "reduce="),
    ({"reduce": torch.mean}, "reduce="), ({"tracer": "fx"}, "tracer="),
    ({"copy": "sometimes"}, "copy="),
])
def test_modes_a_saved_graph_cannot_hold_are_refused(kwargs: dict[str, Any], word: str) -> None:
    scripted = torch.jit.script(MLP().eval())
    with pytest.raises(fxprobe.ConfigError, match=word):
        fxprobe.tap(scripted, **kwargs)


def test_python_only_functions_still_refuse_script_modules() -> None:
    scripted = torch.jit.script(MLP().eval())
    with pytest.raises(fxprobe.UnsupportedModelError, match="fxprobe.tap and fxprobe.sites"):
        fxprobe.extractor(scripted)


def test_to_dot_and_cli_read_the_artifact(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                          ) -> None:
    from fxprobe import cli as _cli

    model, (x,), _ = zoo.make("resnet")
    scripted = torch.jit.script(model)
    dot = fxprobe.to_dot(scripted, x, ops=nn.Conv2d).source
    for name in ("conv1", "layer2.0.downsample.0", "flatten"):
        assert f"\t{name} [label=" in dot or f'"{name}" [label=' in dot, name
    assert '"layer1.0.conv1" -> "layer1.0.bn1"' in dot and "float32 [2, 8, 16, 16]" in dot
    assert dot.count("#E69F00") == sum(1 for n in fxprobe.sites(model).names if "conv" in n) + 1
    tapped = fxprobe.tap(scripted, ops="layer1.0.*")
    tapped(x)
    assert "layer1.0.add" in fxprobe.to_dot(tapped).source

    torch.jit.save(scripted, str(tmp_path / "m.pt"))
    assert _cli.main(["sites", str(tmp_path / "m.pt"), "--ops", "module:BasicBlock"]) == 0
    table = capsys.readouterr().out.partition("\n\n")[0]
    rows = [line.split()[0] for line in table.splitlines()[2:]]
    assert rows == ["layer1.0", "layer1.1", "layer2.0", "layer2.1"]
    assert _cli.main(["graph", str(tmp_path / "m.pt"), "-o", str(tmp_path / "m.dot")]) == 0
    assert "layer2.1.relu_1" in (tmp_path / "m.dot").read_text()
    assert _cli.main(["sites", str(tmp_path / "missing.pt")]) == 2


def test_overloaded_forward_of_a_leaf_module_is_one_site() -> None:
    from reference import same

    model, (ids,), _ = zoo.make("lstm")  # nn.LSTM scripts its forward as forward__0
    scripted = torch.jit.script(model)
    # fx's getitem sites unpack the LSTM's tuple; TorchScript unpacks with no op at all.
    assert list(fxprobe.sites(scripted).names) == [
        n for n in fxprobe.sites(model).names if not n.startswith("getitem")]
    tapped = fxprobe.tap(scripted)
    tapped(ids)
    _, hooked = hook_values(model, ["embed", "lstm", "head"], ids)
    assert all(same(tapped.taps[k], v) for k, v in hooked.items())


def test_a_loop_keeps_its_inplace_op_and_the_value_is_copied() -> None:
    torch.manual_seed(0)
    model, x = Looped().eval(), torch.randn(2, 4)
    scripted = torch.jit.script(model)
    assert list(fxprobe.sites(scripted)) == ["x", "n", "fc"]  # nothing from the loop body
    tapped = fxprobe.tap(scripted, ops="fc")
    assert torch.equal(tapped(x, 3), model(x, 3))
    assert torch.equal(tapped.taps["fc"], model.fc(x))
    assert tapped.copied == {"fc"} and not tapped.outplaced


@pytest.mark.parametrize("how", ["script", "export"])
def test_artifacts_stream_to_disk(tmp_path: Path, how: str) -> None:
    """Every forward of a tapped .pt/.pt2 on disk, as cloning hooks saw it on the model; an
    input the caller reuses after the forward is written as it was."""
    torch.manual_seed(0)
    model = MLP().eval()
    xs = [torch.randn(2, 12) for _ in range(3)]
    artifact: Any = (torch.jit.script(model) if how == "script" else
                     torch.export.export(model, (xs[0],)))
    seen: list[dict[str, torch.Tensor]] = []
    hooks = [getattr(model, n).register_forward_hook(
        lambda m, i, o, n=n: seen[-1].__setitem__(n, o.detach().clone())) for n in ("fc1", "fc2")]
    buf = torch.empty(2, 12)
    with torch.no_grad(), fxprobe.tap(artifact, ops=["x", "fc1", "fc2"],
                                      to=fxprobe.Disk(tmp_path / "c")) as tapped:
        for x in xs:
            seen.append({"x": x.clone()})
            model(x)
            buf.copy_(x)
            assert torch.equal(tapped(buf), model(x))
            buf.fill_(7.0)  # the caller reuses its input buffer at once
    for h in hooks:
        h.remove()
    caps = fxprobe.open_captures(tmp_path / "c")
    assert len(caps) == 3 and set(caps.names) == {"x", "fc1", "fc2"}
    for i, expected in enumerate(seen):
        for name, value in expected.items():
            assert torch.equal(caps.forward(i)[name], value), (i, name)


@pytest.mark.parametrize("how", ["script", "trace", "export"])
def test_values_from_buffers_alone_are_no_sites(how: str) -> None:
    torch.manual_seed(0)
    model, x = FromBuffer().eval(), torch.randn(2, 4)
    artifact: Any = (torch.jit.script(model) if how == "script" else
                     torch.jit.trace(model, (x,)) if how == "trace" else
                     torch.export.export(model, (x,)))
    names = list(fxprobe.sites(artifact))
    assert {"x", "fc", "mul"} <= set(names) and not {"view", "add", "sub"} & set(names)
    tapped = fxprobe.tap(artifact, ops=["fc", "mul"])
    tapped(x)
    assert torch.equal(tapped.taps["mul"], model(x))
