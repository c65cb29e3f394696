"""A module that writes its output in place through a view (``y.view(-1).add_(1)``, a slice, a
transpose, a chain of views, another view of the same base): its site shows what the module
returned, as a forward hook that clones its output sees on an untapped copy; never a write by
code outside the module after it returned."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import fxprobe

TRACERS = ["fx", "dynamo", "auto"]

_WRITES: dict[str, Callable[[torch.Tensor], Any]] = {
    "view": lambda y: y.view(-1).add_(1),
    "reshape": lambda y: y.reshape(-1).mul_(2),
    "transpose": lambda y: y.transpose(0, 1)[0].zero_(),
    "t_method": lambda y: y.t().add_(3),
    "slice": lambda y: y[:, :2].mul_(0),
    "select": lambda y: y.select(1, 0).fill_(3.0),
    "unsqueeze": lambda y: y.unsqueeze(0).add_(1),
    "as_strided": lambda y: torch.as_strided(y, (2,), (1,)).add_(5),
    "chain": lambda y: y.view(-1, 2)[0].unsqueeze(0).mul_(3),
    "relu_fn": lambda y: torch.relu_(y.view(-1)),
    "functional_inplace": lambda y: torch.nn.functional.relu(y[0], inplace=True),
    "setitem_view": lambda y: y.view(-1).__setitem__(slice(0, 3), 7.0),
    "setitem": lambda y: y.__setitem__(0, 7.0),
    "view_then_direct": lambda y: (y.view(-1).add_(1), y.mul_(2)),
    "copy_into_view": lambda y: y[1:].copy_(y[:-1] * 0 + 4),
}


class _Writes(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.how = how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        _WRITES[self.how](y)
        return y


class _OtherView(nn.Module):
    """Returns a view of a base that it then writes through another view of the base."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        y = h[:, :2]
        h[:, 1:3].add_(1)  # overlaps y's second column
        return y


class _Outer(nn.Module):
    def __init__(self, w: nn.Module, width: int = 4, after: bool = False) -> None:
        super().__init__()
        self.w = w
        self.head = nn.Linear(width, 3)
        self.after = after

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.w(x)
        if self.after:  # code outside the module writes what it returned
            y.view(-1).add_(100)
        return self.head(y)


class _Twice(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.w = _Writes(how)
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.w(self.w(x).relu()))


def _hooked(model: nn.Module, names: list[str], x: torch.Tensor
            ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The output of an untapped copy, and each call's output of each module in ``names``
    (``w``, ``w_1``), cloned by a forward hook."""
    ref = copy.deepcopy(model)
    seen: dict[str, torch.Tensor] = {}
    for name in names:
        def keep(m: nn.Module, a: Any, out: torch.Tensor, name: str = name) -> None:
            calls = sum(1 for k in seen if k == name or k.startswith(name + "_"))
            seen[f"{name}_{calls}" if calls else name] = out.detach().clone()
        ref.get_submodule(name).register_forward_hook(keep)
    with torch.no_grad():
        out = ref(x)
    return out, seen


def _check(model: nn.Module, tracer: str, names: list[str], ops: list[str]) -> None:
    torch._dynamo.reset()
    tapped = fxprobe.tap(model, ops=ops, tracer=tracer)
    for x in [torch.randn(3, 4), torch.randn(5, 4), torch.randn(3, 4)]:
        with torch.no_grad():
            out = tapped(x)
        expected, seen = _hooked(model, names, x)
        torch.testing.assert_close(out, expected)
        assert sorted(tapped.taps) == sorted(ops)
        for name in ops:
            torch.testing.assert_close(tapped.taps[name], seen[name], msg=name)


@pytest.mark.parametrize("how", sorted(_WRITES))
@pytest.mark.parametrize("tracer", ["fx", "dynamo"])
def test_a_write_through_a_view_shows_in_the_module_site(tracer: str, how: str) -> None:
    torch.manual_seed(0)
    _check(_Outer(_Writes(how)).eval(), tracer, ["w", "w.lin"], ["w", "w.lin"])


@pytest.mark.parametrize("tracer", TRACERS)
def test_a_write_through_another_view_of_the_base_shows(tracer: str) -> None:
    torch.manual_seed(0)
    _check(_Outer(_OtherView(), width=2).eval(), tracer, ["w", "w.lin"], ["w", "w.lin"])


@pytest.mark.parametrize("how", ["view", "slice", "none"])
@pytest.mark.parametrize("tracer", TRACERS)
def test_a_write_outside_the_module_after_it_returned_does_not_show(tracer: str, how: str
                                                                   ) -> None:
    torch.manual_seed(0)
    w = _Writes(how) if how != "none" else nn.Linear(4, 4)
    names = ["w", "w.lin"] if how != "none" else ["w"]
    _check(_Outer(w, after=True).eval(), tracer, names, names)


@pytest.mark.parametrize("how", ["view", "chain", "setitem"])
@pytest.mark.parametrize("tracer", TRACERS)
def test_a_module_called_twice_shows_each_call_after_its_write(tracer: str, how: str) -> None:
    torch.manual_seed(0)
    _check(_Twice(how).eval(), tracer, ["w"], ["w", "w_1"])


@pytest.mark.parametrize("tracer", TRACERS)
def test_an_edit_of_a_module_written_through_a_view_flows_on(tracer: str) -> None:
    torch.manual_seed(0)
    model = _Outer(_Writes("view")).eval()
    torch._dynamo.reset()
    tapped = fxprobe.tap(model, ops="head", tracer=tracer)
    for x in [torch.randn(3, 4), torch.randn(5, 4)]:
        with torch.no_grad(), tapped.intervene({"w": lambda s, v: v * 10}):
            out = tapped(x)
        ref = copy.deepcopy(model)
        ref.w.register_forward_hook(lambda m, a, o: o * 10)
        with torch.no_grad():
            torch.testing.assert_close(out, ref(x))
            torch.testing.assert_close(tapped(x), model(x))  # and gone after the block


class _WritesItsInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.view(-1)[:2].add_(10)  # the previous call's output, written by this call
        y = self.lin(x)
        y[:, 1:].mul_(3)
        return y


class _Chain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = _WritesItsInput()
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.w(x * 1)
        b = self.w(a)
        return self.head(b) + a.sum()


@pytest.mark.parametrize("tracer", ["fx", "dynamo"])
def test_the_next_call_writing_a_calls_output_through_a_view_does_not_show(tracer: str
                                                                             ) -> None:
    torch.manual_seed(0)
    _check(_Chain().eval(), tracer, ["w", "w.lin"], ["w", "w_1", "w.lin", "w.lin_1"])
