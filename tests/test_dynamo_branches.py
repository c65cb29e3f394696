"""A module whose forward branches on a length, under dynamo: one site per module call, under
the same name whichever branch ran (each branch is a graph of its own), against forward hooks
that clone on an untapped copy of the model."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

import fxprobe


class _Branches(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > 4:
            return self.a(x).relu()  # an early return
        y = self.b(x)
        return y * 2


class _Helpers(_Branches):
    """Branches through functions defined in its forward (frames of their own)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        def long(t: torch.Tensor) -> torch.Tensor:
            return self.a(t).relu()

        def short(t: torch.Tensor) -> torch.Tensor:
            return self.b(t) * 2

        if x.shape[0] > 4:
            return long(x)
        return short(x)


class _TwoSites(nn.Module):
    """The branching module called at two lines, with inputs of different lengths."""

    def __init__(self) -> None:
        super().__init__()
        self.blk = _Branches()
        self.head = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first = self.blk(x)
        second = self.blk(x[:3])
        return self.head(first).sum(0) + second.sum(0)


class _Nested(nn.Module):
    """The branching module called twice in one expression (the same line)."""

    def __init__(self) -> None:
        super().__init__()
        self.blk = _Branches()
        self.head = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blk(self.blk(x)))


def _hooked(model: nn.Module, name: str, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """Each call's output of module ``name`` (``blk``, ``blk_1``, ...) and ``head``'s."""
    ref = copy.deepcopy(model)
    seen: dict[str, torch.Tensor] = {}

    def keep(m: nn.Module, a: Any, out: torch.Tensor, name: str) -> None:
        calls = sum(1 for k in seen if k == name or k.startswith(name + "_"))
        seen[f"{name}_{calls}" if calls else name] = out.detach().clone()

    for n in (name, "head"):
        ref.get_submodule(n).register_forward_hook(lambda m, a, o, n=n: keep(m, a, o, n))
    with torch.no_grad():
        ref(x)
    return seen


@pytest.mark.parametrize(("tracer", "lengths", "blk"), [
    ("dynamo", [1, 7, 3, 8, 2], _Branches), ("dynamo", [7, 3, 9, 1], _Branches),
    ("auto", [1, 7, 3, 8, 2], _Branches), ("dynamo", [7, 3, 9, 1], _Helpers)])
def test_both_branches_name_the_module_call_the_same(tracer: str, lengths: list[int],
                                                     blk: type[nn.Module]) -> None:
    torch.manual_seed(0)
    model = nn.Sequential()
    model.blk = blk()
    model.head = nn.Linear(4, 4)
    model.eval()
    torch._dynamo.reset()
    tapped = fxprobe.tap(model, ops=["blk", "head"], tracer=tracer)
    for length in lengths:
        x = torch.randn(length, 4)
        with torch.no_grad():
            out = tapped(x)
        seen = _hooked(model, "blk", x)
        assert sorted(tapped.taps) == ["blk", "head"], length
        for name, value in seen.items():
            torch.testing.assert_close(tapped.taps[name], value, msg=f"{name} at {length}")
        torch.testing.assert_close(out, seen["head"])


@pytest.mark.parametrize("model_type", [_TwoSites, _Nested])
def test_a_branching_module_called_twice_keeps_its_names(model_type: type[nn.Module]) -> None:
    torch.manual_seed(0)
    model = model_type().eval()
    torch._dynamo.reset()
    tapped = fxprobe.tap(model, ops=["blk", "blk_1", "head"], tracer="dynamo")
    for length in [7, 2, 8, 3, 5]:
        x = torch.randn(length, 4)
        with torch.no_grad():
            tapped(x)
        seen = _hooked(model, "blk", x)
        assert sorted(tapped.taps) == ["blk", "blk_1", "head"], length
        for name, value in seen.items():
            torch.testing.assert_close(tapped.taps[name], value, msg=f"{name} at {length}")


def test_an_edit_of_a_branching_module_applies_in_both_branches() -> None:
    torch.manual_seed(0)
    model = nn.Sequential()
    model.blk = _Branches()
    model.head = nn.Linear(4, 4)
    model.eval()
    torch._dynamo.reset()
    tapped = fxprobe.tap(model, ops="head", tracer="dynamo")
    for length in [2, 7, 3, 9]:
        x = torch.randn(length, 4)
        with torch.no_grad(), tapped.intervene({"blk": lambda s, v: v * 0 + 1}):
            out = tapped(x)
        expected = model.head(torch.ones(length, 4))
        torch.testing.assert_close(out, expected, msg=str(length))
