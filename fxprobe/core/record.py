"""What a tap keeps: one frame of values per forward, and the mappings that read them."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from .errors import SiteNotRunError, UnknownSiteError
from .names import did_you_mean
from .options import TapOptions


class InOut(NamedTuple):
    """A site's inputs (positional arguments, as a tuple) and output, for ``capture="both"``."""

    inputs: tuple[Any, ...]
    output: Any


_grad_enabled = torch.is_grad_enabled
"""Read in :meth:`Recording.begin` by this name, not through ``torch``: under torch.compile a
second path to the ``torch`` module (the graph's own is the first) costs a Python guard that
both are the same, run at every call."""


def offload_batch(values: tuple[Any, ...], device: torch.device) -> tuple[Any, ...]:
    """Start moving every tensor in ``values`` to ``device`` with one transfer per source
    device and dtype, without waiting for it.

    Tensors of one (device, dtype) are packed into one buffer on their device (a device-side
    copy, far faster than the host link), moved with one non-blocking copy into one pinned host
    buffer (``device`` is the CPU) or one buffer on ``device``, and handed back as views of it,
    shaped as before. Many small copies each pay the link's latency; one pays it once.
    """
    flat = [tree_flatten(v) for v in values]
    groups: dict[tuple[torch.device, torch.dtype], list[tuple[int, int]]] = {}
    for i, (leaves, _) in enumerate(flat):
        for j, leaf in enumerate(leaves):
            if isinstance(leaf, torch.Tensor) and leaf.device != device:
                groups.setdefault((leaf.device, leaf.dtype), []).append((i, j))
    if not groups:
        return values
    moved = [list(leaves) for leaves, _ in flat]
    pinned = device.type == "cpu"
    for (_, dtype), spots in groups.items():
        tensors = [moved[i][j].detach() for i, j in spots]
        total = sum(t.numel() for t in tensors)
        dst = torch.empty(total, dtype=dtype, device=device, pin_memory=pinned)
        if len(tensors) == 1:
            dst.copy_(tensors[0].reshape(-1), non_blocking=True)
        else:
            dst.copy_(torch.cat([t.reshape(-1) for t in tensors]), non_blocking=True)
        offset = 0
        for (i, j), t in zip(spots, tensors, strict=True):
            moved[i][j] = dst[offset:offset + t.numel()].view(t.shape)
            offset += t.numel()
    return tuple(tree_unflatten(leaves, spec) for leaves, (_, spec) in zip(moved, flat,
                                                                          strict=True))


class Frame:
    """The values captured during one forward (and the gradients of its backward)."""

    __slots__ = ("parts", "hook_calls", "events", "replaced", "grads", "deferred", "_cache",
                 "prev", "aliases")

    def __init__(self, prev: Frame | None = None) -> None:
        self.prev = prev
        """The forward before, while it is kept (``keep=``): the history is this chain."""
        self.parts: list[tuple[tuple[str, ...], tuple[Any, ...]]] = []
        self.hook_calls: dict[str, int] = {}
        self.events: dict[str, Any] = {}
        self.replaced: set[str] = set()
        self.grads: dict[str, torch.Tensor] = {}
        self.deferred: list[Any] = []
        """Small tensors whose statistics are reduced together at the end of the forward."""
        self._cache: dict[str, Any] | None = None
        self.aliases: dict[str, str] = {}
        """Canonical names to the sites that had them in the graphs that ran (with a KV
        cache, ``blocks.0.attn.k`` is another site than without one)."""


class ThreadState:
    """One thread's view of a tapped module: its current frame, history and running regions."""

    __slots__ = ("active", "ran", "frame", "hook_paths", "detach_now", "pending", "running")

    def __init__(self) -> None:
        self.active = False
        self.ran = False
        """Whether a forward began on this thread (before, ``frame`` is an empty one)."""
        self.frame = Frame()
        self.hook_paths: frozenset[str] = frozenset()
        self.detach_now = False
        self.pending: dict[str, list[Any]] = {}
        """Inputs kept by forward pre-hooks until the matching forward hook (a stack per
        module, so that a module re-entered before it returns keeps each call's inputs)."""
        self.running: dict[str, int] = {}
        """How many calls of each traced region below untraced code are running."""


class _PerThread(threading.local):
    """Each thread's :class:`ThreadState`, made by ``threading.local`` when a thread first
    looks (its ``__init__`` runs once per thread). No branch on whether it exists yet: under
    ``torch.compile`` dynamo would trace the branch that makes one, and every compiled call
    would then start a new state, and a history of one (``keep=N`` lost)."""

    def __init__(self) -> None:
        self.state = ThreadState()


