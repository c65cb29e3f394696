"""The capture modes as plain functions the rewrite and the hooks call at each tap.

``reduce`` turns a value into what is kept (statistics, a subsample, a user's reduction) right
where it is produced, so that no copy is needed; ``intervene`` lets ``fn=`` replace a value for
its downstream consumers; ``grad_hook`` keeps (and may replace) gradients.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from ._errors import InterventionError
from ._options import TapOptions
from ._record import Recording
from ._site import Site


@dataclass
class Modes:
    """The per-tap functions of one tapped module (each None when its mode is off)."""

    reduce: Callable[[Any], Any] | None
    finalize: Callable[[dict[str, Any]], dict[str, Any]] | None
    intervene: Callable[[str, Any], Any] | None
    grad_hook: Callable[[str, torch.Tensor], Any] | None


def _check_replacement(what: str, site: Site | None, old: Any, new: Any) -> None:
    name = site.name if site is not None else "?"
    if isinstance(old, torch.Tensor):
        if not isinstance(new, torch.Tensor):
            raise InterventionError(
                f"{what} returned {type(new).__name__} for site {name!r}; return a tensor "
                f"shaped {tuple(old.shape)} ({old.dtype}), or None to keep the value"
            )
        if new.shape != old.shape or new.dtype != old.dtype or new.device != old.device:
            raise InterventionError(
                f"{what} returned a tensor of shape {tuple(new.shape)}, {new.dtype} on "
                f"{new.device} for site {name!r}, which produced {tuple(old.shape)}, "
                f"{old.dtype} on {old.device}; return a tensor like the original "
                "(e.g. value * mask or torch.zeros_like(value))"
            )
    elif type(new) is not type(old):
        raise InterventionError(
            f"{what} returned {type(new).__name__} for site {name!r}, which produced "
            f"{type(old).__name__}; return the same kind of value, or None"
        )


def _map_tensors(fn: Callable[[torch.Tensor], Any], value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return fn(value)
    return tree_map(lambda v: fn(v) if isinstance(v, torch.Tensor) else v, value)


class _PendingStats:
    """A tensor's statistics, still on its device (no host synchronisation yet)."""

    __slots__ = ("vector", "shape", "dtype")

    def __init__(self, t: torch.Tensor) -> None:
        from ._stats import stats_vector

        self.vector = stats_vector(t)
        self.shape = tuple(t.shape)
        self.dtype = str(t.dtype)


def _resolve_stats(values: dict[str, Any]) -> dict[str, Any]:
    """Fetch every site's statistics in one transfer and put :class:`Stats` in their place."""
    from ._stats import StatsBatch

    flat = {name: tree_flatten(v) for name, v in values.items()}
    keys: list[str] = []
    pending: list[_PendingStats] = []
    for name, (leaves, _) in flat.items():
        for i, leaf in enumerate(leaves):
            if isinstance(leaf, _PendingStats):
                keys.append(f"{name}\0{i}")
                pending.append(leaf)
    if not pending:
        return values
    fetched = StatsBatch(keys, [p.vector for p in pending], [p.shape for p in pending],
                         [p.dtype for p in pending]).fetch()
    out = {}
    for name, (leaves, spec) in flat.items():
        leaves = [fetched[f"{name}\0{i}"] if isinstance(leaf, _PendingStats) else leaf
                  for i, leaf in enumerate(leaves)]
        out[name] = tree_unflatten(leaves, spec)
    return out


def make_modes(options: TapOptions, rec: Recording,
               sites: Callable[[str], Site | None]) -> Modes:
    reduce: Callable[[Any], Any] | None = None
    finalize = None
    if options.reduce == "stats":

        def reduce_stats(value: Any) -> Any:
            return _map_tensors(_PendingStats, value)

        reduce, finalize = reduce_stats, _resolve_stats
    elif options.reduce == "sample":
        from ._stats import sample_vector

        k, seed = options.sample_size, options.seed

        def reduce_sample(value: Any) -> Any:
            return _map_tensors(lambda t: sample_vector(t, k, seed), value)

        reduce = reduce_sample
    elif callable(options.reduce):
        user_reduce = options.reduce

        def reduce_custom(value: Any) -> Any:
            return _map_tensors(user_reduce, value)

        reduce = reduce_custom

    intervene = None
    if options.fn is not None:
        fn = options.fn

        def intervene_fn(name: str, value: Any) -> Any:
            site = sites(name)
            new = fn(site, value)
            if new is None or new is value:
                return value
            _check_replacement("fn", site, value, new)
            if rec.active:
                rec.frame.replaced.add(name)
            return new

        intervene = intervene_fn

    grad_hook = None
    if options.wants_grads:
        keep, grad_fn = options.grad, options.grad_fn

        def grad_hook_fn(name: str, g: torch.Tensor) -> torch.Tensor | None:
            if keep:
                rec.grads[name] = g.detach()
            if grad_fn is None:
                return None
            site = sites(name)
            new = grad_fn(site, g)
            if new is None:
                return None
            _check_replacement("grad_fn", site, g, new)
            return new

        grad_hook = grad_hook_fn
    return Modes(reduce, finalize, intervene, grad_hook)
