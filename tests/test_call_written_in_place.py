"""A module whose output its own code writes in place after computing it (``y.copy_(z)``,
``y.add_(b)``; a row-parallel layer's in-place ``all_reduce`` of its partial sum): the module's
site is the value the call hands on, under every tracer, read and edited; the reference is
forward hooks (cloning, or editing) on an untapped copy."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fxprobe


class Writes(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.how = how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        if self.how == "copy_":
            y.copy_(y * 2 - 1)
        else:  # two writes, the second through the first's result
            y.add_(1.0).mul_(3.0)
        return y


class Net(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.a = Writes(how)
        self.b = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x)) + 0.5


def reference(model: nn.Module, x: torch.Tensor, scale: float | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """The output of ``a`` (cloned by a hook; scaled there when ``scale``) and the model's."""
    model = copy.deepcopy(model)
    got = {}

    def hook(mod: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        got["a"] = out.clone()
        return out * scale if scale is not None else out

    model.a.register_forward_hook(hook)
    with torch.no_grad():
        y = model(x)
    return got["a"], y


@pytest.mark.parametrize("tracer", ["dynamo", "fx", "hooks"])
@pytest.mark.parametrize("how", ["copy_", "add_mul_"])
def test_module_output_after_its_own_in_place_writes(tracer: str, how: str) -> None:
    torch.manual_seed(0)
    model = Net(how).eval()
    tapped = fxprobe.tap(model, ops="a", tracer=tracer)
    for n in (2, 5):  # a second call, a new shape
        x = torch.randn(n, 4)
        want_a, want_y = reference(model, x)
        with torch.no_grad():
            y = tapped(x)
        torch.testing.assert_close(tapped.taps["a"], want_a, rtol=0, atol=0)
        torch.testing.assert_close(y, want_y, rtol=0, atol=0)


@pytest.mark.parametrize("tracer", ["dynamo", "fx", "hooks"])
def test_an_edit_of_that_output_reaches_the_code_after_the_call(tracer: str) -> None:
    torch.manual_seed(0)
    model = Net("copy_").eval()
    tapped = fxprobe.tap(model, ops="a", tracer=tracer, fn=lambda name, v: v * 3.0)
    x = torch.randn(2, 4)
    want_a, want_y = reference(model, x, scale=3.0)
    with torch.no_grad():
        y = tapped(x)
    torch.testing.assert_close(y, want_y)
    if tracer != "dynamo":
        return  # per-call edits reach what dynamo captures
    with torch.no_grad():  # per call too, on a plain tap
        plain = fxprobe.tap(model, ops="a", tracer=tracer)
        with plain.intervene({"a": lambda s, v: v * 3.0}):
            y2 = plain(x)
    torch.testing.assert_close(y2, want_y)

