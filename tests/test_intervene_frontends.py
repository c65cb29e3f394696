"""Per-call interventions and caches on every frontend that runs a graph or a hook.

``tapped.intervene`` and ``tapped.run_with_cache`` raised ``ConfigError`` on any model torch.fx
traced whole (the default path); they now reach fx regions (a version with an intervention
point at every site), hooked modules (the site's hook applies the table) and dynamo's graphs,
by one mechanism (``Pipeline.point``). Each test runs the same sequence of calls under every
tracer and compares with forward hooks on the untapped model (the reference).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import fxprobe

TRACERS = ["fx", "hooks", "auto", "dynamo"]


class Twice(nn.Module):
    """A module called twice in one forward (sites ``lin`` and ``lin_1`` everywhere)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.act = nn.ReLU()
        self.out = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.lin(self.act(self.lin(x))))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))


def _hooked(model: nn.Module, edits: dict[tuple[str, int], Callable[[Any], Any]],
            x: torch.Tensor) -> torch.Tensor:
    """``model(x)`` with forward hooks replacing the output of call ``n`` (from 0) of the
    module at each path."""
    handles = []
    for path in {p for p, _ in edits}:
        seen = [0]

        def hook(m: nn.Module, args: Any, out: Any, path: str = path,
                 seen: list[int] = seen) -> Any:
            fn = edits.get((path, seen[0]))
            seen[0] += 1
            return fn(out) if fn is not None else None

        handles.append(model.get_submodule(path).register_forward_hook(hook))
    try:
        return model(x)
    finally:
        for h in handles:
            h.remove()


def _kept(model: nn.Module, paths: list[str], x: torch.Tensor) -> dict[str, torch.Tensor]:
    """Each module's outputs, cloned, named as the sites are (``lin``, ``lin_1``)."""
    out: dict[str, torch.Tensor] = {}
    handles = []
    for path in paths:
        def hook(m: nn.Module, args: Any, o: torch.Tensor, path: str = path) -> None:
            n = sum(1 for k in out if k == path or k.startswith(path + "_"))
            out[f"{path}_{n}" if n else path] = o.detach().clone()
        handles.append(model.get_submodule(path).register_forward_hook(hook))
    try:
        model(x)
    finally:
        for h in handles:
            h.remove()
    return out


def _zero(channels: slice) -> Callable[[Any], Any]:
    def fn(v: torch.Tensor) -> torch.Tensor:
        v = v.clone()
        v[:, channels] = 0
        return v
    return fn


@pytest.mark.parametrize("tracer", TRACERS)
def test_an_edit_applies_to_its_block_flows_on_and_is_what_the_taps_keep(tracer: str) -> None:
    model = _model()
    x = torch.randn(5, 4)
    tapped = fxprobe.tap(model, ops=nn.Tanh, tracer=tracer)
    plain = tapped(x)
    assert torch.equal(plain, model(x))
    edit = _zero(slice(0, 3))
    ref = _hooked(model, {("1", 0): edit}, x)
    assert not torch.equal(ref, plain)
    with tapped.intervene({"1": lambda s, v: edit(v)}):
        out = tapped(x)
        assert torch.equal(tapped.taps["3"], _kept_after(model, {("1", 0): edit}, "3", x))
        again = tapped(x)  # every call of the block
    assert torch.equal(out, ref) and torch.equal(again, ref)
    assert torch.equal(tapped(x), model(x))  # after the block: as written
    assert torch.equal(tapped.taps["3"], _kept(model, ["3"], x)["3"])
    with tapped.intervene({"3": lambda s, v: -v}):  # a second block, another site
        assert torch.equal(tapped(x), _hooked(model, {("3", 0): torch.neg}, x))


def _kept_after(model: nn.Module, edits: dict[tuple[str, int], Callable[[Any], Any]],
                path: str, x: torch.Tensor) -> torch.Tensor:
    kept: list[torch.Tensor] = []
    handle = model.get_submodule(path).register_forward_hook(
        lambda m, a, o: kept.append(o.detach().clone()))
    try:
        _hooked(model, edits, x)
    finally:
        handle.remove()
    return kept[0]


