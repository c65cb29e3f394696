"""Planning: a model's module tree -> fx regions with qualified site names, falling back per module.

``plan()`` walks a (copied) model. Every module it can trace with ``torch.fx`` (the tracer:
:mod:`frontends.fx_tracer`) becomes a *region*: a graph whose nodes carry torchvision-style
names (``layer1.0.relu_1``). A module whose own code cannot be traced becomes *opaque*: it runs
as written, its traceable children become regions of their own, and its leaf children are
reached by hooks. Under ``tracer="auto"`` such a module is also a :class:`Deferred` (torch
dynamo gets a try at it at run time: ``runtime.lifecycle``); under ``"dynamo"`` and
``"fx+dynamo"`` a :class:`DynamoTarget`.
"""

from __future__ import annotations

import functools
import linecache
import os
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..core.errors import ConfigError, TracedStateError, TraceError
from ..core.irtypes import library_blocks
from ..core.names import did_you_mean, one_line
from ..core.names import join as _join
from ..core.ops import module_key
from ..core.options import TracerKind
from ..core.site import Site, sites_of
from ..core.view import Fallback, Plan, Region
from .fx_tracer import Namer, SiteTracer, autowrap_modules, is_leaf
from .mirror import guard_state, has_patched_forward, user_hooks

__all__ = ["Deferred", "DynamoTarget", "Fallback", "Namer", "Plan", "Region", "SiteTracer",
           "autowrap_modules", "failure_location", "hook_site", "is_leaf", "plan"]

_TORCH_DIR = os.path.dirname(torch.__file__)
# fxprobe's tracing machinery: its frames are never where a model's tracing failed.
_OWN_FILES = tuple(os.path.join(os.path.dirname(os.path.abspath(__file__)), f)
                   for f in ("fx.py", "fx_tracer.py", "mirror.py"))
_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)


@dataclass(frozen=True)
class DynamoTarget:
    """A module that runs under torch dynamo (``_dynamo``): its sites are found as it runs."""

    path: str
    """Qualified path of the module ('' for the top-level model)."""
    module_type: type[nn.Module]
    """Its class."""
    reason: str
    """Why: the torch.fx error, one line, or that ``tracer="dynamo"`` asked for it."""


@dataclass(frozen=True)
class Deferred:
    """``tracer="auto"``: a module fx could not trace, tried with torch dynamo at its first call.

    Until then (and for good if dynamo fails on it) it is a :class:`Fallback` like any other:
    its hook sites and the regions traced inside it are in the plan, so that they are known
    before the first forward. Once dynamo captured it, its dynamo sites replace them.
    """

    fallback: Fallback
    """The module as a fallback: path, type, the torch.fx error."""
    sites: frozenset[str]
    """The names of the sites the fallback reaches inside it (hooks, regions traced inside)."""
    regions: frozenset[str]
    """The paths of the regions traced inside it."""
    fallbacks: tuple[Fallback, ...]
    """Its own fallback and those of untraceable modules inside it."""

    @property
    def path(self) -> str:
        return self.fallback.path

    def covers(self, path: str) -> bool:
        """Whether ``path`` is a module strictly inside this one."""
        own = self.fallback.path
        return path != own and (not own or path.startswith(own + "."))



def failure_location(exc: BaseException, module: nn.Module | None = None) -> str:
    """``file:line: code`` of the deepest frame outside torch and fxprobe.

    Some failures happen before any of the model's code runs (fx refusing a signature:
    ``co_varnames is too small``); they point at the ``forward`` of ``module`` instead.
    """
    frames = traceback.extract_tb(exc.__traceback__)
    for frame in reversed(frames):
        if frame.filename.startswith(_TORCH_DIR) or frame.filename in _OWN_FILES:
            continue
        code = (frame.line or "").strip()
        return f"{frame.filename}:{frame.lineno}: {code}"
    forward = getattr(type(module), "forward", None) if module is not None else None
    code_obj = getattr(forward, "__code__", None)
    if code_obj is None:
        return ""
    line = linecache.getline(code_obj.co_filename, code_obj.co_firstlineno).strip()
    return f"{code_obj.co_filename}:{code_obj.co_firstlineno}: {line or 'def forward(...)'}"


