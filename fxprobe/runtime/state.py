"""What a tapped module holds: one record, :class:`TapState`.

``TappedModule`` (``runtime.tapped``) is a thin ``nn.Module`` over it: building (planning a
mode's program, installing hooks and forwards, ``runtime.build``) and running
(``runtime.run``) write it; reading (taps, history, sites, the view) only reads it. Written for
torch dynamo too (``design.md``, "A user's torch.compile traces the runtime too"): every field
exists from the start (no branch on whether state exists), no container grows per call, and
each object has one path (the recording is ``pipeline.rec``, as ``Pipeline.store`` reaches it).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from ..capture.pipeline import Pipeline
from ..capture.rewrite import Compiled
from ..core.options import TapOptions
from ..core.select import Selector
from ..frontends.hooks import HookSet
from ..frontends.mirror import HookMirror, HookWatch
from .lifecycle import Lifecycle


@dataclass(eq=False)
class TapState:
    """The state of one tapped module (see the module docstring)."""

    root: nn.Module
    """fxprobe's copy of the model's module tree, sharing its parameters and buffers."""
    selectors: list[Selector] | None
    """What ``ops=`` asked for (None: every site)."""
    options: TapOptions
    """The validated options."""
    model_name: str
    """How messages name the model (its class name)."""
    pipeline: Pipeline
    """The options applied to values at sites; ``pipeline.rec`` is the recording."""
    hookset: HookSet
    """The hooks installed on the copy."""
    model_hooks: HookMirror
    """The model's own hooks, carried over to the copy at each forward."""
    sink: Any
    """``fxprobe.Disk`` (or another sink): written after each forward; None without one."""
    root_hooked: bool
    """Whether the copied root has hooks of the user's (fxprobe then calls the root)."""
    lives: dict[bool, Lifecycle] = field(default_factory=dict)
    """Per mode (``training``): its program, as it runs; built on first use."""
    points: dict[bool, Points] = field(default_factory=dict)
    """Per mode: its fx regions with intervention points, built at the first per-call block
    in that mode."""
    changes: list[int] = field(default_factory=lambda: [0])
    """Counts the changes of the copied tree's submodule dicts (a cell they write)."""
    structure: int = -1
    """The count of ``changes`` the programs were built at."""
    removed: bool = False
    """Whether ``remove()`` was called."""
    shell: dict[str, Any] = field(default_factory=dict)
    """The instance dict of the ``TappedModule`` over this record, whose ``_modules`` is the
    root's (kept so when a build makes the root's a counting dict, ``count_changes``)."""


@dataclass(frozen=True)
class Points:
    """One mode's fx regions with an intervention point at every site (``capture.points``):
    what runs while the calling thread has a per-call table."""

    regions: Mapping[str, Compiled]
    """Each fx region so rewritten (its taps kept, after the points), by module path."""
    names: frozenset[str]
    """The sites that have a point: the ones a per-call table reaches in these regions."""
    watch: HookWatch | None
    """Watches the modules these graphs inlined for hooks registered after they were built."""