class Recording:
    """Where a tapped module's values go: per thread, one frame per forward and a history.

    Every thread that runs the tapped module reads the values of its own last forward, so a
    module served from several threads never mixes their values.
    """

    def __init__(self, options: TapOptions,
                 finalize: Callable[[dict[str, Any]], dict[str, Any]] | None = None) -> None:
        self.options = options
        """The tapped module's options, read where they are used (``keep``, ``to``, ...)."""
        self.both = options.capture == "both"
        self.finalize = finalize
        self._local = _PerThread()

    @property
    def state(self) -> ThreadState:
        return self._local.state

    @property
    def frame(self) -> Frame:
        return self.state.frame

    def begin(self, hook_paths: frozenset[str]) -> ThreadState:
        """A new frame for a forward on this thread. The kept forwards are a chain of frames
        (``Frame.prev``), cut ``keep`` frames back: attribute writes only, which dynamo replays
        after a compiled graph without guarding on the history's length (a container's
        contents it would guard on, and recompile while the history grows)."""
        state = self.state
        keep = self.options.keep
        state.frame = frame = Frame(state.frame if keep != 1 and state.ran else None)
        if keep is not None and keep > 1:
            last = frame
            for _ in range(keep - 1):
                if last.prev is None:
                    break
                last = last.prev
            else:
                last.prev = None
        state.ran = True
        state.hook_paths = hook_paths
        state.detach_now = self.options.detach and _grad_enabled()
        state.active = True
        return state

    def history(self) -> list[Frame]:
        """This thread's kept frames, oldest first (none before its first forward)."""
        state = self.state
        if not state.ran:
            return []
        frames = []
        frame: Frame | None = state.frame
        while frame is not None:
            frames.append(frame)
            frame = frame.prev
        return frames[::-1]

    def hook_name(self, path: str) -> str:
        """``path`` for a hooked module's first call in this forward, ``path_1`` for the next."""
        calls = self.state.frame.hook_calls
        n = calls.get(path, 0)
        calls[path] = n + 1
        return f"{path}_{n}" if n else path

    def offload(self, frame: Frame, names: tuple[str, ...], values: tuple[Any, ...]
                ) -> tuple[Any, ...]:
        """Move one region's (or hook's) values with :func:`offload_batch`; reading any of
        them waits for that batch's copy only (one CUDA event, no host sync here)."""
        to = self.options.to
        assert to is not None
        moved = offload_batch(values, to)
        if moved is not values and torch.cuda.is_available():
            event = torch.cuda.Event()
            event.record()
            for name in names:
                frame.events[name] = event
        return moved

    def values(self, frame: Frame | None = None) -> dict[str, Any]:
        frame = frame or self.frame
        if frame._cache is None:
            d: dict[str, Any] = {}
            for names, vals in frame.parts:
                d.update(zip(names, vals, strict=True))
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

    _what = "value from the last forward"
    _why = ("a module it did not reach, as an encoder given encoder_outputs, a branch not "
            "taken, or no forward yet")

    def __init__(self, recording: Recording, order: dict[str, int],
                 frame: Frame | None = None, aliases: Mapping[str, str] | None = None) -> None:
        self._rec = recording
        self._order = order
        self._frame = frame or recording.frame
        self._aliases = aliases or {}
        """Canonical names (``blocks.3.resid_post``) of selected sites, to their site names."""

    @property
    def replaced(self) -> frozenset[str]:
        """The sites whose value ``fn=`` replaced in this forward."""
        return frozenset(self._frame.replaced)

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
        asked = name
        if name not in vals and name not in self._order:
            name = self._frame.aliases.get(name) or self._aliases.get(name, name)
        if name in vals:
            event = self._frame.events.get(name)
            if event is not None:
                event.synchronize()
            return vals[name]
        if name in self._order:
            raise SiteNotRunError(
                f"site {name!r}{f' ({asked!r})' if asked != name else ''} is selected but "
                f"has no {self._what} "
                f"({self._why}); the sites that have one are: "
                f"{', '.join(list(self._ordered())[:20]) or 'none'}"
            )
        hint = did_you_mean(name, [*self._order, *self._aliases])
        raise UnknownSiteError(
            f"{name!r} is not a tapped site.{hint} tapped.sites lists the selected sites; "
            "fxprobe.sites(model) lists every site."
        )

    def __iter__(self) -> Iterator[str]:
        return iter(self._ordered())

    def __len__(self) -> int:
        return len(self._values())

    def __contains__(self, name: object) -> bool:
        vals = self._values()
        return name in vals or (isinstance(name, str) and (
            self._frame.aliases.get(name) or self._aliases.get(name)) in vals)

    def __repr__(self) -> str:
        items = []
        for k, v in self._ordered().items():
            shown = f"Tensor{tuple(v.shape)}" if isinstance(v, torch.Tensor) else type(v).__name__
            items.append(f"{k}: {shown}")
        return f"{type(self).__name__}({{" + ", ".join(items) + "})"


class Grads(Taps):
    """Gradients of the last backward with respect to each tapped value, by site name."""

    _what = "gradient from the last backward"
    _why = "no backward yet, a branch not taken, or a value the loss does not depend on"

    def _values(self) -> dict[str, Any]:
        return self._frame.grads
