"""Build a program: what one mode of a tapped model runs, planned once and run many times.

:func:`build_program` is a pure step — (model copy, selectors, options, mode) in, a frozen
:class:`Program` out — made of passes over one copy of each frontend's graph: select sites,
insert taps (``capture.rewrite.insert_taps``), compile. Installing it (hooks, dispatch of
traced regions) and running it is the runtime's part (``runtime.tapped.TappedModule``); what
running it learns (the ``tracer="auto"`` states, the sites dynamo finds) is held by a
``runtime.lifecycle.Lifecycle``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, SupportsIndex, overload

import torch
from torch import nn

from ..capture.pipeline import Pipeline
from ..capture.rewrite import Compiled, compile_region, copy_graph, insert_taps
from ..core.errors import SelectorError, UnsupportedModelError
from ..core.options import TapOptions, TracerKind
from ..core.select import Selector, select
from ..core.site import Site
from ..core.view import View, Viewable
from ..frontends.dynamo import DynamoRegion
from ..frontends.fx import Deferred, Fallback, Plan, is_leaf, plan
from ..frontends.mirror import HookWatch, mirror
from .early import check_before_capture
from .shapes import with_canonical

if TYPE_CHECKING:
    from ..present.summary import Table


@dataclass(frozen=True)
class HookSpec:
    """A hook the runtime installs: site ``name`` on the module at ``path``."""

    name: str
    path: str
    region: str | None
    """For a module call inside a traced region below untraced code: that region's path (the
    hook records only while the region is not running, see ``_hooks``); else None."""


@dataclass(frozen=True)
class Program:
    """Everything one mode of a tapped module runs, fixed once built: the plan, the selection,
    the compiled regions, the hooks to install, and the dynamo regions. What running it
    changes (the ``tracer="auto"`` states, the sites dynamo selects) is the runtime's
    ``Lifecycle`` (``runtime.lifecycle``)."""

    training: bool
    """The mode it runs (``module.training``)."""
    plan: Plan
    """How fx, hooks and dynamo reach the model in this mode."""
    selected: tuple[Site, ...]
    """The sites selected before any forward (fx and hooks), in execution order; the sites
    dynamo regions select join them as their graphs are captured (the first forward)."""
    compiled: Mapping[str, Compiled]
    """The instrumented fx regions with a tap, by module path."""
    hooks: tuple[HookSpec, ...]
    """The hooks to install (inside a deferred module: only while it runs as written)."""
    guarded: Mapping[str, tuple[str, ...]]
    """Per region below untraced code: its sites that are hooked too (see ``HookSpec``). The
    region's capture counts as their first call, so a direct call after it is ``name_1``."""
    dynamo: Mapping[str, DynamoRegion] = field(default_factory=dict)
    """Modules run under torch dynamo (the deferred ones included), by path."""
    deferred: Mapping[str, Deferred] = field(default_factory=dict)
    """``tracer="auto"``: fallbacks tried with torch dynamo at their first call, by path."""
    selectors: tuple[Selector, ...] | None = None
    """With dynamo regions: the selectors to check once the first forward found their sites
    (None or empty: nothing to check)."""
    watch: HookWatch | None = None
    """Watches the modules the graphs inlined for hooks registered after tracing."""


def check_model(model: Any, what: str = "fxprobe.tap") -> nn.Module:
    """The module to instrument for ``model``, or a clear refusal.

    A ``torch.compile``d module is reached through the module it compiles (``_orig_mod``):
    its site names are the uncompiled model's, and the tapped module runs eagerly (compile the
    tapped module to compile the taps too).
    """
    if isinstance(model, nn.Module) and isinstance(model, Viewable):  # a TappedModule
        raise UnsupportedModelError(
            f"{what} was given a TappedModule; tap the original model instead (one tap() can "
            "select any number of sites: pass every selector in one ops=[...] list)"
        )
    if isinstance(model, torch.jit.ScriptModule):
        raise UnsupportedModelError(
            f"{type(model).__name__} is a TorchScript module: fxprobe.tap and fxprobe.sites "
            f"take it (docs/artifacts.md), {what} needs the original Python nn.Module"
        )
    compiled = getattr(torch, "_dynamo", None)
    optimized = getattr(getattr(compiled, "eval_frame", None), "OptimizedModule", None)
    if optimized is not None and isinstance(model, optimized):
        warnings.warn(
            f"{what} was given a torch.compile'd module: it uses the module it compiles (its "
            "_orig_mod), whose site names are the same; a tapped module runs eagerly. To "
            "compile the taps too, compile the tapped module: "
            "torch.compile(fxprobe.tap(model, ...)).",
            stacklevel=3,
        )
        model = model._orig_mod
    if not isinstance(model, nn.Module):
        raise UnsupportedModelError(
            f"fxprobe taps torch.nn.Module instances; got {type(model).__name__}. "
            "Wrap a function in an nn.Module whose forward calls it."
        )
    return model