class _Planner:
    def __init__(self, tracer: TracerKind, leaf_types: tuple[type, ...],
                 leaf_paths: frozenset[str], autowrap: tuple[Callable[..., Any], ...],
                 blocks: tuple[type, ...] = ()) -> None:
        self.blocks = blocks
        self.tracer = tracer
        self.leaf_types = leaf_types
        self.leaf_paths = leaf_paths
        self.autowrap = autowrap
        self.regions: dict[str, Region] = {}
        self.fallbacks: list[Fallback] = []
        self.sites: list[Site] = []
        self.dynamo: list[DynamoTarget] = []
        self.bounded: set[str] = set()  # modules with hooks, called from a traced region
        # "fx+dynamo": what fx cannot trace goes to dynamo ("dynamo" sends everything there).
        self.use_dynamo = tracer == "fx+dynamo"
        # "auto": what fx cannot trace falls back to hooks, and is tried with dynamo at run
        # time; not inside such a module (dynamo runs all of it, or none).
        self.deferred: list[Deferred] = []
        self.defer = tracer == "auto"

    def visit(self, module: nn.Module, path: str) -> Region | None:
        """Trace ``module`` (marking untraceable descendants opaque) or make it opaque."""
        if self.tracer == "hooks" or isinstance(module, _CONTAINERS):
            self.open_up(module, path)
            return None
        if has_patched_forward(module):  # under "auto", dynamo tries the forward as patched
            self.fall_back(Fallback(path, type(module), _PATCHED, ""), module, path)
            return None
        if self.tracer == "dynamo":
            self.dynamo.append(DynamoTarget(path, type(module), "tracer='dynamo'"))
            return None
        opaque: set[str] = set()
        errors: dict[str, Fallback] = {}
        for rel, m in module.named_modules():
            if rel and has_patched_forward(m):
                opaque.add(rel)
                errors[rel] = Fallback(_join(path, rel), type(m), _PATCHED, "")
        while True:
            tracer = SiteTracer(path, self.leaf_types, self.leaf_paths, opaque, self.autowrap,
                                self.blocks)
            try:
                with guard_state(module, functools.partial(_path_in, tracer)):
                    graph = tracer.trace(module)
                break
            except Exception as e:  # any failure of tracing sends that module to the fallback
                rel = tracer.failed_path or ""
                if isinstance(e, TracedStateError) and e.module_path is not None:
                    rel = e.module_path
                if self.tracer == "fx":
                    raise _trace_error(module, path, rel, e) from e
                sub = module.get_submodule(rel) if rel else module
                failure = Fallback(_join(path, rel), type(sub), one_line(e),
                                   failure_location(e, sub))
                if (rel == "" or rel in opaque) and self.use_dynamo:
                    self.dynamo.append(DynamoTarget(path, type(module), failure.error))
                    return None
                if rel == "" or rel in opaque:
                    self.fall_back(failure, module, path)
                    return None
                opaque.add(rel)
                errors[rel] = failure
        region = Region(path, module, graph)
        self.regions[path] = region
        for node in graph.nodes:
            if node.op == "call_module" and node.target in opaque:
                rel = str(node.target)
                sub = module.get_submodule(rel)
                if self.use_dynamo and not has_patched_forward(sub):
                    self.dynamo.append(DynamoTarget(_join(path, rel), type(sub),
                                                    errors[rel].error))
                else:
                    self.fall_back(errors[rel], sub, _join(path, rel))
            elif node.op == "call_module":
                self._enter_boundary(module, path, str(node.target))
            self.sites.extend(sites_of(node))
        return region

    def _enter_boundary(self, module: nn.Module, path: str, rel: str) -> None:
        """A module with hooks of its own is called, not inlined (its hooks run at each call);
        what it computes is reached as a region of its own, as any traced module is."""
        sub = module.get_submodule(rel)
        cpath = _join(path, rel)
        if (cpath in self.bounded or not user_hooks(sub)
                or is_leaf(sub, cpath, self.leaf_types, self.leaf_paths)):
            return
        self.bounded.add(cpath)
        if isinstance(sub, _CONTAINERS):
            self.open_up(sub, cpath)
        else:
            self.visit(sub, cpath)

    def fall_back(self, failure: Fallback, module: nn.Module, path: str) -> None:
        """``module`` runs as written; under "auto", dynamo gets a try at it first."""
        if not self.defer:
            self.fallbacks.append(failure)
            self.open_up(module, path)
            return
        n_sites, n_fallbacks, regions = len(self.sites), len(self.fallbacks), set(self.regions)
        self.fallbacks.append(failure)
        self.defer = False  # nothing inside is deferred on its own
        try:
            self.open_up(module, path)
        finally:
            self.defer = True
        self.deferred.append(Deferred(
            failure, frozenset(s.name for s in self.sites[n_sites:]),
            frozenset(set(self.regions) - regions), tuple(self.fallbacks[n_fallbacks:])))

    def open_up(self, module: nn.Module, path: str) -> None:
        """Reach inside a module that runs as written: hooks on leaves, regions elsewhere."""
        for name, child in module.named_children():
            cpath = _join(path, name)
            if self.tracer == "hooks":
                self.open_up(child, cpath)
                if not isinstance(child, _CONTAINERS):
                    self.sites.append(hook_site(child, cpath))
            elif isinstance(child, _CONTAINERS):
                self.open_up(child, cpath)
            elif is_leaf(child, cpath, self.leaf_types, self.leaf_paths):
                self.sites.append(hook_site(child, cpath))
            elif self.visit(child, cpath) is None:
                # Runs as written inside code that runs as written: its call is hooked.
                self.sites.append(hook_site(child, cpath))


