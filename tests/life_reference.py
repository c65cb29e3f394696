"""The reference of the stateful test: plain forward hooks on an untapped copy of the model.

:func:`run` calls the copy once with hooks at the points (``tests/life_models.py``) of the
names edited and read: edits first, in the order of the ``intervene`` blocks (outer first),
then a clone of what flows on, as fxprobe's per-call functions and caches are specified.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from life_models import Point
from torch import nn

Edit = Callable[[Any, torch.Tensor], torch.Tensor]


def edit_fn(scale: float, pos: int | None) -> Edit:
    """An edit that commutes with every other edit of the test, bitwise: a power-of-two
    scale, and zeroing index ``pos`` of dim 1 (positions, or channels), where it exists.
    Where two names of one value sit at two points, the order does not matter."""

    def fn(site: Any, value: torch.Tensor) -> torch.Tensor:
        value = value * scale
        if pos is not None and value.dim() > 1 and pos < value.shape[1]:
            value[:, pos] = 0
        return value

    fn.__qualname__ = f"edit(scale={scale}, pos={pos})"
    return fn


def _first(value: Any) -> torch.Tensor:
    return value[0] if isinstance(value, (tuple, list)) else value


def _replace_first(value: Any, new: torch.Tensor) -> Any:
    if isinstance(value, tuple):
        return (new, *value[1:])
    if isinstance(value, list):
        return [new, *value[1:]]
    return new


def run(model: nn.Module, call: Callable[[], Any], edits: Sequence[tuple[Point, Edit]],
        reads: dict[str, Point]) -> tuple[Any, dict[str, list[torch.Tensor]]]:
    """``call()`` (which runs ``model``) with ``edits`` applied at their points and the
    values at ``reads``' points cloned; a point a forward reaches several times (the steps
    of ``generate``) gives one value per forward, in order."""
    points = dict.fromkeys([(p, io) for (p, io, _), _fn in edits]
                           + [(p, io) for p, io, _ in reads.values()])
    seen: dict[str, list[torch.Tensor]] = {name: [] for name in reads}
    counts: dict[str, int] = {}

    def visit(path: str, io: str, value: torch.Tensor) -> torch.Tensor:
        call = counts.get(f"{path}:{io}", 0)
        counts[f"{path}:{io}"] = call + 1
        for (p, i, n), fn in edits:
            if (p, i, n) == (path, io, call):
                value = fn(None, value)
        for name, (p, i, n) in reads.items():
            if (p, i, n) == (path, io, call):
                seen[name].append(value.detach().clone())
        return value

    handles = []

    def reset(m: nn.Module, args: Any) -> None:  # call indices count within one forward
        counts.clear()

    handles.append(model.register_forward_pre_hook(reset))
    for path, io in points:
        module = model.get_submodule(path)
        if io == "in":
            def pre(m: nn.Module, args: Any, kwargs: Any, path: str = path) -> Any:
                if args:
                    return (visit(path, "in", args[0]), *args[1:]), kwargs
                key = "hidden_states" if "hidden_states" in kwargs else next(iter(kwargs))
                return args, {**kwargs, key: visit(path, "in", kwargs[key])}

            handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
        else:
            def post(m: nn.Module, args: Any, out: Any, path: str = path) -> Any:
                return _replace_first(out, visit(path, "out", _first(out)))

            handles.append(module.register_forward_hook(post))
    try:
        out = call()
    finally:
        for h in handles:
            h.remove()
    return out, seen
