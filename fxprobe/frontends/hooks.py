"""The hook frontend: module calls inside code that runs as written.

Hooks go on fxprobe's own copies of the modules, never on the user's objects, and record only
while the tapped module's forward runs, in the thread that runs it. They apply the same
:class:`~capture.pipeline.Pipeline` as the taps in traced graphs. They return ``None`` unless
``fn=`` or a per-call edit (the calling thread's table, ``Pipeline.point``) replaced the output:
a forward hook that returns a value replaces the module's output. A module's hook is installed
for the sites ``tap()`` selected, and for those a per-call table reaches (then it keeps
nothing: it applies the table only).

A module call inside a traced region below untraced code (``self.inner.lin(x)`` written in an
untraceable forward, where ``inner`` is traced) is also hooked: the hook records only while that
region is not running, since the region's own taps see the call when it is.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ..capture.pipeline import Pipeline, write_back
from ..core.options import Capture, CopyPolicy
from .mirror import fxprobe_hook


class HookSet:
    """The hooks of one tapped module, at most one pair per copied module."""

    def __init__(self, pipeline: Pipeline, *, capture: Capture, copy: CopyPolicy) -> None:
        self.pipeline = pipeline
        self.rec = pipeline.rec
        self.capture = capture
        # fxprobe cannot see what runs after a hooked call, so "auto" copies here.
        self.copy = copy != "never"
        self.handles: dict[str, list[RemovableHandle]] = {}
        self.modules: dict[str, nn.Module] = {}

    def ensure(self, name: str, module: nn.Module, region: str | None = None) -> None:
        """Hook ``module`` as site ``name`` (idempotent); with ``region``, only while it is not
        running."""
        if name in self.handles:
            if self.modules[name] is module:
                return
            for h in self.handles.pop(name):  # the module was replaced: hook the new one
                h.remove()
        rec, capture, pipeline, copy = self.rec, self.capture, self.pipeline, self.copy
        handles = []

        def wanted() -> bool:
            state = rec.state
            return state.active and name in state.hook_paths and (
                region is None or not state.running.get(region))

        if capture in ("input", "both"):
            def pre_hook(mod: nn.Module, args: tuple[Any, ...]) -> Any:
                if not wanted():
                    return None
                kept = pipeline.inputs(args, copy)
                if capture == "input":
                    pipeline.store((rec.hook_name(name),), (kept,))
                    return None
                rec.state.pending.setdefault(name, []).append(kept)
                if pipeline.input_grads and torch.is_grad_enabled():
                    # The module reads aliases whose gradients are its grad_input.
                    n = rec.state.frame.hook_calls.get(name, 0)  # the name hook() will take
                    key = f"{name}_{n}" if n else name
                    pipeline.arity[key] = len(args)
                    new = tuple(pipeline.watch_input(key, i, a) for i, a in enumerate(args))
                    return new if any(n is not a for n, a in zip(new, args, strict=True)) else None
                return None

            handles.append(module.register_forward_pre_hook(fxprobe_hook(pre_hook)))

        outputs = capture in ("output", "both")

        # Always there (capture="input" too): a per-call table may edit or keep the output.
        def hook(mod: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
            state = rec.state
            if not state.active or (region is not None and state.running.get(region)):
                return None
            table = pipeline.per_call.table
            kept_here = outputs and name in state.hook_paths
            if table is None and not kept_here:
                return None
            if capture == "input" and name in state.hook_paths:  # the pre-hook named it
                n = state.frame.hook_calls.get(name, 1) - 1
                key = f"{name}_{n}" if n else name
            else:
                key = rec.hook_name(name)
            flow = output
            if table is not None:  # the per-call step first, as at a graph's point
                table.see(name, key)
                flow = pipeline.point(output, (key,), copy, False)
            if kept_here:
                flow, kept = pipeline.output(key, flow, copy)
                if capture == "both":
                    stack = state.pending.get(name)
                    kept = (stack.pop() if stack else (), kept)
                pipeline.store((key,), (kept,))
            if (flow is not output and getattr(mod, "inplace", False) is True
                    and not torch.is_grad_enabled()):
                # The caller may read the tensor the module wrote, not what it returns.
                # Not while autograd records: the module's backward may need that tensor.
                write_back(output, flow)
            return None if flow is output else flow

        handles.append(module.register_forward_hook(fxprobe_hook(hook)))
        self.handles[name] = handles
        self.modules[name] = module

    def discard(self, names: set[str] | frozenset[str]) -> None:
        """Remove the hooks of these sites (a module dynamo runs again, see ``_tap``)."""
        for name in names:
            for h in self.handles.pop(name, ()):
                h.remove()

    def remove(self) -> None:
        for handles in self.handles.values():
            for h in handles:
                h.remove()
        self.handles.clear()
        self.modules.clear()