_PATCHED = ("its forward was replaced on the instance (a patched forward, e.g. by accelerate "
            "or PEFT): it runs as written")


def _path_in(tracer: SiteTracer, module: nn.Module) -> str | None:
    try:
        return tracer.absolute(tracer.path_of_module(module))
    except NameError:
        return None


def _trace_error(module: nn.Module, path: str, rel: str, e: BaseException) -> TraceError:
    sub = module.get_submodule(rel) if rel else module
    f = Fallback(_join(path, rel), type(sub), one_line(e), failure_location(e, sub))
    return TraceError(
        f"torch.fx could not trace {f.what}: {f.error}"
        + (f"\n  at {f.location}" if f.location else "")
        + "\nUse tracer='auto' to tap the rest at op level and reach this module by hooks, "
        "or pass leaf_modules=[...] naming it (type or path) to keep it opaque."
    )


def hook_site(module: nn.Module, path: str) -> Site:
    return Site(path, "hook", "call_module", path, path, type(module), module_key(type(module)))


def plan(root: nn.Module, *, tracer: TracerKind, leaf_modules: Sequence[Any] = (),
         autowrap_functions: Sequence[Callable[..., Any]] = ()) -> Plan:
    """Trace ``root`` (fxprobe's copy of the user's model, already in the wanted mode)."""
    leaf_types = tuple(t for t in leaf_modules if isinstance(t, type))
    leaf_paths = frozenset(p for p in leaf_modules if isinstance(p, str))
    paths = [name for name, _ in root.named_modules() if name]
    for p in sorted(leaf_paths - set(paths)):
        raise ConfigError(
            f"leaf_modules entry {p!r} is no module path of {type(root).__name__}: pass paths "
            "as model.named_modules() gives them (e.g. 'encoder.layer.0') or module types."
            f"{did_you_mean(p, paths)}")
    planner = _Planner(tracer, leaf_types, leaf_paths, tuple(autowrap_functions),
                       library_blocks())
    root_region = planner.visit(root, "")
    return Plan(root_region, planner.regions, planner.fallbacks, planner.sites, planner.dynamo,
                planner.deferred)
