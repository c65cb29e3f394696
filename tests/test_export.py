"""Tapping torch.export programs: exported and loaded, against eager and fx references."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import zoo
from reference import clone, hook_values
from torch import nn
from tv_venv import TvJob, run_tv, uses_tv

import fxprobe


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(12, 16)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.flatten(x, 1)
        h = self.act(F.relu(self.fc1(x)))
        return F.softmax(self.fc2(h), dim=-1)


def _fx_values(model: nn.Module, *args: Any) -> dict[str, Any]:
    ref = fxprobe.tap(model)
    ref(*args)
    return {k: clone(v) for k, v in ref.taps.items()}


def _same_as_fx(model: nn.Module, program: Any, *args: Any) -> fxprobe.TappedExport:
    expected = _fx_values(model, *args)
    tapped = fxprobe.tap(program)
    out = tapped(*args)
    assert torch.equal(out, program.module()(*args)) and torch.equal(out, model(*args))
    assert fxprobe.sites(program) == fxprobe.sites(model)  # the names: the frontends differ
    assert list(tapped.taps) == list(expected)
    for name, value in expected.items():
        assert torch.equal(tapped.taps[name], value), name
    return tapped


@pytest.mark.parametrize("name", ["resnet", "inplace"])
def test_names_and_values_equal_the_fx_frontend(name: str) -> None:
    model, args, _ = zoo.make(name)
    _same_as_fx(model, torch.export.export(model, args), *args)


def test_pt2_round_trip(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model, x = MLP().eval(), torch.randn(3, 3, 4)
    torch.export.save(torch.export.export(model, (x,)), tmp_path / "m.pt2")
    _same_as_fx(model, torch.export.load(tmp_path / "m.pt2"), x)


def test_aten_ops_are_selected_by_every_spelling() -> None:
    model, (x,), _ = zoo.make("encoder")
    program = torch.export.export(model, (x,))
    tapped = fxprobe.tap(program, ops=[F.softmax, torch.matmul, nn.LayerNorm, zoo.SelfAttention])
    assert [(s.name, s.op) for s in tapped.sites] == [
        ("norm1", "LayerNorm"), ("attn.matmul", "aten.matmul.default"),
        ("attn.softmax", "aten.softmax.int"), ("attn.matmul_1", "aten.matmul.default"),
        ("attn", "SelfAttention"), ("norm2", "LayerNorm")]
    tapped(x)
    expected = _fx_values(model, x)
    assert all(torch.equal(tapped.taps[n], expected[n]) for n in expected if n in tapped.taps)
    _, hooked = _hooked(model, "attn", x)
    assert torch.equal(tapped.taps["attn"], hooked)


def _hooked(model: nn.Module, path: str, *args: Any) -> tuple[Any, torch.Tensor]:
    from reference import hook_values

    out, seen = hook_values(model, [path], *args)
    return out, seen[path]


def test_inplace_hazards_copy_only_what_is_overwritten() -> None:
    model, (x,), _ = zoo.make("inplace")
    program = torch.export.export(model, (x,))
    tapped = fxprobe.tap(program)
    tapped(x)
    # The ATen graph holds the same in-place ops as the eager code and the one in-place
    # engine decides for both frontends: bn, mul and sigmoid are kept safe by running the
    # first in-place op that overwrites each out of place, relu_ and view by a copy. (The fx
    # graph copies mul: there the later y.add_(1) reads mul's node, y, after relu_ wrote it;
    # ATen's add_ reads relu_'s result.)
    assert tapped.copied == {"relu_", "view"} and tapped.outplaced == {"bn", "mul", "sigmoid"}
    ref = fxprobe.tap(model)
    ref(x)
    assert (ref.copied, ref.outplaced) == ({"mul", "relu_", "view"}, {"bn", "sigmoid"})
    assert all(torch.equal(tapped.taps[n], ref.taps[n]) for n in ref.taps)
    never = fxprobe.tap(program, ops="bn", copy="never")
    never(x)
    assert torch.equal(never.taps["bn"], model.act(model.bn(model.lin(x))))



class _WrittenThenReturned(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b = x * 2
        b.add_(x)
        c = torch.sin(x)
        c.mul_(3)
        return b, c.relu()


def test_a_tapped_value_written_in_place_and_returned() -> None:
    torch.manual_seed(0)
    model, x = _WrittenThenReturned(), torch.randn(5)
    program = torch.export.export(model, (x,))
    tapped = fxprobe.tap(program, ops=["mul", "sin"])
    out = tapped(x)
    want = program.module()(x)
    assert all(torch.equal(a, b) for a, b in zip(out, want, strict=True))
    assert torch.equal(out[0], x * 2 + x) and torch.equal(out[1], (torch.sin(x) * 3).relu())
    assert torch.equal(tapped.taps["mul"], x * 2)  # before add_ wrote it
    assert torch.equal(tapped.taps["sin"], torch.sin(x))
    scripted = fxprobe.tap(torch.jit.script(model), ops=["mul", "sin"])
    scripted(x)
    assert all(torch.equal(tapped.taps[n], scripted.taps[n]) for n in ("mul", "sin"))
    for copy in ("always", "never"):  # never: the written value, as the program leaves it
        other = fxprobe.tap(program, ops="mul", copy=copy)
        assert torch.equal(other(x)[0], x * 2 + x)
        assert torch.equal(other.taps["mul"], x * 2 if copy == "always" else x * 2 + x)


class _WrittenThenReturnedOnce(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = x * 2
        b.add_(x)
        return b


def test_a_tapped_value_written_in_place_and_returned_is_outplaced() -> None:
    # The graph returns what add_ makes; add_ runs out of place, so the output names its twin.
    torch.manual_seed(0)
    model, x = _WrittenThenReturnedOnce(), torch.randn(3, 4)
    program = torch.export.export(model, (x,))
    tapped = fxprobe.tap(program, ops=["mul"])
    out = tapped(x)
    assert torch.equal(tapped.taps["mul"], x * 2)  # before the add_
    assert torch.equal(out, program.module()(x)) and torch.equal(out, model(x))
    assert tapped.outplaced == {"mul"} and not tapped.copied


def test_tapped_program_saves_and_loads_with_its_taps(tmp_path: Path) -> None:
    model, (x,), _ = zoo.make("resnet")
    tapped = fxprobe.tap(torch.export.export(model, (x,)), ops=[nn.Conv2d, "layer*.add", "x"])
    out = tapped(x)
    torch.export.save(tapped.exported(), tmp_path / "tapped.pt2")
    loaded = torch.export.load(tmp_path / "tapped.pt2")
    out2, values = loaded.module()(x)
    assert torch.equal(out2, out) and list(values) == [s.name for s in tapped.sites]
    for name, value in values.items():
        assert torch.equal(value, tapped.taps[name])
    again = fxprobe.tap(loaded)
    again(x)
    assert again.sites == tapped.sites
    assert [s.name for s in fxprobe.sites(loaded).records] == [s.name for s in tapped.sites]
    with pytest.raises(fxprobe.ConfigError, match="already tapped"):
        fxprobe.tap(loaded, ops=nn.Conv2d)


def test_stats_equal_the_fx_frontend() -> None:
    model, (x,), _ = zoo.make("resnet")
    ref = fxprobe.tap(model, ops=[nn.Conv2d, torch.add], reduce="stats")
    ref(x)
    tapped = fxprobe.tap(torch.export.export(model, (x,)), ops=[nn.Conv2d, torch.add],
                         reduce="stats", keep=2)
    tapped(x)
    assert dict(tapped.taps) == dict(ref.taps)


def test_the_users_program_is_not_modified() -> None:
    model, (x,), _ = zoo.make("resnet")
    program = torch.export.export(model, (x,))
    before = (str(program.graph), [n.meta.get("custom") for n in program.graph.nodes],
              list(program.graph_signature.output_specs), program.call_spec.out_spec,
              program.module()(x))
    fxprobe.tap(program)(x)
    after = (str(program.graph), [n.meta.get("custom") for n in program.graph.nodes],
             list(program.graph_signature.output_specs), program.call_spec.out_spec,
             program.module()(x))
    assert before[:4] == after[:4] and torch.equal(before[4], after[4])


@pytest.mark.parametrize("kwargs, word", [
    ({"fn": lambda s, v: None}, "fn="), ({"grad": True}, "grad="),
    ({"capture": "both"}, "capture="), ({"reduce": "sample"}, "reduce="),
    ({"leaf_modules": [nn.Linear]}, "leaf_modules="),
])
def test_modes_a_saved_graph_cannot_hold_are_refused(kwargs: dict[str, Any], word: str) -> None:
    torch.manual_seed(0)
    program = torch.export.export(MLP().eval(), (torch.randn(2, 12),))
    with pytest.raises(fxprobe.ConfigError, match=word):
        fxprobe.tap(program, **kwargs)


def test_to_dot_and_cli_read_the_program(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                         ) -> None:
    from fxprobe import cli as _cli

    model, (x,), _ = zoo.make("encoder")
    program = torch.export.export(model, (x,))
    dot = fxprobe.to_dot(program, x, ops=F.softmax).source
    assert "attn.softmax" in dot and "aten.softmax.int" in dot and "cluster_attn" in dot
    torch.export.save(program, tmp_path / "m.pt2")
    assert _cli.main(["sites", str(tmp_path / "m.pt2"), "--ops", "op:softmax"]) == 0
    assert capsys.readouterr().out.splitlines()[2].split()[:2] == [
        "attn.softmax", "aten.softmax.int"]


# Run by a Python that has torch but cannot import fxprobe: what a deployment user does with
# a tapped .pt (TorchScript) and a tapped .pt2 (torch.export), as docs/artifacts.md says.
_WITHOUT_FXPROBE = """
import sys
sys.modules["fxprobe"] = None  # import fxprobe raises ImportError from here on
try:
    import fxprobe
