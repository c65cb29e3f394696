"""Names and values equal torchvision's feature extraction (``get_graph_node_names``,
``create_feature_extractor``) on torchvision's own models.

torchvision may not install beside the torch under test, so the comparison runs in another
Python that has it (``FXPROBE_TV_PYTHON``, else ``$FXPROBE_TV_VENV/bin/python`` with
``FXPROBE_TV_VENV`` defaulting to /work/venv-tv; ``.ci/tv-env`` creates it), with this
checkout first on its path; without one, those tests skip and say why. CI checks a subset of
models that covers every family; ``FXPROBE_TV_ALL=1`` checks every classification model.

The first tests need no torchvision: they check fxprobe's torchvision rules on stand-ins.
"""

from __future__ import annotations

import json
import os
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from tv_venv import TvJob, run_tv, uses_tv

import fxprobe

SCRIPT = Path(__file__).resolve().parent / "torchvision_parity.py"
# One model of each family, vit_b_16 and maxvit_t (the two that differed longest) among them:
# the comparison takes 36 s on a loaded 2-core machine, all 80 models and 5 backbones 117 s.
SUBSET = [
    "alexnet", "convnext_tiny", "densenet121", "efficientnet_b0", "efficientnet_v2_s",
    "googlenet", "inception_v3", "maxvit_t", "mnasnet0_5", "mobilenet_v2", "mobilenet_v3_small",
    "regnet_x_400mf", "regnet_y_400mf", "resnet18", "resnext50_32x4d", "shufflenet_v2_x0_5",
    "squeezenet1_1", "swin_t", "swin_v2_t", "vgg11_bn", "vit_b_16", "wide_resnet50_2",
    # detection and segmentation: FeaturePyramidNetwork and FrozenBatchNorm2d are ops leaves
    "fasterrcnn_mobilenet_v3_large_fpn.backbone", "retinanet_resnet50_fpn.backbone",
    "deeplabv3_mobilenet_v3_large",
]
TIMEOUT_S = 600


# --- torchvision's rules, on stand-ins (no torchvision needed) ---------------------------------

class _OpsBlock(nn.Sequential):
    """Stands for a torchvision.ops module such as Conv2dNormActivation."""


class _FromOps(_OpsBlock):
    """A model's subclass of one (vit's MLPBlock is an ops.MLP)."""


def stochastic_depth(x: torch.Tensor) -> torch.Tensor:
    """Stands for a torchvision.ops function (fx wraps only public global names)."""
    return x * 2 + 1


class _UsesOps(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = _OpsBlock(nn.Linear(4, 4), nn.ReLU())
        self.mlp = _FromOps(nn.Linear(4, 4), nn.GELU())
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(stochastic_depth(self.mlp(self.stem(x))))


@pytest.fixture
def fake_torchvision_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    ops = types.ModuleType("torchvision.ops")
    ops.Conv2dNormActivation = _OpsBlock  # type: ignore[attr-defined]
    ops.stochastic_depth = stochastic_depth  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torchvision.ops", ops)


def test_torchvision_ops_modules_and_functions_are_named_whole(fake_torchvision_ops: None) -> None:
    # get_graph_node_names passes leaf_modules=<the nn.Module classes torchvision.ops exports>
    # and autowrap_modules=(math, torchvision.ops); fxprobe does the same once torchvision.ops
    # is imported (a model that uses it has imported it).
    model = _UsesOps()
    assert list(fxprobe.sites(model)) == ["x", "stem", "mlp", "stochastic_depth", "fc"]
    x = torch.randn(2, 4)
    tapped = fxprobe.tap(model, ops=["mlp", "stochastic_depth"])
    torch.testing.assert_close(tapped(x), model(x))
    mlp = model.mlp(model.stem(x))
    torch.testing.assert_close(tapped.taps["mlp"], mlp)
    torch.testing.assert_close(tapped.taps["stochastic_depth"], mlp * 2 + 1)
    # Kept whole in the names, not in what can be tapped: the layers inside stay sites.
    listing = fxprobe.sites(model)
    assert [s.name for s in listing.inner] == ["stem.0", "stem.1", "mlp.0", "mlp.1"]
    linears = fxprobe.tap(model, ops=nn.Linear)
    assert [s.name for s in linears.sites] == ["stem.0", "mlp.0", "fc"]
    linears(x)
    torch.testing.assert_close(linears.taps["stem.0"], model.stem[0](x))


def test_without_torchvision_they_are_traced_through() -> None:
    assert list(fxprobe.sites(_UsesOps())) == [
        "x", "stem.0", "stem.1", "mlp.0", "mlp.1", "mul", "add", "fc"]


class _BufferIndex(nn.Module):
    """maxvit's relative position bias: a parameter indexed by a buffer reshaped in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(9, 2))
        self.register_buffer("index", torch.arange(4).reshape(2, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.table[self.index.view(-1)].view(2, 2, 2)
        return x.view(2, 2, 2) + bias


def test_values_computed_from_buffers_alone_are_no_sites() -> None:
    # torchvision's tracer sees a buffer as a constant, so index.view(-1) is no node there and
    # the later view is "view", not "view_1".
    model = _BufferIndex()
    assert list(fxprobe.sites(model)) == ["x", "table", "getitem", "view", "view_1", "add"]
    x = torch.randn(8)
    tapped = fxprobe.tap(model, ops="view")
    out = tapped(x)
    torch.testing.assert_close(out, model(x))
    torch.testing.assert_close(tapped.taps["view"], model.table[model.index.view(-1)].view(2, 2, 2))


# --- against torchvision itself, in a Python that has it ---------------------------------------

PARITY = TvJob(path=str(SCRIPT), args=("--values", *(
    ["--all"] if os.environ.get("FXPROBE_TV_ALL") else SUBSET)), timeout=TIMEOUT_S)


@pytest.fixture(scope="module")
def parity() -> dict[str, Any]:
    result: dict[str, Any] = json.loads(run_tv(PARITY))
    return result


@uses_tv(PARITY)
def test_names_equal_get_graph_node_names(parity: dict[str, Any]) -> None:
    problems = {name: r for name, r in parity["names"].items()
                if r.get("error") or r["eval"] or r["train"] or r["fallbacks"]}
    assert not problems, json.dumps(problems, indent=1)
    assert len(parity["names"]) >= len(SUBSET)


@uses_tv(PARITY)
def test_values_equal_create_feature_extractor(parity: dict[str, Any]) -> None:
    problems = {f"{model}: {site}": error for model, sites in parity["values"].items()
                for site, error in sites.items() if error}
    assert not problems, json.dumps(problems, indent=1)
    assert set(parity["values"]) == {"resnet18", "vit_b_16"}
