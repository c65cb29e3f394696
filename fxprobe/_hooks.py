"""The hook fallback: module calls inside code fxprobe could not trace.

Hooks go on fxprobe's own copies of the modules, never on the user's objects, and record only
while the tapped module's forward runs. They return ``None`` unless ``fn=`` replaced the
output: a forward hook that returns a value replaces the module's output.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ._modes import Modes
from ._record import Recording
from ._rewrite import Capture, CopyPolicy, clone_tree


class HookSet:
    """The hooks of one tapped module, at most one pair per copied module."""

    def __init__(self, recording: Recording, modes: Modes, *, capture: Capture,
                 copy: CopyPolicy) -> None:
        self.rec = recording
        self.modes = modes
        self.capture = capture
        # fxprobe cannot see what runs after a hooked call, so "auto" copies here.
        self.copy = copy != "never"
        self.handles: dict[str, list[RemovableHandle]] = {}

    def _keep(self, value: Any) -> Any:
        reduce = self.modes.reduce
        if reduce is not None:
            return reduce(value)
        return clone_tree(value) if self.copy else value

    def ensure(self, path: str, module: nn.Module) -> None:
        if path in self.handles:
            return
        rec, capture, modes = self.rec, self.capture, self.modes
        pending: dict[int, Any] = {}
        handles = []

        if capture in ("input", "both"):
            def pre_hook(mod: nn.Module, args: tuple[Any, ...]) -> None:
                if rec.active and path in rec.hook_paths:
                    value = self._keep(args)
                    if capture == "input":
                        rec.add_hook(path, value)
                    else:
                        pending[id(mod)] = value
                return None

            handles.append(module.register_forward_pre_hook(pre_hook))

        if capture in ("output", "both"):
            def hook(mod: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
                if not (rec.active and path in rec.hook_paths):
                    return None
                replaced = None
                if modes.intervene is not None:
                    new = modes.intervene(path, output)
                    if new is not output:
                        replaced = output = new
                value = self._keep(output)
                if capture == "both":
                    value = (pending.pop(id(mod), ()), value)
                name = rec.add_hook(path, value)
                grad_hook = modes.grad_hook
                if grad_hook is not None and isinstance(output, torch.Tensor) and (
                        output.requires_grad):
                    output.register_hook(lambda g: grad_hook(name, g))
                return replaced

            handles.append(module.register_forward_hook(hook))
        self.handles[path] = handles

    def remove(self) -> None:
        for handles in self.handles.values():
            for h in handles:
                h.remove()
        self.handles.clear()
