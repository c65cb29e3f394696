"""Site names follow torchvision's get_graph_node_names convention (hand-written expectations)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import zoo
from reference import hook_values
from torch import nn

import fxprobe


def test_resnet_names_in_execution_order() -> None:
    model, _, _ = zoo.make("resnet")
    names = fxprobe.sites(model)
    block = ["conv1", "bn1", "relu", "conv2", "bn2", "add", "relu_1"]
    expected = ["x", "conv1", "bn1", "relu", "maxpool"]
    expected += [f"layer1.0.{n}" for n in block] + [f"layer1.1.{n}" for n in block]
    expected += [f"layer2.0.{n}" for n in block[:5]]
    expected += ["layer2.0.downsample.0", "layer2.0.downsample.1", "layer2.0.add",
                 "layer2.0.relu_1"]
    expected += [f"layer2.1.{n}" for n in block] + ["avgpool", "flatten", "fc"]
    assert list(names) == expected


def test_repeats_are_suffixed_within_their_module() -> None:
    model, _, _ = zoo.make("shared")
    assert list(fxprobe.sites(model)) == ["x", "fc", "relu", "fc_1", "out"]


class _Twice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(3, 3))
        self.add_1 = nn.Linear(3, 3)  # a module whose name ends in _<digits>

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(x) + 1
        y = F.relu(y) + x.flatten(1)
        return self.add_1(self.inner(y))


def test_functional_repeats_and_global_fx_suffixes() -> None:
    names = list(fxprobe.sites(_Twice()))
    # torchvision strips fx's global _N suffix and re-numbers per module. It strips the suffix
    # of a module *named* add_1 too, so that module's call is "add_2"; fxprobe keeps this quirk
    # so that names stay interchangeable with create_feature_extractor.
    assert names == ["x", "relu", "add", "relu_1", "flatten", "add_1", "inner.0", "add_2"]


def test_train_mode_names() -> None:
    model, _, _ = zoo.make("train_eval")
    assert list(fxprobe.sites(model)) == ["x", "fc1", "sigmoid", "fc2"]
    assert list(fxprobe.sites(model, train=True)) == [
        "x", "fc1", "dropout", "relu", "add", "fc2"]
    assert model.training is False


def test_site_records() -> None:
    model, _, _ = zoo.make("encoder")
    records = {s.name: s for s in fxprobe.sites(model).records}
    gelu = records["gelu"]
    assert (gelu.how, gelu.kind, gelu.op, gelu.module_path) == (
        "fx", "call_function", "torch.nn.functional.gelu", "")
    qkv = records["attn.qkv"]
    assert (qkv.kind, qkv.module_type, qkv.module_path, qkv.op) == (
        "call_module", nn.Linear, "attn.qkv", "Linear")
    view = records["attn.view"]
    assert (view.kind, view.target, view.module_path, view.op) == (
        "call_method", "view", "attn", ".view()")


class _Clash(nn.Module):
    """A module ``x`` called twice beside a module named ``x_1_1``."""

    def __init__(self) -> None:
        super().__init__()
        self.x = nn.Linear(4, 4)
        self.x_1_1 = nn.Linear(4, 4)

    def forward(self, inp: torch.Tensor) -> torch.Tensor:
        return self.x_1_1(self.x(self.x(inp)))


def test_site_names_are_unique_and_every_value_is_kept() -> None:
    torch.manual_seed(0)
    model = _Clash()
    names = list(fxprobe.sites(model))
    assert names == ["inp", "x", "x_1", "x_1_1"]  # torchvision's scheme, unique
    tapped = fxprobe.tap(model, ops=["x*"])
    inp = torch.randn(2, 4)
    with torch.no_grad():
        tapped(inp)
        first = model.x(inp)
        second = model.x(first)
        third = model.x_1_1(second)
    assert torch.equal(tapped.taps["x"], first)
    assert torch.equal(tapped.taps["x_1"], second)
    assert torch.equal(tapped.taps["x_1_1"], third)


class _Body(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x))


class _ArgNamedLikeModule(nn.Module):
    """An input named ``body`` beside a module ``body`` that fx traces through: both sites
    would be named ``body``."""

    def __init__(self) -> None:
        super().__init__()
        self.body = _Body()

    def forward(self, body: torch.Tensor) -> torch.Tensor:
        return self.body(body) + 1


def test_a_name_taken_by_a_node_is_suffixed_for_a_module_call() -> None:
    torch.manual_seed(0)
    model = _ArgNamedLikeModule()
    listing = fxprobe.sites(model)
    # torchvision's get_graph_node_names: the input and the nodes inside the module; the
    # traced-through module call is no node there, so it is the one that gives way.
    assert list(listing) == ["body", "body.fc", "body.relu", "add"]
    assert [s.name for s in listing.modules] == ["body_1"]
    tapped = fxprobe.tap(model, ops=["body*"])
    names = [s.name for s in tapped.sites]
    assert sorted(names) == ["body", "body.fc", "body.relu", "body_1"]  # each name once
    x = torch.randn(2, 4)
    with torch.no_grad():
        tapped(x)
        _, ref = hook_values(model, ["body"], x)
    assert torch.equal(tapped.taps["body"], x)
    assert torch.equal(tapped.taps["body_1"], ref["body"])


def test_a_module_fx_traces_through_is_a_site_by_its_path() -> None:
    model, (x,), _ = zoo.make("resnet")
    listing = fxprobe.sites(model)
    assert "layer1" not in listing  # the tuple equals torchvision's node names
    assert [s.name for s in listing.modules][:3] == ["layer1.0", "layer1.1", "layer1"]
    tapped = fxprobe.tap(model, ops=["layer1", zoo.BasicBlock])
    assert [s.name for s in tapped.sites] == ["layer1.0", "layer1.1", "layer1", "layer2.0",
                                                "layer2.1"]
    with torch.no_grad():
        tapped(x)
        _, ref = hook_values(model, ["layer1", "layer1.0", "layer2.1"], x)
    for name in ("layer1", "layer1.0", "layer2.1"):
        assert torch.equal(tapped.taps[name], ref[name]), name


def test_a_traced_through_module_gives_its_inputs() -> None:
    model, (x,), _ = zoo.make("resnet")
    tapped = fxprobe.tap(model, ops="layer1.1", capture="both")
    seen = {}
    handle = model.layer1[1].register_forward_pre_hook(
        lambda m, a: seen.update(inp=a[0].clone()) or None)
    try:
        with torch.no_grad():
            tapped(x)
            _, ref = hook_values(model, ["layer1.1"], x)
    finally:
        handle.remove()
    both = tapped.taps["layer1.1"]
    # The block's first op (conv1) does not write its input, but its last (relu_) writes
    # storage that aliases the output: both are the values as they were at the call.
    assert torch.equal(both.inputs[0], seen["inp"])
    assert torch.equal(both.output, ref["layer1.1"])
