"""What a tap keeps: the values of the last forward, and the ``taps`` mapping that reads them."""

from __future__ import annotations

import difflib
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple

import torch
from torch.utils._pytree import tree_map

from ._errors import SiteNotRunError, UnknownSiteError


class InOut(NamedTuple):
    """A site's inputs (positional arguments, as a tuple) and output, for ``capture="both"``."""

    inputs: tuple[Any, ...]
    output: Any


def detach_tree(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach()
    return tree_map(lambda v: v.detach() if isinstance(v, torch.Tensor) else v, value)


class Recording:
    """The values one forward captured, handed over as whole tuples (one per region call)."""

    __slots__ = ("active", "parts", "hooks", "hook_calls", "hook_paths", "detach_now",
                 "detach", "both", "_cache")

    def __init__(self, *, detach: bool, both: bool) -> None:
        self.active = False
        self.parts: list[tuple[tuple[str, ...], tuple[Any, ...]]] = []
        self.hooks: dict[str, Any] = {}
        self.hook_calls: dict[str, int] = {}
        self.hook_paths: frozenset[str] = frozenset()
        self.detach = detach
        self.detach_now = False
        self.both = both
        self._cache: dict[str, Any] | None = None

    def begin(self, hook_paths: frozenset[str]) -> None:
        self.parts = []
        self.hooks = {}
        self.hook_calls = {}
        self.hook_paths = hook_paths
        self.detach_now = self.detach and torch.is_grad_enabled()
        self._cache = None
        self.active = True

    def add(self, names: tuple[str, ...], values: tuple[Any, ...]) -> None:
        if self.detach_now:
            values = tuple(
                v.detach() if isinstance(v, torch.Tensor) else detach_tree(v) for v in values
            )
        self.parts.append((names, values))

    def add_hook(self, path: str, value: Any) -> None:
        calls = self.hook_calls.get(path, 0)
        self.hook_calls[path] = calls + 1
        if self.detach_now:
            value = detach_tree(value)
        self.hooks[f"{path}_{calls}" if calls else path] = value

    def values(self) -> dict[str, Any]:
        if self._cache is None:
            d: dict[str, Any] = {}
            for names, vals in self.parts:
                d.update(zip(names, vals, strict=True))
            d.update(self.hooks)
            if self.both:
                d = {k: InOut(*v) for k, v in d.items()}
            self._cache = d
        return self._cache


class Taps(Mapping[str, Any]):
    """Read-only view of what the last forward captured, keyed by site name.

    ``keys()`` lists the sites that ran, in site order. Looking up a selected site that did not
    run raises :class:`~fxprobe.SiteNotRunError`; a name that is not a selected site raises
    :class:`~fxprobe.UnknownSiteError` with the closest names.
    """

    def __init__(self, recording: Recording, order: dict[str, int], selected: list[str]) -> None:
        self._rec = recording
        self._order = order
        self._selected = selected

    def _ordered(self) -> dict[str, Any]:
        vals = self._rec.values()
        order = self._order

        def key(name: str) -> tuple[int, str]:
            base, _, n = name.rpartition("_")
            if name in order:
                return (order[name], "")
            return (order.get(base, len(order)), n.zfill(6))

        return {k: vals[k] for k in sorted(vals, key=key)}

    def __getitem__(self, name: str) -> Any:
        vals = self._rec.values()
        if name in vals:
            return vals[name]
        if name in self._order:
            raise SiteNotRunError(
                f"site {name!r} is selected but did not run in the last forward "
                "(a branch not taken, or no forward yet); the sites that ran are: "
                f"{', '.join(list(self._ordered())[:20]) or 'none'}"
            )
        close = difflib.get_close_matches(name, self._selected, n=5, cutoff=0.5)
        hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
        raise UnknownSiteError(
            f"{name!r} is not a tapped site.{hint} tapped.sites lists the selected sites; "
            "fxprobe.sites(model) lists every site."
        )

    def __iter__(self) -> Iterator[str]:
        return iter(self._ordered())

    def __len__(self) -> int:
        return len(self._rec.values())

    def __contains__(self, name: object) -> bool:
        return name in self._rec.values()

    def __repr__(self) -> str:
        items = []
        for k, v in self._ordered().items():
            shown = f"Tensor{tuple(v.shape)}" if isinstance(v, torch.Tensor) else type(v).__name__
            items.append(f"{k}: {shown}")
        return "Taps({" + ", ".join(items) + "})"
