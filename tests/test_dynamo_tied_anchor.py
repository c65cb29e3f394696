"""A dynamo graph reused for several instances of a block tells them apart by a parameter it
receives (its anchor, ``dynamo_versions._Captured``). A parameter tied across instances (layer 1's
``fc.weight`` is layer 0's) names both: taken as the anchor, layer 1's call ran under layer
0's names as its second call (``layers.0.fc_1`` held layer 1's ``fc`` value, and
``layers.1.fc`` was no site). An anchor owned by one instance alone is preferred. Values and
names against hooks on the untapped model, in the default capture (a graph break splits each
block) and with shared blocks."""

from __future__ import annotations

import types

import pytest
import torch
from dynamo_support import SplitBlock
from torch import nn

import fxprobe


class _Tied(nn.Module):
    def __init__(self, split: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.config = types.SimpleNamespace(use_cache=False)
        self.layers = nn.ModuleList([SplitBlock(split) for _ in range(3)])
        self.layers[1].fc.weight = self.layers[0].fc.weight  # tied across layers

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.mark.parametrize("mode", ["split", "shared"])
def test_a_parameter_tied_across_layers_is_no_anchor(
        monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    if mode == "shared":
        monkeypatch.setenv("FXPROBE_DYNAMO_REGIONS", "shared")
    model = _Tied(split=mode == "split").eval()
    tapped = fxprobe.tap(model, ops="layers.*.fc", tracer="dynamo")
    x = torch.randn(2, 8)
    with torch.no_grad():
        out = tapped(x)
    kept: dict[str, torch.Tensor] = {}
    handles = [model.get_submodule(f"layers.{i}.fc").register_forward_hook(
        lambda m, a, o, i=i: kept.__setitem__(f"layers.{i}.fc", o.detach().clone()))
        for i in range(3)]
    try:
        ref = model(x)
    finally:
        for h in handles:
            h.remove()
    torch.testing.assert_close(out, ref)
    assert sorted(tapped.taps) == ["layers.0.fc", "layers.1.fc", "layers.2.fc"]
    for name, value in kept.items():
        torch.testing.assert_close(tapped.taps[name], value, msg=name)
    with torch.no_grad(), tapped.intervene({"layers.1.fc": lambda s, v: v * 0}):
        edited = tapped(x)
    handle = model.layers[1].fc.register_forward_hook(lambda m, a, o: o * 0)
    try:
        torch.testing.assert_close(edited, model(x))
    finally:
        handle.remove()
