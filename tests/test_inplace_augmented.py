"""Augmented assignment (x += y) on tensors, views, model inputs and numbers, recorded as the
in-place op it is."""

from __future__ import annotations

import pytest
import torch
import zoo
from reference import hook_values

import fxprobe


class _AddIntoViewed(torch.nn.Module):
    """``x += 1`` writes ``x``'s storage: the view ``v`` made before it sees the update."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, a: torch.Tensor) -> torch.Tensor:
        x = self.lin(a)
        v = x.view(-1)
        x += 1
        return v * 2


class _AliasedResidual(torch.nn.Module):
    """A residual whose branch hands its input back (``body`` is an Identity): ``out`` is
    ``identity``, so ``out += identity`` doubles ``identity`` too."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)
        self.body = torch.nn.Identity()

    def forward(self, a: torch.Tensor) -> torch.Tensor:
        identity = self.fc(a)
        out = self.body(identity)
        out += identity
        return out + identity  # 2 * fc + 2 * fc in eager


class _AddsIntoInput(torch.nn.Module):
    """``x += bias`` on a tensor the caller gave: eager updates the caller's tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        x += bias
        return self.fc(x)


@pytest.mark.parametrize("ops", [None, ["lin"]])
def test_augmented_assignment_updates_a_view_made_before_it(ops: list[str] | None) -> None:
    """``x += 1`` is ``x.add_(1)`` in eager: fx recorded it as ``x + 1``, so ``v`` missed the
    update and the tapped output was ``2 * lin`` instead of the model's ``2 * (lin + 1)``."""
    model = _AddIntoViewed().eval()
    a = torch.randn(2, 4, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        expected, seen = hook_values(model, ["lin"], a)
        tapped = fxprobe.tap(model, ops=ops)
        out = tapped(a)
    lin = seen["lin"]
    assert torch.equal(expected, 2 * (lin.reshape(-1) + 1))
    assert torch.equal(out, expected)
    assert torch.equal(tapped.taps["lin"], lin)  # as produced, before the +=
    if ops is None:
        assert torch.equal(tapped.taps["view"], lin.reshape(-1))
        assert torch.equal(tapped.taps["add"], lin + 1)
        assert torch.equal(tapped.taps["mul"], expected)
        assert {"lin", "view"} <= tapped.copied  # v reads the storage after the +=


@pytest.mark.parametrize("tracer", ["fx", "auto"])
def test_a_residual_add_into_an_aliased_identity(tracer: str) -> None:
    """``out += identity`` where ``out`` is ``identity``: the output was ``3 * fc`` instead of
    ``4 * fc``; ``fc`` and ``body`` are shown as produced, as cloning hooks see them."""
    model = _AliasedResidual().eval()
    a = torch.randn(2, 4, generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        expected, seen = hook_values(model, ["fc", "body"], a)
        tapped = fxprobe.tap(model, tracer=tracer)
        out = tapped(a)
    assert torch.equal(expected, 4 * seen["fc"])
    assert torch.equal(out, expected)
    assert torch.equal(tapped.taps["fc"], seen["fc"])
    assert torch.equal(tapped.taps["body"], seen["body"])
    assert torch.equal(tapped.taps["add"], 2 * seen["fc"])
    assert torch.equal(tapped.taps["add_1"], expected)
    assert {"fc", "body"} <= tapped.copied


def test_augmented_assignment_into_a_model_input_reaches_the_caller() -> None:
    """``x += bias`` on a model input: eager changes the caller's tensor; the tapped module
    did not (fx made it ``x + bias``). The input is shown as given, and the write into it is
    never run out of place (storage the graph does not own)."""
    model = _AddsIntoInput().eval()
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(9))
    bias = torch.ones(4)
    mine, theirs = x.clone(), x.clone()
    tapped = fxprobe.tap(model)
    with torch.no_grad():
        out = tapped(mine, bias)
        expected, seen = hook_values(model, ["fc"], theirs, bias)
    assert torch.equal(theirs, x + 1)  # the model's own behaviour
    assert torch.equal(out, expected) and torch.equal(mine, theirs)
    assert torch.equal(tapped.taps["x"], x)
    assert torch.equal(tapped.taps["add"], x + 1)
    assert torch.equal(tapped.taps["fc"], seen["fc"])
    assert "x" in tapped.copied and not tapped.outplaced


class _SizeArithmetic(torch.nn.Module):
    """``n += 1`` on a number: a new value; ``m``, a second name of the old one, keeps it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.size(0)
        m = n
        n += 1
        y = x.new_ones(m, n)
        y *= 3  # on a tensor, in place
        return y


def test_augmented_assignment_on_a_number_makes_a_new_value() -> None:
    model = _SizeArithmetic()
    x = torch.randn(2, 4)
    tapped = fxprobe.tap(model)
    out = tapped(x)
    assert out.shape == (2, 3) and torch.equal(out, model(x))
    assert torch.equal(tapped.taps["new_ones"], torch.ones(2, 3))  # before the *=


def test_an_inplace_add_before_an_inplace_relu_runs_out_of_place() -> None:
    """A ResNet block taps every site without a copy where fx used to: ``bn2`` is written by
    ``out += identity`` and ``add`` by ``ReLU(inplace=True)``, each the first write that
    nothing else sees, so each runs out of place; the values are as cloning hooks see them."""
    model, (x,), _ = zoo.make("resnet")
    model.eval()
    paths = ["layer1.0.bn2", "layer1.0.relu"]
    with torch.no_grad():
        expected, seen = hook_values(model, paths, x)
        tapped = fxprobe.tap(model)
        out = tapped(x)
    assert torch.equal(out, expected)
    assert torch.equal(tapped.taps["layer1.0.bn2"], seen["layer1.0.bn2"])
    assert torch.equal(tapped.taps["layer1.0.relu_1"], seen["layer1.0.relu_1"])
    assert {"layer1.0.bn2", "layer1.0.add"} <= tapped.outplaced
    assert not {n for n in tapped.copied if n.startswith("layer1.0.")}