except ImportError:
    pass
else:
    raise SystemExit("fxprobe was importable")
import torch

x = torch.load("x.pt")
ep = torch.export.load("tapped.pt2")
spec_names = list(ep.call_spec.out_spec.child(1).context)  # without running anything
out2, taps2 = ep.module()(x)
m = torch.jit.load("tapped.pt")
out1, values = m(x)
taps1 = dict(zip(m.fxprobe_names, values))
torch.save({"spec_names": spec_names, "pt2": (out2, taps2), "pt": (out1, taps1)}, "read.pt")
"""


def test_saved_tapped_artifacts_name_their_values_without_fxprobe(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    from reference import hook_values

    model, (x,), _ = zoo.make("resnet")
    ops = [nn.Conv2d, "layer1", "fc"]
    torch.export.save(fxprobe.tap(torch.export.export(model, (x,)), ops=ops).exported(),
                      tmp_path / "tapped.pt2")
    fxprobe.tap(torch.jit.script(model), ops=ops).save(tmp_path / "tapped.pt")
    torch.save(x, tmp_path / "x.pt")
    paths = [p for p, m in model.named_modules() if isinstance(m, nn.Conv2d)] + ["layer1", "fc"]
    out, expected = hook_values(model, paths, x)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    subprocess.run([sys.executable, "-c", _WITHOUT_FXPROBE], cwd=tmp_path, env=env,
                   check=True)
    read = torch.load(tmp_path / "read.pt")
    assert sorted(read["spec_names"]) == sorted(paths)
    for kind in ("pt2", "pt"):
        out_k, taps = read[kind]
        assert torch.equal(out_k, out), kind
        assert sorted(taps) == sorted(paths), kind
        for name, value in taps.items():
            assert torch.equal(value, expected[name]), (kind, name)
    assert list(read["pt2"][1]) == read["spec_names"] == list(read["pt"][1])


def test_a_program_tapped_before_the_values_were_named_still_reads() -> None:
    # tests/saved/tapped-tuple.pt2: made by fxprobe at 34ceebf, whose tapped programs returned
    # (output, (values...)): fc2(relu(fc1(x))) with Linear(6, 8) and Linear(8, 3), ops=[nn.Linear,
    # F.relu]. Its values are checked against the weights it holds, computed by hand.
    loaded = torch.export.load(Path(__file__).parent / "saved" / "tapped-tuple.pt2")
    out_spec = loaded.call_spec.out_spec
    assert out_spec.child(1).type is tuple  # the old structure indeed
    tapped = fxprobe.tap(loaded)
    assert [s.name for s in tapped.sites] == ["fc1", "relu", "fc2"]
    assert [s.name for s in fxprobe.sites(loaded).records] == ["fc1", "relu", "fc2"]
    x = torch.randn(2, 6)  # the batch it was exported with
    out = tapped(x)
    sd = loaded.state_dict
    fc1 = x @ sd["fc1.weight"].T + sd["fc1.bias"]
    fc2 = fc1.clamp(min=0) @ sd["fc2.weight"].T + sd["fc2.bias"]
    assert torch.allclose(out, fc2, atol=1e-6)
    for name, want in [("fc1", fc1), ("relu", fc1.clamp(min=0)), ("fc2", fc2)]:
        assert torch.allclose(tapped.taps[name], want, atol=1e-6), name


def test_an_argument_named_like_a_builtin() -> None:
    # nn.Sequential's forward argument is `input`: a plain copy of the graph renames its
    # placeholder input_1, which the program's signature no longer names.
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(4, 4), nn.ReLU()).eval(), torch.randn(3, 4)
    program = torch.export.export(model, (x,))
    tapped = fxprobe.tap(program)
    with torch.no_grad():
        out = tapped(x)
    assert torch.equal(out, model(x))
    assert fxprobe.sites(program).names == fxprobe.sites(model).names == ("input", "0", "1")
    _, want = hook_values(model, ["0", "1"], x)
    assert torch.equal(tapped.taps["input"], x)
    assert torch.equal(tapped.taps["0"], want["0"]) and torch.equal(tapped.taps["1"], want["1"])
    out2, values = tapped.exported().module()(x)
    assert torch.equal(out2, out) and torch.equal(values["1"], want["1"])


class _LayerNorm(nn.LayerNorm):
    """timm's LayerNorm: a subclass whose forward calls F.layer_norm itself."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.fc, self.norm2 = _LayerNorm(4), nn.Linear(4, 4), nn.LayerNorm(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm2(x + self.fc(self.norm1(x)))


