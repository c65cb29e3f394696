"""Building a tapped module: its state record (:func:`make_state`), and the fx regions with an
intervention point at every site that per-call blocks run (:func:`compile_points`). A mode's
program is built by ``runtime.program``; installing and running it is ``runtime.run``'s part,
reading the record ``runtime.tapped``'s."""

from __future__ import annotations

from torch import nn

from ..capture.pipeline import Pipeline
from ..capture.points import insert_points
from ..capture.rewrite import Compiled, compile_region, copy_graph, insert_taps
from ..core.names import some
from ..core.options import TapOptions
from ..core.record import Recording
from ..core.select import Selector
from ..core.site import Site
from ..frontends.hooks import HookSet
from ..frontends.mirror import (
    HookMirror,
    HookWatch,
    adopt,
    mirror,
    user_hooks,
)
from .lifecycle import Lifecycle
from .state import Points, TapState


def make_state(model: nn.Module, selectors: list[Selector] | None,
               options: TapOptions) -> TapState:
    """The record of a new tapped module of ``model`` (a copy of its module tree; nothing built
    yet: see :func:`lifecycle`)."""
    root = mirror(model)
    rec = Recording(options)
    lives: dict[bool, Lifecycle] = {}

    def site(name: str) -> Site | None:
        life = lives.get(root.training)
        return life.site(name) if life is not None else None

    pipeline = Pipeline(options, rec, site)
    rec.finalize = pipeline.finalize
    # The copy has hook tables of its own: the model's hooks as the user sets them after
    # tap() (registered or removed) are carried over at each forward.
    shared = {id(m) for m in root.modules()}
    copies = dict(root.named_modules(remove_duplicate=False))
    pairs = {id(m): (p, m, copies[p]) for p, m in model.named_modules(
        remove_duplicate=False) if id(m) not in shared and p in copies}
    return TapState(
        root=root, selectors=selectors, options=options, model_name=type(model).__name__,
        pipeline=pipeline,
        hookset=HookSet(pipeline, capture=options.capture, copy=options.copy),
        model_hooks=HookMirror(list(pairs.values())), sink=options.sink,
        root_hooked=user_hooks(root), lives=lives)


def adopted(state: TapState) -> str:
    """Submodules of the tapped module were replaced, added or deleted, so the graphs call
    modules that are gone: copy what was put in (fxprobe never installs on the user's
    objects) and say so."""
    names = adopt(state.root)
    return (
        "fxprobe: submodules of the tapped module changed after tap()"
        + (f" ({some(names)} assigned; each is replaced by a copy sharing its "
           "parameters, so that fxprobe never installs anything on your object)"
           if names else "")
        + "; the model is traced again.")


def compile_points(life: Lifecycle, pipeline: Pipeline, options: TapOptions) -> Points:
    """The fx regions of ``life``'s mode with an intervention point at every site, by path.
    Each keeps the taps ``tap()`` put there, after the points (``capture.points``), so that
    what they keep is the value that flows on, after the per-call functions."""
    prog = life.program
    chosen = {s.name for s in prog.selected}
    out: dict[str, Compiled] = {}
    names: set[str] = set()
    inlined: dict[str, nn.Module] = {}
    for path, region in prog.plan.regions.items():
        graph = copy_graph(region.graph)
        modules = region.module.get_submodule
        names |= insert_points(graph, modules, pipeline, lambda s: False, escapes=bool(path))
        order, copied, outplaced = insert_taps(
            graph, modules, chosen & {s.name for _, s in region.sites()},
            capture=options.capture, copy=options.copy, pipeline=pipeline, escapes=bool(path))
        out[path] = compile_region(path, region.module, graph, order, copied, outplaced)
        # A module the graph inlined runs no hook registered on it later: watched, as the
        # program watches its compiled regions (``runtime.program``).
        called = {str(n.target) for n in graph.nodes if n.op == "call_module"}
        for rel, m in region.module.named_modules():
            parts = rel.split(".")
            if rel and not any(".".join(parts[:i]) in called for i in range(1, len(parts) + 1)):
                inlined[f"{path}.{rel}" if path else rel] = m
    return Points(out, frozenset(names), HookWatch(inlined, fresh=True) if inlined else None)
