"""Running a tapped module: each mode's program built on first use (``runtime.program``) and
installed on the copy (hooks, the forwards of ``runtime.dispatch``), one forward
(:func:`run`), and what a change of the copied tree or of its hooks makes built again. All of
it reads and writes the module's :class:`~runtime.state.TapState`."""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import nn

from ..core.errors import RemovedError, SelectorError, UsageError
from ..core.names import some
from ..frontends.mirror import (
    HookWatch,
    ModeChangedWarning,
    count_changes,
    drop_overrides,
    install_override,
    own_forward,
    user_hooks,
)
from .build import adopted, compile_points
from .dispatch import module_dispatcher, other_mode, pointed_in, signed
from .lifecycle import Lifecycle, State, fall_back_all
from .program import build_program
from .state import Points, TapState


def lifecycle(state: TapState, strict: bool = False) -> Lifecycle:
    """The current mode's program as it runs (built, installed the first time)."""
    root = state.root
    life = state.lives.get(root.training)
    if life is None:
        if state.removed:
            raise RemovedError("this tapped module was removed; call fxprobe.tap(model, ...) again")
        drop_overrides(root)
        prog = build_program(root, state.selectors, state.options, root.training,
                             state.pipeline, model_name=state.model_name, strict=strict)
        life = Lifecycle(prog, state.pipeline.rec, partial(_moved, state), state.lives)
        state.lives[root.training] = life
        install(state, life)
        count_changes(root, state.changes, tuple(prog.dynamo))
        state.structure = state.changes[0]
        state.shell["_modules"] = root._modules  # maybe a counting dict now
    return life


def pointed(state: TapState, life: Lifecycle) -> Points:
    """The fx regions of ``life``'s mode with an intervention point at every site, by path
    (:func:`~runtime.build.compile_points`; built and installed the first time): what runs
    while the calling thread has a per-call table."""
    mode = life.program.training
    found = state.points.get(mode)
    if found is None:
        found = state.points[mode] = compile_points(life, state.pipeline, state.options)
        install(state, life)
    return found


def install(state: TapState, life: Lifecycle) -> None:
    """Install ``life``'s hooks and forwards on the copy (again: what is there stays)."""
    root = state.root
    for spec in life.program.hooks:
        if not life.active(spec.path):
            continue  # inside a module dynamo runs: installed if dynamo fails on it
        module = root.get_submodule(spec.path) if spec.path else root
        state.hookset.ensure(spec.name, module, spec.region)
    with_points = {mode: p.regions for mode, p in state.points.items()}
    paths = {path for mode, li in state.lives.items()
             for path in (*li.program.compiled, *li.program.dynamo, *with_points.get(mode, ()))
             if path and li.active(path)}
    for path in paths:
        module = root.get_submodule(path)
        install_override(module, module_dispatcher(state, module, path))
    if state.root_hooked or any("" in li.program.dynamo for li in state.lives.values()):
        # The root's own hooks run around the program (fxprobe calls the root); and
        # model.generate() and other methods call the model itself: one frame per call.
        install_override(root, _root_dispatcher(state))


def _moved(state: TapState, life: Lifecycle, path: str, to: State) -> None:
    """A deferred module moved to ``to``: its hooks and inner regions are installed exactly
    while it runs as written."""
    if to is not State.FALLBACK:
        state.hookset.discard(life.program.deferred[path].sites)
        drop_overrides(state.root)
    for other in state.lives.values():
        install(state, other)


def _retrace(state: TapState, why: str | None) -> Lifecycle:
    """What the graphs were traced from changed: say ``why`` (unless None: a library's own
    hooks), plan and compile again."""
    if why is not None:
        warnings.warn(why, stacklevel=6)
    state.lives.clear()
    state.points.clear()
    return lifecycle(state)


def _rehooked(state: TapState, watch: HookWatch) -> Lifecycle | None:
    """Trace again where the hooks of a module a graph inlined changed (the graph would not
    run them as set); None where none did."""
    changed = watch.changed()
    if not changed:
        return None
    users = watch.by_user(changed)  # not a library's own (transformers')
    return _retrace(state, (
        f"fxprobe: the hooks of {some(users)} changed after tap() (on the model or the "
        "tapped module), inside code fxprobe had traced through (where they would not run "
        "as set); the model is traced again, so that they do. Register hooks before tap() "
        "to avoid the second trace.") if users else None)


def _root_dispatcher(state: TapState) -> Callable[..., Any]:
    """The forward fxprobe installs on the copied root: called by fxprobe (the root's hooks
    ran) it runs the program; called by the model itself (``generate()``) a new frame."""
    rec = state.pipeline.rec
    root = state.root

    def forward(*args: Any, **kwargs: Any) -> Any:
        if rec.state.active:  # called by fxprobe (the root's hooks ran) or by the model
            life = state.lives.get(root.training) or lifecycle(state)
            return body(state, life, args, kwargs)
        return run(state, args, kwargs, through_root=False)  # generate(): a new frame

    return signed(forward, own_forward(root))


