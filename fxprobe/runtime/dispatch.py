"""The forwards fxprobe installs on its copy of the module tree: each dispatches a call to
what the tapped module's current program runs there, and shows the module's own signature
(callers such as transformers' ``generate()`` read it to decide what to pass)."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

from torch import nn

from ..core.errors import ConfigError
from ..frontends.mirror import own_forward
from .state import Points, TapState


def module_dispatcher(state: TapState, module: nn.Module, path: str) -> Callable[..., Any]:
    """The forward fxprobe installs on the copied module at ``path``: its compiled region
    (with intervention points while the calling thread has a per-call table), its dynamo
    region, or (``tracer=\"auto\"``) what the lifecycle decides; the module as written where
    the current mode has no program for it."""
    own = own_forward(module)
    lives, points = state.lives, state.points
    pipeline = state.pipeline
    rec, store, per_call = pipeline.rec, pipeline.store, pipeline.per_call

    def forward(*args: Any, **kwargs: Any) -> Any:
        life = lives.get(module.training)
        if life is None:
            return own(*args, **kwargs)
        prog = life.program
        comp = prog.compiled.get(path)
        if per_call.table is not None:  # one check per region run outside a block
            comp = pointed_in(points, prog.training).regions.get(path, comp)
        if comp is None:
            dyn = prog.dynamo.get(path)
            if dyn is None:
                return own(*args, **kwargs)
            if path in prog.deferred:  # tracer="auto": the lifecycle decides what runs
                return life.run(path, own, args, kwargs)
            return dyn(*args, **kwargs)
        rec_state = rec.state
        running = rec_state.running
        running[path] = running.get(path, 0) + 1
        try:
            result = comp.fn(comp.holder, *args, **kwargs)
        finally:
            running[path] -= 1
        store(comp.names, result[1])
        if rec_state.active:
            calls = rec_state.frame.hook_calls
            for name in prog.guarded.get(path, ()):
                calls[name] = calls.get(name, 0) + 1
        return result[0]

    return signed(forward, own)


def pointed_in(points: Mapping[bool, Points], mode: bool) -> Points:
    """The fx regions with intervention points of ``mode``, built when the calling thread's
    per-call table was set (in the mode of that time)."""
    found = points.get(mode)
    if found is None:
        raise other_mode(mode)
    return found


def other_mode(mode: bool) -> ConfigError:
    """The error of a forward in ``mode`` inside a block entered in the other mode."""
    return ConfigError(
        f"the tapped module ran in {'train' if mode else 'eval'} mode inside an "
        "intervene() block or run_with_cache() entered in the other mode: call "
        "tapped.train() or tapped.eval() before entering the block")


def signed(forward: Callable[..., Any], like: Callable[..., Any]) -> Callable[..., Any]:
    """``forward``, showing ``like``'s signature to ``inspect.signature`` (it still takes any
    arguments: the model's forward checks them)."""
    try:
        signature = inspect.signature(like)
    except (TypeError, ValueError):  # a builtin or a callable without one: nothing to show
        return forward
    forward.__signature__ = signature  # type: ignore[attr-defined]
    return forward