@pytest.mark.parametrize("tracer", TRACERS)
def test_gradients_flow_through_an_edit(tracer: str) -> None:
    model = _model()
    x = torch.randn(5, 4)
    tapped = fxprobe.tap(model, ops=nn.Tanh, tracer=tracer)
    with tapped.intervene({"2": lambda s, v: v * 3}):
        tapped(x).square().sum().backward()
    got = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    model.zero_grad()
    _hooked(model, {("2", 0): lambda v: v * 3}, x).square().sum().backward()
    for g, p in zip(got, model.parameters(), strict=True):
        assert torch.allclose(g, p.grad)  # type: ignore[arg-type]


@pytest.mark.parametrize("tracer", TRACERS)
def test_nested_blocks_compose_outer_first_and_the_inner_one_ends_first(tracer: str) -> None:
    model = _model()
    x = torch.randn(5, 4)
    tapped = fxprobe.tap(model, ops=nn.ReLU, tracer=tracer)
    with tapped.intervene({"2": lambda s, v: v + 1}):
        with tapped.intervene({"2": lambda s, v: v * 2, "4": lambda s, v: -v}):
            inner = tapped(x)
        outer = tapped(x)
    assert torch.equal(inner, _hooked(model, {("2", 0): lambda v: (v + 1) * 2,
                                             ("4", 0): torch.neg}, x))
    assert torch.equal(outer, _hooked(model, {("2", 0): lambda v: v + 1}, x))
    assert torch.equal(tapped(x), model(x))


@pytest.mark.parametrize("tracer", TRACERS)
def test_a_module_called_twice_is_edited_at_the_call_named(tracer: str) -> None:
    torch.manual_seed(1)
    model = Twice()
    x = torch.randn(3, 4)
    tapped = fxprobe.tap(model, ops="out", tracer=tracer)
    for name, n in [("lin_1", 1), ("lin", 0), ("lin_1", 1)]:  # each block, each call
        with tapped.intervene({name: lambda s, v: v * 0 + 1}):
            out = tapped(x)
        assert torch.equal(out, _hooked(model, {("lin", n): lambda v: v * 0 + 1}, x)), name
    _, cache = tapped.run_with_cache(x, names="lin*")
    assert list(cache) == ["lin", "lin_1"]
    kept = _kept(model, ["lin"], x)
    assert torch.equal(cache["lin"], kept["lin"]) and torch.equal(cache["lin_1"], kept["lin_1"])


@pytest.mark.parametrize("tracer", TRACERS)
def test_an_edit_that_raises_leaves_no_block_behind(tracer: str) -> None:
    model = _model()
    x = torch.randn(5, 4)
    tapped = fxprobe.tap(model, ops=nn.Tanh, tracer=tracer)

    def boom(site: fxprobe.Site, v: torch.Tensor) -> torch.Tensor:
        raise ValueError("the edit failed")

    with pytest.raises(ValueError, match="the edit failed"):
        with tapped.intervene({"1": boom}):
            tapped(x)
    assert tapped._state.pipeline.per_call.table is None
    assert torch.equal(tapped(x), model(x))
    assert torch.equal(tapped.taps["3"], _kept(model, ["3"], x)["3"])
    with tapped.intervene({"1": lambda s, v: v * 0}):  # and a block after it works
        assert torch.equal(tapped(x), _hooked(model, {("1", 0): lambda v: v * 0}, x))


@pytest.mark.parametrize("tracer", TRACERS)
def test_run_with_cache_keeps_every_module_output_as_hooks_see_it(tracer: str) -> None:
    model = _model()
    tapped = fxprobe.tap(model, ops=nn.Tanh, tracer=tracer)
    paths = ["0", "1", "2", "3", "4"]
    for batch in (5, 2):  # a second call, another shape
        x = torch.randn(batch, 4)
        out, cache = tapped.run_with_cache(x)
        assert torch.equal(out, model(x))
        kept = _kept(model, paths, x)
        assert [n for n in cache if n in paths] == paths
        for p in paths:
            assert torch.equal(cache[p], kept[p]), (tracer, p)
        assert list(tapped.taps) == ["3"]
    with tapped.intervene({"1": lambda s, v: v * 0}):  # a cache inside a block: after edits
        _, cache = tapped.run_with_cache(x, names=["1", "2"])
    assert list(cache) == ["1", "2"] and not cache["1"].any()
    assert torch.equal(cache["2"], model[2](torch.zeros(2, 8)).detach())


