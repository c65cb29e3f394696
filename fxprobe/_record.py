"""What a tap keeps: one frame of values per forward, and the mappings that read them."""

from __future__ import annotations

import collections
import difflib
from collections.abc import Callable, Iterator, Mapping
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


def _offload(value: Any, device: torch.device) -> Any:
    """Start a non-blocking copy of every tensor in ``value`` to ``device``."""

    def move(t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or t.device == device:
            return t
        if device.type == "cpu":
            dst = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
            return dst.copy_(t, non_blocking=True)
        return t.to(device, non_blocking=True)

    return move(value) if isinstance(value, torch.Tensor) else tree_map(move, value)


class Frame:
    """The values captured during one forward."""

    __slots__ = ("parts", "hooks", "hook_calls", "events", "replaced", "_cache")

    def __init__(self) -> None:
        self.parts: list[tuple[tuple[str, ...], tuple[Any, ...]]] = []
        self.hooks: dict[str, Any] = {}
        self.hook_calls: dict[str, int] = {}
        self.events: dict[str, Any] = {}
        self.replaced: set[str] = set()
        self._cache: dict[str, Any] | None = None


class Recording:
    """Where a tapped module's values go: frames, history, offload, gradients."""

    def __init__(self, *, detach: bool, both: bool, keep: int | None = 1,
                 to: torch.device | None = None,
                 finalize: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
                 grad_hook: Callable[[str, torch.Tensor], Any] | None = None) -> None:
        self.active = False
        self.detach = detach
        self.both = both
        self.to = to
        self.finalize = finalize
        self.grad_hook = grad_hook
        self.detach_now = False
        self.hook_paths: frozenset[str] = frozenset()
        self.frame = Frame()
        self.history: collections.deque[Frame] = collections.deque(maxlen=keep)
        self.grads: dict[str, torch.Tensor] = {}

    def begin(self, hook_paths: frozenset[str]) -> None:
        self.frame = frame = Frame()
        self.history.append(frame)
        self.hook_paths = hook_paths
        self.detach_now = self.detach and torch.is_grad_enabled()
        if self.grad_hook is not None:
            self.grads = {}
        self.active = True

    def add(self, names: tuple[str, ...], values: tuple[Any, ...],
            flowing: tuple[Any, ...] | None = None) -> None:
        if flowing is not None and self.grad_hook is not None:
            self._watch_grads(names, flowing)
        if self.to is not None:
            values = self._offload_all(names, values)
        if self.detach_now:
            values = tuple(
                v.detach() if isinstance(v, torch.Tensor) else detach_tree(v) for v in values
            )
        self.frame.parts.append((names, values))

    def add_hook(self, path: str, value: Any) -> str:
        frame = self.frame
        calls = frame.hook_calls.get(path, 0)
        frame.hook_calls[path] = calls + 1
        name = f"{path}_{calls}" if calls else path
        if self.to is not None:
            (value,) = self._offload_all((name,), (value,))
        if self.detach_now:
            value = detach_tree(value)
        frame.hooks[name] = value
        return name

    def _offload_all(self, names: tuple[str, ...], values: tuple[Any, ...]) -> tuple[Any, ...]:
        assert self.to is not None
        moved = tuple(_offload(v, self.to) for v in values)
        if torch.cuda.is_available() and any(
            isinstance(v, torch.Tensor) and v.is_cuda for v in values
        ):
            for name in names:  # one event per site: reading waits for its own copy only
                event = torch.cuda.Event()
                event.record()
                self.frame.events[name] = event
        return moved

    def _watch_grads(self, names: tuple[str, ...], flowing: tuple[Any, ...]) -> None:
        hook = self.grad_hook
        assert hook is not None
        for name, value in zip(names, flowing, strict=True):
            if isinstance(value, torch.Tensor) and value.requires_grad:
                value.register_hook(lambda g, name=name: hook(name, g))

    def values(self, frame: Frame | None = None) -> dict[str, Any]:
        frame = frame or self.frame
        if frame._cache is None:
            d: dict[str, Any] = {}
            for names, vals in frame.parts:
                d.update(zip(names, vals, strict=True))
            d.update(frame.hooks)
            if self.both:
                d = {k: InOut(*v) for k, v in d.items()}
            if self.finalize is not None:
                d = self.finalize(d)
            frame._cache = d
        return frame._cache


class Taps(Mapping[str, Any]):
    """Read-only view of what one forward captured, keyed by site name.

    ``keys()`` lists the sites that ran, in site order. Looking up a selected site that did not
    run raises :class:`~fxprobe.SiteNotRunError`; a name that is not a selected site raises
    :class:`~fxprobe.UnknownSiteError` with the closest names.
    """

    def __init__(self, recording: Recording, order: dict[str, int],
                 frame: Frame | None = None, what: str = "value") -> None:
        self._rec = recording
        self._order = order
        self._frame = frame or recording.frame
        self._what = what

    def _values(self) -> dict[str, Any]:
        return self._rec.values(self._frame)

    def _ordered(self) -> dict[str, Any]:
        vals = self._values()
        order = self._order

        def key(name: str) -> tuple[int, str]:
            base, _, n = name.rpartition("_")
            if name in order:
                return (order[name], "")
            return (order.get(base, len(order)), n.zfill(6))

        return {k: vals[k] for k in sorted(vals, key=key)}

    def __getitem__(self, name: str) -> Any:
        vals = self._values()
        if name in vals:
            event = self._frame.events.get(name)
            if event is not None:
                event.synchronize()
            return vals[name]
        if name in self._order:
            raise SiteNotRunError(
                f"site {name!r} is selected but has no {self._what} from the last forward "
                "(a branch not taken, or no forward yet); the sites that have one are: "
                f"{', '.join(list(self._ordered())[:20]) or 'none'}"
            )
        close = difflib.get_close_matches(name, list(self._order), n=5, cutoff=0.5)
        hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
        raise UnknownSiteError(
            f"{name!r} is not a tapped site.{hint} tapped.sites lists the selected sites; "
            "fxprobe.sites(model) lists every site."
        )

    def __iter__(self) -> Iterator[str]:
        return iter(self._ordered())

    def __len__(self) -> int:
        return len(self._values())

    def __contains__(self, name: object) -> bool:
        return name in self._values()

    def __repr__(self) -> str:
        items = []
        for k, v in self._ordered().items():
            shown = f"Tensor{tuple(v.shape)}" if isinstance(v, torch.Tensor) else type(v).__name__
            items.append(f"{k}: {shown}")
        return f"{type(self).__name__}({{" + ", ".join(items) + "})"


class Grads(Taps):
    """Gradients of the last backward with respect to each tapped value, by site name."""

    def _values(self) -> dict[str, Any]:
        return self._rec.grads
