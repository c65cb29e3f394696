"""The hook fallback: module calls inside code fxprobe could not trace.

Hooks go on fxprobe's own copies of the modules, never on the user's objects, and record only
while the tapped module's forward runs. They always return ``None``: a forward hook that returns
a value would replace the module's output.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.utils.hooks import RemovableHandle

from ._record import Recording
from ._rewrite import Capture, CopyPolicy, clone_tree


class HookSet:
    """The hooks of one tapped module, at most one pair per copied module."""

    def __init__(self, recording: Recording, *, capture: Capture, copy: CopyPolicy) -> None:
        self.rec = recording
        self.capture = capture
        # fxprobe cannot see what runs after a hooked call, so "auto" copies here.
        self.copy = copy != "never"
        self.handles: dict[str, list[RemovableHandle]] = {}

    def ensure(self, path: str, module: nn.Module) -> None:
        if path in self.handles:
            return
        rec, capture, copy = self.rec, self.capture, self.copy
        pending: dict[int, Any] = {}
        handles = []

        if capture in ("input", "both"):
            def pre_hook(mod: nn.Module, args: tuple[Any, ...]) -> None:
                if rec.active and path in rec.hook_paths:
                    value = clone_tree(args) if copy else args
                    if capture == "input":
                        rec.add_hook(path, value)
                    else:
                        pending[id(mod)] = value
                return None

            handles.append(module.register_forward_pre_hook(pre_hook))

        if capture in ("output", "both"):
            def hook(mod: nn.Module, args: tuple[Any, ...], output: Any) -> None:
                if rec.active and path in rec.hook_paths:
                    value = clone_tree(output) if copy else output
                    if capture == "both":
                        value = (pending.pop(id(mod), ()), value)
                    rec.add_hook(path, value)
                return None

            handles.append(module.register_forward_hook(hook))
        self.handles[path] = handles

    def remove(self) -> None:
        for handles in self.handles.values():
            for h in handles:
                h.remove()
        self.handles.clear()