class _Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Block(), _Block()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def test_a_module_subclass_is_selected_by_its_base_as_in_eager() -> None:
    torch.manual_seed(1)
    model, x = _Blocks().eval(), torch.randn(3, 4)
    program = torch.export.export(model, (x,))
    norms = ["blocks.0.norm1", "blocks.0.norm2", "blocks.1.norm1", "blocks.1.norm2"]
    _, want = hook_values(model, norms, x)
    for ops in (nn.LayerNorm, [nn.LayerNorm, nn.Linear]):
        eager, exported = fxprobe.tap(model, ops=ops), fxprobe.tap(program, ops=ops)
        with torch.no_grad():
            eager(x)
            exported(x)
        assert list(exported.taps) == list(eager.taps)
        assert [n for n in exported.taps if "norm" in n] == norms
        for name in norms:
            assert torch.equal(exported.taps[name], want[name]), name
    only = fxprobe.tap(program, ops=_LayerNorm)  # the subclass alone: not nn.LayerNorm's
    only(x)
    assert list(only.taps) == ["blocks.0.norm1", "blocks.1.norm1"]


_TIMM_NORMS = """
import torch, timm, fxprobe
from torch import nn
torch.manual_seed(0)
m = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8,
                      depth=2, num_classes=10).eval()
x = torch.randn(1, 3, 32, 32)
eager = fxprobe.tap(m, ops=nn.LayerNorm)
exported = fxprobe.tap(torch.export.export(m, (x,)), ops=nn.LayerNorm)
with torch.no_grad():
    eager(x)
    exported(x)
assert list(exported.taps) == list(eager.taps), (list(exported.taps), list(eager.taps))
assert all(torch.equal(exported.taps[n], eager.taps[n]) for n in eager.taps)
print("norms", list(eager.taps))
"""


@uses_tv(TvJob(_TIMM_NORMS, timeout=300))
def test_timm_layernorm_is_selected_after_export_as_in_eager() -> None:
    stdout = run_tv(TvJob(_TIMM_NORMS, timeout=300))
    assert ("norms ['blocks.0.norm1', 'blocks.0.norm2', 'blocks.1.norm1', 'blocks.1.norm2', "
            "'norm']") in stdout, stdout