def _say_mode_changed(state: TapState, paths: list[str]) -> None:
    """Warn that ``paths`` of the model changed train/eval mode after ``tap()`` and their
    copies did not (the tapped module keeps its own mode): name the call that aligns them."""
    model = dict((p, m) for p, m, _ in state.model_hooks.pairs)
    first = paths[0]
    mode = "train" if model[first].training else "eval"
    paths = [p for p in paths if model[p].training == model[first].training]  # one mode
    who = "the model" if first == "" else f"{some(paths)} of the model"
    fix = f"tapped.{mode}()" if first == "" else f"tapped.get_submodule({first!r}).{mode}()"
    message = (
        f"fxprobe: {who} was put in {mode} mode after fxprobe.tap(); the tapped module keeps "
        "its own train/eval mode (tapped.train()/.eval() leave the model's alone), so its "
        "Dropout, BatchNorm and code branching on self.training still run in the other mode "
        f"and its values are not the model's: call {fix} to run as the model does.")
    # Said at the caller's line (not torch's Module._call_impl) and at each change: the
    # registry of warnings already shown would hide a later change that reads the same (the
    # model put in train mode again, another tapped model's) after the first, in silence.
    frame = sys._getframe(1)
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_INTERNAL):
        frame = frame.f_back
    warnings.warn_explicit(message, ModeChangedWarning, frame.f_code.co_filename,
                           frame.f_lineno, module=frame.f_globals.get("__name__"),
                           registry={}, module_globals=frame.f_globals)


_INTERNAL = (os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
             os.path.dirname(os.path.abspath(nn.Module.__init__.__code__.co_filename)))
"""Where fxprobe and torch's ``nn.Module`` calls run: a warning is said at the caller's line."""


def run(state: TapState, args: tuple[Any, ...], kwargs: dict[str, Any],
        through_root: bool | None = None) -> Any:
    """One forward of the tapped module (a frame of the recording)."""
    if state.removed:
        raise RemovedError("this tapped module was removed; call fxprobe.tap(model) again")
    root, pipeline = state.root, state.pipeline
    replaced = state.model_hooks.replaced()
    if replaced:
        what = "; ".join(f"{p or '<the model>'!r}: {', '.join(state.model_hooks.what_changed(p))}"
                         for p in replaced[:3]) + (" ..." if len(replaced) > 3 else "")
        raise UsageError(
            f"these modules of the model were changed after fxprobe.tap() ({what}): an "
            "attribute set, replaced or deleted (a forward wrapper installed or removed, a "
            "value the forward reads), or a submodule assigned, added or deleted. The tapped "
            "module runs a copy of the module tree as it was at tap() (it shares the "
            "parameters and follows hooks, not these), so its values would not "
            "be the model's: call fxprobe.tap(model, ...) again after the change, or undo it.")
    modes = state.model_hooks.modes_changed()
    if modes:
        _say_mode_changed(state, modes)
    if "" in state.model_hooks.sync():  # the model's hooks as set now: the root's changed
        state.root_hooked = user_hooks(root)  # fxprobe calls the root exactly while it has
        for other in state.lives.values():  # hooks
            install(state, other)
    if through_root is None:  # a call of the tapped module: the root's hooks run around
        through_root = state.root_hooked
    life = state.lives.get(root.training)
    if life is not None:
        watch = life.program.watch
        if state.changes[0] != state.structure:
            life = _retrace(state, adopted(state))
        elif watch is not None:
            life = _rehooked(state, watch) or life
        table = pipeline.per_call.table
        if table is not None and table.training != root.training:
            # refused even where this mode's points exist (a run_with_cache in it): the
            # block's selectors were resolved against its own mode's sites, and only that
            # mode's lifecycle knows which of its edits a fallen module would drop
            raise other_mode(root.training)
        if table is not None:
            table.refresh(life, state)  # a module fallen since the block began: its hook sites
            points = state.points.get(root.training)  # the graphs with points watch their own
            if points is not None and points.watch is not None:
                life = _rehooked(state, points.watch) or life
                pointed(state, life)
            elif points is None and table.training == root.training:
                pointed(state, life)  # traced again inside the block (by any thread)
    else:
        life = lifecycle(state)
    if life.waiting and torch.compiler.is_compiling():  # a deferred module: as written
        fall_back_all(life)
    # The recording through the pipeline, as Pipeline.store reaches it: one path to it,
    # so that torch.compile adds no Python guard that the two paths agree.
    rec_state = pipeline.rec.begin(life.hook_names)
    life.called.clear()
    try:
        if through_root:  # the root's own hooks run around the body (its override)
            out = root(*args, **kwargs)
        else:
            out = body(state, life, args, kwargs)
    finally:
        # Also when the forward raised: the statistics of what it captured are taken now,
        # not when first read (by then a value could have changed).
        if rec_state.frame.deferred:
            pipeline.finish(rec_state.frame)
        rec_state.active = False
    life.ran()  # the modules dynamo ran in this whole forward: their sites are all known
    sink = state.sink
    if life.unchecked:  # before anything is written: a failed selection writes nothing
        try:
            life.check(state.model_name)
        except SelectorError:
            if sink is not None:  # and holds nothing (a corrected tap writes there)
                sink.release()
            raise
    if sink is not None:
        sink.write(pipeline.rec.values(rec_state.frame), (args, kwargs))
    return out


def body(state: TapState, life: Lifecycle, args: tuple[Any, ...],
         kwargs: dict[str, Any]) -> Any:
    """The root's program: its fx region (with intervention points while the thread has a
    per-call table), its dynamo region, or the root as written."""
    prog = life.program
    pipeline = state.pipeline
    comp = prog.compiled.get("")
    if pipeline.per_call.table is not None:
        comp = pointed_in(state.points, prog.training).regions.get("", comp)
    if comp is not None:
        result = comp.fn(comp.holder, *args, **kwargs)
        pipeline.store(comp.names, result[1])
        return result[0]
    dyn = prog.dynamo.get("")
    if dyn is not None:
        if "" in prog.deferred:  # tracer="auto": the lifecycle decides what runs
            return life.run("", own_forward(state.root), args, kwargs)
        return dyn(*args, **kwargs)
    return own_forward(state.root)(*args, **kwargs)