def plan_model(root: nn.Module, options: TapOptions) -> Plan:
    """Trace fxprobe's copy ``root`` (already in the wanted mode) with the options' tracer."""
    return with_canonical(plan(root, tracer=options.tracer, leaf_modules=options.leaf_modules,
                               autowrap_functions=options.autowrap_functions))


def build_program(root: nn.Module, selectors: list[Selector] | None, options: TapOptions,
                  training: bool, pipeline: Pipeline, *, model_name: str,
                  strict: bool = True) -> Program:
    """Plan ``root`` in one mode, select sites, and compile every region that has a tap.

    Args:
        root: fxprobe's copy of the model (see ``_mirror``), in mode ``training``.
        selectors: what ``ops=`` asked for (None: every site).
        options: the validated options.
        training: the mode this program is for.
        pipeline: the tapped module's pipeline, called by the inserted nodes.
        model_name: how messages name the model.
        strict: check the selectors against the other mode's sites before refusing one.
    """
    p = plan_model(root, options)
    mode = "train" if training else "eval"

    def other_mode() -> list[Site]:
        other = mirror(root)
        other.train(not training)
        return plan_model(other, options).sites

    regions = [*(t.path for t in p.dynamo), *(d.path for d in p.deferred)]
    if strict and selectors:  # what the module tree decides: now, not after the capture
        check_before_capture(root, p.sites, selectors, regions,
                             context=f"{model_name} ({mode} mode)", other_mode=other_mode)
    if p.dynamo:  # more sites appear as dynamo captures graphs: check after a forward
        selected = [s for s in p.sites if not s.inlined] if selectors is None else [
            s for s in p.sites if any(sel(s) for sel in selectors)]
    else:
        try:
            selected = select(p.sites, selectors, context=f"{model_name} ({mode} mode)",
                              fallbacks=p.fallbacks, other_mode=other_mode if strict else None)
        except SelectorError:
            if not p.deferred:
                raise
            # Dynamo may find the sites inside the modules fx could not trace: the check
            # waits for the first forward (check_found), which raises if still nothing matched.
            assert selectors is not None  # None selects everything and cannot fail
            selected = [s for s in p.sites if any(sel(s) for sel in selectors)]
    names = {s.name for s in selected}
    compiled: dict[str, Compiled] = {}
    for path, region in p.regions.items():
        chosen = names & {s.name for _, s in region.sites()}
        if not chosen:
            continue  # nothing selected here: the module runs its own forward
        graph = copy_graph(region.graph)
        order, copied, outplaced = insert_taps(
            graph, region.module.get_submodule, chosen, capture=options.capture,
            copy=options.copy, pipeline=pipeline,
            escapes=bool(path))  # a region below the root returns to untraced code
        compiled[path] = compile_region(path, region.module, graph, order, copied, outplaced)
    hooks = [HookSpec(s.name, s.name, None) for s in selected if s.how == "hook"]
    guarded: dict[str, tuple[str, ...]] = {}
    for path, region in p.regions.items():
        if not path:
            continue  # the root region runs whenever the tapped module does
        calls = [s for _, s in region.sites() if s.name in names and s.kind == "call_module"]
        hooks.extend(HookSpec(s.name, str(s.target), path) for s in calls)
        if calls:
            guarded[path] = tuple(s.name for s in calls)
    dynamo: dict[str, DynamoRegion] = {}
    for path in regions:
        dynamo[path] = _dynamo_region(root, path, selectors, options, pipeline)
    inlined = _inlined(root, compiled, dynamo)
    return Program(training, p, tuple(selected), compiled, tuple(hooks), guarded, dynamo,
                   deferred={d.path: d for d in p.deferred},
                   selectors=tuple(selectors) if dynamo and selectors is not None else None,
                   watch=HookWatch(inlined) if inlined else None)


def _inlined(root: nn.Module, compiled: Mapping[str, Compiled],
             dynamo: Mapping[str, DynamoRegion]) -> dict[str, nn.Module]:
    """The modules whose forwards the compiled graphs inlined (they are not called, so a hook
    registered on one later would never run), by path: below each compiled region, all but
    the modules its graph calls (and their own modules); below each dynamo region, all."""
    out: dict[str, nn.Module] = {}
    for path, comp in compiled.items():
        called = {str(n.target) for n in comp.graph.nodes if n.op == "call_module"}
        module = root.get_submodule(path) if path else root
        for rel, m in module.named_modules():
            parts = rel.split(".")
            if rel and not any(".".join(parts[:i]) in called for i in range(1, len(parts) + 1)):
                out[f"{path}.{rel}" if path else rel] = m
    for path, region in dynamo.items():
        for rel, m in region.module.named_modules():
            if rel:
                out[f"{path}.{rel}" if path else rel] = m
    return out


