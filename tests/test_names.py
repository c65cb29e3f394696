"""Site names follow torchvision's get_graph_node_names convention (hand-written expectations)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import zoo
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
