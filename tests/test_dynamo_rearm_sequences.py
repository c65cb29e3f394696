"""Sequences of calls around a model that raised while dynamo traced it (the frames made
capturable again by ``frontends/dynamo_rearm.py``): a list cache appended to before the raise,
an edit function that raises, more raises than ``recompile_limit``, train mode with backward
after the raise, two taps of one class, the user's outer ``torch.compile``, ``tracer="auto"``
and shared blocks. Each against the untapped model doing the same sequence."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from reference import hooked
from torch import nn

import fxprobe
from fxprobe.core.errors import DynamoError


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> None:
    torch._dynamo.reset()  # each test's raises and recompiles of these classes are its own


class Block(nn.Module):
    def __init__(self, split: bool) -> None:
        super().__init__()
        self.fc, self.out, self.split = nn.Linear(4, 4), nn.Linear(4, 4), split

    def forward(self, x: torch.Tensor, cache: torch.Tensor | None = None, i: int = 0,
                fail: bool = False) -> torch.Tensor:
        h = torch.relu(self.fc(x))
        if cache is not None:
            cache[i].add_(h)  # a side effect before the raise (a key/value cache's update)
        if self.split:
            torch._dynamo.graph_break()
        if fail:
            raise ValueError("bad step")
        return x + self.out(h)


class Stack(nn.Module):
    def __init__(self, split: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Block(split) for _ in range(3)])

    def forward(self, x: torch.Tensor, cache: torch.Tensor | None = None,
                fail_at: int = -1) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x, cache, i, i == fail_at)
        return x


def _ref_fc(model: Stack, x: torch.Tensor) -> list[torch.Tensor]:
    """Each layer's fc output on the untapped model."""
    outs = []
    for layer in model.layers:
        outs.append(layer.fc(x))
        x = layer(x)
    return outs


def _check(tapped: Any, model: Stack, x: torch.Tensor, out: torch.Tensor) -> None:
    torch.testing.assert_close(out, model(x))
    for i, ref in enumerate(_ref_fc(model, x)):
        torch.testing.assert_close(tapped.taps[f"layers.{i}.fc"], ref)


@pytest.mark.parametrize("split", [False, True], ids=["whole", "graph-break"])
def test_a_cache_appended_before_the_raise_matches_the_untapped_model(split: bool) -> None:
    torch.manual_seed(0)
    model = Stack(split)
    tapped = fxprobe.tap(model, ops="layers.*.fc", tracer="dynamo")
    mine, theirs = torch.zeros(3, 2, 4), torch.zeros(3, 2, 4)
    with torch.no_grad():
        for fail_at in (-1, 1, -1, 2, 0, -1):
            x = torch.randn(2, 4)
            if fail_at >= 0:
                with pytest.raises(ValueError, match="bad step"):
                    tapped(x, mine, fail_at)
                with pytest.raises(ValueError, match="bad step"):
                    model(x, theirs, fail_at)
            else:
                out = tapped(x, mine)
                torch.testing.assert_close(out, model(x, theirs))
                torch.testing.assert_close(tapped.taps["layers.2.fc"], _ref_fc(model, x)[2])
            torch.testing.assert_close(mine, theirs)
        _check(tapped, model, x, tapped(x))


@pytest.mark.parametrize("split", [False, True], ids=["whole", "graph-break"])
def test_more_raises_than_the_recompile_limit_then_a_call(split: bool) -> None:
    torch.manual_seed(0)
    model = Stack(split)
    tapped = fxprobe.tap(model, ops="layers.*.fc", tracer="dynamo")
    limit = torch._dynamo.config.recompile_limit
    with torch.no_grad():
        tapped(torch.randn(2, 4))
        for k in range(limit + 3):
            with pytest.raises(ValueError, match="bad step"):
                tapped(torch.randn(2 + k % 3, 4), None, k % 3)
        for n in (2, 5):
            x = torch.randn(n, 4)
            try:
                out = tapped(x)
            except DynamoError:  # loud is allowed; a silent run without taps is not
                continue
            _check(tapped, model, x, out)