def _dynamo_region(root: nn.Module, path: str, selectors: list[Selector] | None,
                   options: TapOptions, pipeline: Pipeline) -> DynamoRegion:
    """A module run under torch dynamo; the sites it selects are reported as they appear
    (``DynamoRegion.on_sites``: the runtime's ``Lifecycle`` listens)."""
    leaf_types = tuple(t for t in options.leaf_modules if isinstance(t, type))
    leaf_paths = frozenset(p for p in options.leaf_modules if isinstance(p, str))

    def choose(found: Sequence[Site]) -> list[Site]:
        if selectors is None:
            return [s for s in found if not s.inlined]
        return [s for s in found if any(sel(s) for sel in selectors)]

    module = root.get_submodule(path) if path else root
    return DynamoRegion(
        path, module, pipeline=pipeline, capture=options.capture, copy=options.copy,
        is_leaf=lambda m, p: is_leaf(m, p, leaf_types, leaf_paths), choose=choose)


class SiteNames(tuple[Site, ...], Viewable):
    """The sites in execution order, as torchvision's ``get_graph_node_names`` lists them: each
    a :class:`Site` (equal to its name, hashed and printed as it: ``"conv1" in sites``,
    ``sites[:2] == ("x", "conv1")``); ``.names`` are the names as strings.

    ``.modules`` lists the calls of modules that fx traced through (``layer1``), and ``.inner``
    the sites inside blocks torchvision keeps whole (the convolution inside a
    ``Conv2dNormActivation``): both are sites, selectable by name, type or function, but not
    in the tuple. ``.fallbacks`` names the modules that run as written.
    """

    records: tuple[Site, ...]
    modules: tuple[Site, ...]
    inner: tuple[Site, ...]
    fallbacks: tuple[Fallback, ...]

    def __new__(cls, records: Sequence[Site], fallbacks: Sequence[Fallback]) -> SiteNames:
        listed = [s for s in records if s.listed]
        self = super().__new__(cls, listed)
        self.records = tuple(listed)
        self.modules = tuple(s for s in records if s.inlined and not s.listed)
        self.inner = tuple(s for s in records if not s.inlined and not s.listed)
        self.fallbacks = tuple(fallbacks)
        return self

    @overload
    def __getitem__(self, i: SupportsIndex) -> Site: ...

    @overload
    def __getitem__(self, i: slice) -> SiteNames: ...

    def __getitem__(self, i: SupportsIndex | slice) -> Site | SiteNames:
        if isinstance(i, slice):
            return SiteNames(tuple.__getitem__(self, i), self.fallbacks)
        return tuple.__getitem__(self, i)

    def __repr__(self) -> str:
        return repr(self.names)  # what it printed when it held names

    def __eq__(self, other: object) -> bool:
        """Two listings are equal when they name the same sites in the same order (of one
        model by two frontends, say); a listing equals a tuple of the names it lists."""
        if isinstance(other, SiteNames):
            return self.names == other.names
        return tuple.__eq__(self, other)  # type: ignore[operator]

    def __hash__(self) -> int:
        return hash(self.names)

    @property
    def names(self) -> tuple[str, ...]:
        """The site names, as strings (torchvision's ``get_graph_node_names``)."""
        return tuple(s.name for s in self)

    def view(self) -> View:
        """What the tables read: the listed sites and the modules that run as written."""
        return View("", self.records, fallbacks=self.fallbacks)

    def table(self, fmt: str = "text") -> Table:
        """A table of name, op, module path and how each site is reached.

        ``fmt`` is ``"text"``, ``"github"`` (Markdown) or ``"html"``.

        Example:
            >>> print(fxprobe.sites(model).table())
        """
        from ..present.summary import summary

        return summary(self.view(), fmt)


def list_sites(model: nn.Module, *, train: bool, tracer: TracerKind,
               leaf_modules: Sequence[Any], autowrap_functions: Sequence[Callable[..., Any]]
               ) -> SiteNames:
    """Plan a copy of ``model`` in one mode and list its sites (see ``fxprobe.sites``)."""
    root = mirror(model)
    root.train(train)
    p = with_canonical(plan(root, tracer=tracer, leaf_modules=leaf_modules,
                            autowrap_functions=autowrap_functions))
    return SiteNames(p.sites, p.fallbacks)
