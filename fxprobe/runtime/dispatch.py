"""The forwards fxprobe installs on its copy of the module tree: each dispatches a call to
what the tapped module's current program runs there, and shows the module's own signature
(callers such as transformers' ``generate()`` read it to decide what to pass)."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

from torch import nn

from ..core.record import Recording
from ..frontends.mirror import own_forward
from .lifecycle import Lifecycle


def module_dispatcher(lives: Mapping[bool, Lifecycle], rec: Recording,
                      store: Callable[[Any, Any], None], module: nn.Module, path: str
                      ) -> Callable[..., Any]:
    """The forward fxprobe installs on the copied module at ``path``: its compiled region,
    its dynamo region, or (``tracer=\"auto\"``) what the lifecycle decides; the module as
    written where the current mode has no program for it."""
    own = own_forward(module)

    def forward(*args: Any, **kwargs: Any) -> Any:
        life = lives.get(module.training)
        if life is None:
            return own(*args, **kwargs)
        prog = life.program
        comp = prog.compiled.get(path)
        if comp is None:
            dyn = prog.dynamo.get(path)
            if dyn is None:
                return own(*args, **kwargs)
            if path in prog.deferred:  # tracer="auto": the lifecycle decides what runs
                return life.run(path, own, args, kwargs)
            return dyn(*args, **kwargs)
        state = rec.state
        running = state.running
        running[path] = running.get(path, 0) + 1
        try:
            result = comp.fn(comp.holder, *args, **kwargs)
        finally:
            running[path] -= 1
        store(comp.names, result[1])
        if state.active:
            calls = state.frame.hook_calls
            for name in prog.guarded.get(path, ()):
                calls[name] = calls.get(name, 0) + 1
        return result[0]

    return signed(forward, own)


def root_dispatcher(tapped: Any) -> Callable[..., Any]:
    """The forward fxprobe installs on the copied root: called by fxprobe (the root's hooks
    ran) it runs the program; called by the model itself (``generate()``) a new frame."""
    rec = tapped._rec

    def forward(*args: Any, **kwargs: Any) -> Any:
        if rec.state.active:  # called by fxprobe (the root's hooks ran) or by the model
            life = tapped._lives.get(tapped._root.training) or tapped._lifecycle()
            return tapped._body(life, args, kwargs)
        return tapped._run(args, kwargs, through_root=False)  # generate(): a new frame

    return signed(forward, own_forward(tapped._root))


def signed(forward: Callable[..., Any], like: Callable[..., Any]) -> Callable[..., Any]:
    """``forward``, showing ``like``'s signature to ``inspect.signature`` (it still takes any
    arguments: the model's forward checks them)."""
    try:
        signature = inspect.signature(like)
    except (TypeError, ValueError):  # a builtin or a callable without one: nothing to show
        return forward
    forward.__signature__ = signature  # type: ignore[attr-defined]
    return forward