@pytest.mark.parametrize("tracer", ["fx", "hooks", "auto"])
def test_an_in_place_module_is_edited_for_the_code_after_it(tracer: str) -> None:
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(inplace=True), nn.Linear(6, 2))
    x = torch.randn(3, 4)
    tapped = fxprobe.tap(model, ops="2", tracer=tracer)
    with torch.no_grad():
        with tapped.intervene({"1": lambda s, v: v + 1}):
            out = tapped(x)
        ref = _hooked(model, {("1", 0): lambda v: v + 1}, x)
    assert torch.equal(out, ref)


def test_a_selector_no_site_matches_says_so_on_every_frontend() -> None:
    model = _model()
    for tracer in TRACERS:
        tapped = fxprobe.tap(model, ops=nn.Tanh, tracer=tracer)
        with pytest.raises(fxprobe.SelectorError, match="'nine'"):
            with tapped.intervene({"nine": lambda s, v: v}):
                tapped(torch.randn(2, 4))


def test_a_tapped_artifact_refuses_per_call_blocks_and_says_why() -> None:
    model = _model().eval()
    x = torch.randn(2, 4)
    artifacts = [fxprobe.tap(torch.jit.script(model), ops="1"),
                 fxprobe.tap(torch.export.export(model, (x,)), ops=nn.ReLU)]
    for tapped, kind in zip(artifacts, ["TorchScript module", "torch.export program"],
                            strict=True):
        with pytest.raises(fxprobe.ConfigError, match=f"a {kind} runs its saved graph"):
            tapped.intervene({"1": lambda s, v: v})
        with pytest.raises(fxprobe.ConfigError, match=r"fxprobe.tap\(model\)"):
            tapped.run_with_cache(x)
        assert torch.equal(tapped(x), model(x))  # and the artifact runs on


class _Odd(nn.Module):
    """fx cannot trace it (data-dependent control flow): tracer="auto" runs it under dynamo."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) if x.sum() > 0 else self.lin(x) * 2


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).relu()


@pytest.mark.parametrize("call_between", [False, True])
def test_a_hook_registered_after_tap_runs_inside_a_block(call_between: bool) -> None:
    """The root region has no tap (only the dynamo module's site is selected), so outside a
    block the root runs as written and a hook registered later on an inlined module runs;
    the block's version with points inlined it too, and ran without the hook (silently other
    values than the model's). It is traced again, as the graphs of tap() are."""
    torch.manual_seed(3)
    model = nn.Sequential(_Block(), _Odd())
    x = torch.randn(2, 4)
    tapped = fxprobe.tap(model, ops="1.lin")
    tapped(x)
    handle = model[0].register_forward_hook(lambda m, a, o: o * 0 + 1)
    try:
        if call_between:  # the copy has the hook when the block's graphs are built
            assert torch.equal(tapped(x), model(x))
        with pytest.warns(UserWarning, match="traced again"):
            with tapped.intervene({"1.lin": lambda s, v: v * 2}):
                out = tapped(x)
        assert torch.equal(out, _hooked(model, {("1.lin", 0): lambda v: v * 2}, x))
        assert torch.equal(tapped(x), model(x))
    finally:
        handle.remove()


@pytest.mark.parametrize("capture", ["input", "both"])
def test_a_hooked_module_called_twice_is_edited_at_its_call_whatever_is_captured(
        capture: str) -> None:
    """With capture="input" the pre-hook names each call (``lin``, ``lin_1``); the output's
    per-call step named it again (``lin_1`` for the first call: the edit went to no call)."""
    torch.manual_seed(4)
    model = Twice()
    x = torch.randn(3, 4)
    tapped = fxprobe.tap(model, ops="lin", tracer="hooks", capture=capture)
    for name, n in [("lin", 0), ("lin_1", 1)]:
        with tapped.intervene({name: lambda s, v: v * 0 + 1}):
            out = tapped(x)
        assert torch.equal(out, _hooked(model, {("lin", n): lambda v: v * 0 + 1}, x)), name
        assert list(tapped.taps) == ["lin", "lin_1"]
