"""The ways of reaching intermediate values that the suite compares, on the same sites.

Hooks can only reach module calls, so module calls are the common ground: a *site set* names
modules, and the taps of that set are the fx sites calling those modules (a module called three
times, like ResNet's shared ReLU, is three sites, and its hook fires three times). Functional
ops (``out += identity``, attention matmuls, ``F.gelu``) only taps reach; they form their own set.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

import fxprobe

from .modes import Mode
from .timing import Treatment

APPROACHES = ("A/A control", "traced (no taps)", "taps", "taps (dynamo)", "module hooks",
              "global hook", "logging hook")
DENSITIES = ("input only", "one", "10%", "all", "functional", "every site")


@dataclass(frozen=True)
class SiteSet:
    """Which sites a treatment captures."""

    density: str
    """``input only``, ``one``, ``10%``, ``all``, ``functional`` or ``every site``."""
    site_kind: str
    """``module calls``, ``functional ops``, ``input`` or ``any``."""
    names: frozenset[str]
    """fxprobe site names."""
    modules: tuple[str, ...]
    """Module paths (for hooks); empty when hooks cannot reach the set."""
    value_bytes: int
    """Bytes of the values at these sites in one forward (for the floors)."""


def _spread(items: Sequence[str], k: int) -> list[str]:
    n = len(items)
    return [items[(2 * i + 1) * n // (2 * k)] for i in range(k)]


def site_sets(records: Sequence[fxprobe.Site], nbytes: dict[str, int]) -> dict[str, SiteSet]:
    """The site sets of a model, from its sites (execution order) and each site's value size.

    ``nbytes`` has an entry for every site whose value holds tensors.
    """
    calls = [s for s in records if s.kind == "call_module"]
    modules: list[str] = []
    for s in calls:
        if str(s.target) not in modules:
            modules.append(str(s.target))
    sets: dict[str, SiteSet] = {}

    def module_set(density: str, chosen: list[str]) -> None:
        keep = set(chosen)
        names = frozenset(s.name for s in calls if str(s.target) in keep)
        sets[density] = SiteSet(density, "module calls", names, tuple(chosen),
                                sum(nbytes.get(n, 0) for n in names))

    inputs = frozenset(s.name for s in records if s.kind == "placeholder")
    sets["input only"] = SiteSet("input only", "input", inputs, (), 0)
    if modules:
        module_set("one", _spread(modules, 1))
        module_set("10%", _spread(modules, max(1, round(len(modules) / 10))))
        module_set("all", modules)
    functional = frozenset(s.name for s in records
                           if s.kind in ("call_function", "call_method") and s.name in nbytes)
    if functional:
        sets["functional"] = SiteSet("functional", "functional ops", functional, (),
                                     sum(nbytes[n] for n in functional))
    every = frozenset(s.name for s in records)
    sets["every site"] = SiteSet("every site", "any", every, (),
                                 sum(nbytes.get(n, 0) for n in every))
    return sets


@dataclass
class Built:
    """A treatment and what the suite reads after one of its forwards."""

    treatment: Treatment
    captured: Callable[[], Any]
    """What the capture holds after a forward."""
    count: Callable[[], int]
    """Values captured by the last forward."""
    close: Callable[[], None]
    """Remove whatever the approach installed."""
    per_call: Callable[[], list[Any]] | None = None
    """Module-call values of the last forward, in call order (for the stale-value check)."""
    copies: int | None = None
    """Copies fxprobe inserted (taps only)."""
    d2h_per_call: int = 0
    """Bytes each captured value sends to the host regardless of the capture (``.item()``)."""
    first_call_ms: float | None = None
    """The one-time cost paid by the first call (the dynamo frontend's capture and rewrite)."""


def step(fn: Callable[..., Any], model: nn.Module, inputs: tuple[Any, ...], train: bool,
         before: Callable[[], None] | None = None) -> Callable[[], Any]:
    """One call: a forward, or (``train``) a forward and a backward of the output's sum."""
    if train:
        def train_step() -> Any:
            if before is not None:
                before()
            model.zero_grad(set_to_none=True)
            fn(*inputs).sum().backward()
        return train_step
    if before is None:
        return lambda: fn(*inputs)

    def forward() -> Any:
        before()
        return fn(*inputs)
    return forward


def bare(model: nn.Module, inputs: tuple[Any, ...], train: bool, key: str) -> Built:
    run = step(model, model, inputs, train)
    return Built(Treatment(key, run), lambda: None, lambda: 0, lambda: None)


def traced(model: nn.Module, inputs: tuple[Any, ...], train: bool, key: str) -> Built:
    """A stock ``torch.fx.symbolic_trace`` GraphModule, no taps: the cost of the graph itself."""
    gm = fx.symbolic_trace(model)
    return Built(Treatment(key, step(gm, model, inputs, train)), lambda: None, lambda: 0,
                 lambda: None)


def _count_copies(tapped: fxprobe.TappedModule) -> int:
    n = 0
    for graph in tapped.graphs.values():
        for node in graph.nodes:
            if node.op == "call_function" and getattr(node.target, "__name__", "") == "clone_tree":
                n += 1
    return n


def taps(model: nn.Module, inputs: tuple[Any, ...], train: bool, key: str, sites: SiteSet,
         mode: Mode, device: torch.device, every: bool = False) -> Built:
    """``fxprobe.tap`` at exactly the site set's names."""
    names = sites.names
    ops = None if every else fxprobe.where(lambda s: s.name in names, "benchmark site set")
    tapped = fxprobe.tap(model, ops=ops, **mode.tap_kwargs(device))

    def per_call() -> list[Any]:
        by_name = dict(tapped.taps)
        return [by_name[s.name] for s in tapped.sites
                if s.kind == "call_module" and s.name in by_name]

    return Built(Treatment(key, step(tapped, model, inputs, train)),
                 captured=lambda: dict(tapped.taps), count=lambda: len(tapped.taps),
                 close=tapped.remove, per_call=per_call, copies=_count_copies(tapped))


def taps_dynamo(model: nn.Module, inputs: tuple[Any, ...], train: bool, key: str,
                sites: SiteSet, mode: Mode, device: torch.device) -> Built:
    """``fxprobe.tap(..., tracer="dynamo")`` at the site set's names: the frontend that reaches
    op level where fx cannot trace, run here on a model that fx traces too, so that the two
    frontends and the hooks are measured side by side. The first call (dynamo's capture and
    fxprobe's rewrite) is timed apart, since the steady-state slots never see it."""
    names = sites.names
    tapped = fxprobe.tap(model, ops=fxprobe.where(lambda s: s.name in names, "benchmark site set"),
                         tracer="dynamo", **mode.tap_kwargs(device))
    run = step(tapped, model, inputs, train)
    t0 = time.perf_counter()
    run()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    first = (time.perf_counter() - t0) * 1e3
    return Built(Treatment(key, run), captured=lambda: dict(tapped.taps),
                 count=lambda: len(tapped.taps), close=tapped.remove, first_call_ms=first)


def _installer(modules: list[nn.Module], hook: Callable[..., Any]
               ) -> tuple[Callable[[], None], Callable[[], None]]:
    handles: list[Any] = []

    def enter() -> None:
        handles.extend(m.register_forward_hook(hook) for m in modules)

    def exit() -> None:
        for h in handles:
            h.remove()
        handles.clear()

    return enter, exit


def module_hooks(model: nn.Module, inputs: tuple[Any, ...], train: bool, key: str,
                 sites: SiteSet, mode: Mode) -> Built:
    """``register_forward_hook`` on each module of the set, installed only during its slots."""
    store: list[Any] = []
    modules = [model.get_submodule(p) for p in sites.modules]
    enter, exit = _installer(modules, mode.hook(store, train))
    run = step(model, model, inputs, train, before=store.clear)
    return Built(Treatment(key, run, enter, exit), captured=lambda: list(store),
                 count=lambda: len(store), close=exit, per_call=lambda: list(store))


def global_hook(model: nn.Module, inputs: tuple[Any, ...], train: bool, key: str,
                sites: SiteSet, mode: Mode) -> Built:
    """One ``register_module_forward_hook`` (fires for every module call in the process)."""
    store: list[Any] = []
    inner = mode.hook(store, train)
    selected = {model.get_submodule(p) for p in sites.modules}

    def hook(m: nn.Module, args: Any, out: Any) -> Any:
        if m in selected:
            return inner(m, args, out)
        return None

    handle: list[Any] = []

    def enter() -> None:
        handle.append(nn.modules.module.register_module_forward_hook(hook))

    def exit() -> None:
        while handle:
            handle.pop().remove()

    run = step(model, model, inputs, train, before=store.clear)
    return Built(Treatment(key, run, enter, exit), captured=lambda: list(store),
                 count=lambda: len(store), close=exit, per_call=lambda: list(store))


def logging_hook(model: nn.Module, inputs: tuple[Any, ...], train: bool, key: str,
                 sites: SiteSet) -> Built:
    """The tutorial pattern: a hook per module that logs ``.item()`` statistics at each call."""
    log: list[tuple[float, float]] = []

    def hook(m: nn.Module, args: Any, out: Any) -> None:
        log.append((out.mean().item(), out.std().item()))

    enter, exit = _installer([model.get_submodule(p) for p in sites.modules], hook)
    run = step(model, model, inputs, train, before=log.clear)
    # Python floats hold no tensor memory; each call reads two float32 values to the host.
    return Built(Treatment(key, run, enter, exit), captured=lambda: None,
                 count=lambda: len(log), close=exit, d2h_per_call=2 * 4)