def test_an_edit_function_that_raises_then_edits_and_plain_calls() -> None:
    torch.manual_seed(0)
    model = Stack(True)
    tapped = fxprobe.tap(model, ops="layers.*.fc", tracer="dynamo")
    x = torch.randn(2, 4)

    def boom(site: Any, t: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("edit failed")

    with torch.no_grad():
        tapped(x)
        with pytest.raises(RuntimeError, match="edit failed"):
            with tapped.intervene({"layers.1.fc": boom}):
                tapped(x)
        _check(tapped, model, x, tapped(x))  # no edit left behind
        with tapped.intervene({"layers.1.fc": lambda site, t: t * 2}):
            out = tapped(x)
        ref, _ = hooked(model, lambda: model(x), {"layers.1.fc": lambda o: o * 2})
        torch.testing.assert_close(out, ref)
        _check(tapped, model, x, tapped(x))


@pytest.mark.parametrize("split", [False, True], ids=["whole", "graph-break"])
def test_train_mode_backward_after_a_raise(split: bool) -> None:
    torch.manual_seed(0)
    model = Stack(split).train()
    twin = Stack(split).train()
    twin.load_state_dict(model.state_dict())
    tapped = fxprobe.tap(model, ops="layers.*.fc", tracer="dynamo")
    x = torch.randn(3, 4)
    tapped(x).sum().backward()
    with pytest.raises(ValueError, match="bad step"):
        tapped(x, None, 1)
    model.zero_grad()
    out = tapped(x)
    out.pow(2).sum().backward()
    twin(x).pow(2).sum().backward()
    torch.testing.assert_close(out, twin(x))
    for (name, p), q in zip(model.named_parameters(), twin.parameters(), strict=True):
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, q.grad, msg=name)
    with torch.no_grad():
        for i, ref in enumerate(_ref_fc(twin, x)):
            torch.testing.assert_close(tapped.taps[f"layers.{i}.fc"], ref)


@pytest.mark.parametrize("split", [False, True], ids=["whole", "graph-break"])
def test_two_taps_of_one_class_only_one_raised(split: bool) -> None:
    torch.manual_seed(0)
    a, b = Stack(split), Stack(split)
    ta = fxprobe.tap(a, ops="layers.*.fc", tracer="dynamo")
    tb = fxprobe.tap(b, ops="layers.0.fc", tracer="dynamo")
    x = torch.randn(2, 4)
    with torch.no_grad():
        ta(x)
        tb(x)
        with pytest.raises(ValueError, match="bad step"):
            tb(x, None, 2)
        for n in (2, 3):
            xs = torch.randn(n, 4)
            _check(ta, a, xs, ta(xs))
            torch.testing.assert_close(tb(xs), b(xs))
            torch.testing.assert_close(tb.taps["layers.0.fc"], b.layers[0].fc(xs))
            assert "layers.1.fc" not in tb.taps


def test_under_the_users_outer_compile() -> None:
    torch.manual_seed(0)
    model = Stack(False)
    tapped = fxprobe.tap(model, ops="layers.*.fc", tracer="dynamo")
    compiled = torch.compile(tapped, backend="eager")
    x = torch.randn(2, 4)
    with torch.no_grad():
        _check(tapped, model, x, compiled(x))
        with pytest.raises(ValueError, match="bad step"):
            compiled(x, None, 1)
        for n in (2, 3):
            xs = torch.randn(n, 4)
            _check(tapped, model, xs, compiled(xs))


@pytest.mark.parametrize("split", [False, True], ids=["whole", "graph-break"])
def test_tracer_auto_after_a_raise(split: bool) -> None:
    torch.manual_seed(0)
    model = Stack(split)
    tapped = fxprobe.tap(model, ops="layers.*.fc", tracer="auto")
    x = torch.randn(2, 4)
    with torch.no_grad():
        with pytest.raises(ValueError, match="bad step"):
            tapped(x, None, 0)
        for n in (2, 3):
            xs = torch.randn(n, 4)
            _check(tapped, model, xs, tapped(xs))
