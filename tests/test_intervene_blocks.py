"""Per-call blocks at the edges of a tapped module's life: entered before its first forward,
left without a forward, holding only a cache; each value against forward hooks on an untapped
copy of the model."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import fxprobe


class Inner(nn.Module):
    """fx cannot trace it (a data-dependent ``if``); dynamo breaks its graph."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > -1e9:
            x = self.fc(x).relu()
        torch._dynamo.graph_break()
        return self.fc(x)


class Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = Inner()
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.inner(x))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return Outer().eval()


def _hooked(model: nn.Module, x: torch.Tensor, scale: float | None) -> tuple[torch.Tensor,
                                                                             list[torch.Tensor]]:
    """The output and inner.fc's values, its first call's output scaled, on a copy."""
    ref = copy.deepcopy(model)
    seen: list[torch.Tensor] = []

    def hook(mod: nn.Module, args: object, out: torch.Tensor) -> torch.Tensor:
        if scale is not None and not seen:
            out = out * scale
        seen.append(out.detach().clone())
        return out

    handle = ref.inner.fc.register_forward_hook(hook)
    with torch.no_grad():
        out = ref(x)
    handle.remove()
    return out, seen


def test_a_block_entered_before_the_first_forward_under_auto_edits_what_dynamo_captures():
    model = _model()
    x = torch.randn(3, 4)
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tapped = fxprobe.tap(model, ops=nn.Linear, tracer="auto")
        # inner.fc is a hook site of the fallback until dynamo has run Inner: not refused
        with tapped.intervene({"inner.fc": lambda s, v: v * 2}):
            out = tapped(x)
    want, _ = _hooked(model, x, 2.0)
    torch.testing.assert_close(out, want, rtol=0, atol=0)


def test_a_block_left_without_a_forward_checks_nothing_yet():
    model = _model()
    x = torch.randn(3, 4)
    torch._dynamo.reset()
    tapped = fxprobe.tap(model, ops=nn.Linear, tracer="dynamo")
    with tapped.intervene({"inner.fc": lambda s, v: v * 2}):
        pass  # nothing ran: no site is known, so no selector can be said to match none
    with tapped.intervene({"inner.fc": lambda s, v: v * 2}):
        out = tapped(x)
    want, _ = _hooked(model, x, 2.0)
    torch.testing.assert_close(out, want, rtol=0, atol=0)


def test_a_block_holding_only_a_cache_knows_the_sites_the_cache_found():
    model = _model()
    x = torch.randn(3, 4)
    torch._dynamo.reset()
    tapped = fxprobe.tap(model, ops=nn.Linear, tracer="dynamo")
    with tapped.intervene({"inner.fc": lambda s, v: v * 2}):
        out, cache = tapped.run_with_cache(x, names="inner.fc*")
    want, seen = _hooked(model, x, 2.0)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    assert sorted(cache) == ["inner.fc", "inner.fc_1"]
    for name, ref in zip(["inner.fc", "inner.fc_1"], seen, strict=True):
        torch.testing.assert_close(cache[name], ref, rtol=0, atol=0)


def test_an_edit_is_never_dropped_when_dynamo_fails_during_the_block():
    """Past the recompile limit (here: a second tap of the model in the process, whose resume
    frames share the first one's code and its compiled entries), dynamo fails inside the
    block and the module falls back to running as written, where a per-call edit does not
    reach: the forward raises instead of returning the unedited output."""
    model = _model()
    x = torch.randn(3, 4)
    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=1), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        first = fxprobe.tap(model, ops=nn.Linear, tracer="auto")
        first(x)
        first.remove()
        tapped = fxprobe.tap(model, ops=nn.Linear, tracer="auto")
        with pytest.raises(fxprobe.DynamoError, match="per-call run"):
            with tapped.intervene({"inner.fc_1": lambda s, v: v * 0}):
                tapped(x)
        out = tapped(x)  # outside a block: the module runs as written, its calls hooked
    want, seen = _hooked(model, x, None)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    assert tapped.fallbacks
    for name, ref in zip(["inner.fc", "inner.fc_1"], seen, strict=True):
        torch.testing.assert_close(tapped.taps[name], ref, rtol=0, atol=0)


def test_sites_after_an_edit_that_raised_are_not_taken_for_absent():
    """The first forward ends in an edit that raises at inner.fc, before the graph break:
    the sites after it (inner.fc_1) are not known yet, not absent; a block on them then
    edits them, equal to a hook making the same edit."""
    model = _model()
    x = torch.randn(3, 4)
    torch._dynamo.reset()
    tapped = fxprobe.tap(model, ops=nn.Linear, tracer="dynamo")

    def fails(site: object, value: torch.Tensor) -> torch.Tensor:
        raise ValueError("the edit failed")

    with pytest.raises(ValueError), tapped.intervene({"inner.fc": fails}):
        tapped(x)
    with tapped.intervene({"inner.fc_1": lambda s, v: v * 2}):
        out = tapped(x)
    ref = copy.deepcopy(model)
    calls: list[int] = []

    def hook(mod: nn.Module, args: object, value: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return value * 2 if len(calls) == 2 else value

    ref.inner.fc.register_forward_hook(hook)
    with torch.no_grad():
        want = ref(x)
    torch.testing.assert_close(out, want, rtol=0, atol=0)


def test_sites_after_an_edit_that_raised_at_a_modules_second_call_are_not_taken_for_absent():
    """As above, the edit raising at the second call of a module called twice: its first
    call ran to its end, the second did not, so inner.fc_3 is still to be found."""
    from life_models import twice

    model = twice()
    x = torch.randn(3, 4)
    torch._dynamo.reset()
    tapped = fxprobe.tap(model, ops=[nn.Linear, torch.relu], tracer="auto")

    def fails(site: object, value: torch.Tensor) -> torch.Tensor:
        raise ValueError("the edit failed")

    with pytest.raises(ValueError), tapped.intervene({"inner.fc_2": fails}):
        tapped(x)
    with tapped.intervene({"inner.fc_3": lambda s, v: v * 2}):
        out = tapped(x)
    ref = copy.deepcopy(model)
    calls: list[int] = []

    def hook(mod: nn.Module, args: object, value: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return value * 2 if len(calls) == 4 else value

    ref.inner.fc.register_forward_hook(hook)
    with torch.no_grad():
        want = ref(x)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
