"""Tracing: a model's module tree -> fx graphs with qualified site names, falling back per module.

``plan()`` walks a (copied) model. Every module it can trace with ``torch.fx`` becomes a *region*:
a graph whose nodes carry torchvision-style names (``layer1.0.relu_1``). A module whose own code
cannot be traced becomes *opaque*: it runs as written, its traceable children become regions of
their own, and its leaf children are reached by hooks.
"""

from __future__ import annotations

import contextlib
import os
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import fx, nn

from ._errors import TraceError
from ._site import Site, method_key, op_key

TracerKind = Literal["auto", "fx", "hooks", "dynamo", "fx+dynamo"]

_TORCH_DIR = os.path.dirname(torch.__file__)
_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)


@dataclass(frozen=True)
class Fallback:
    """A module fxprobe could not trace and runs as written, reaching inside it by hooks."""

    path: str
    """Qualified path of the module ('' for the top-level model)."""
    module_type: type[nn.Module]
    """Its class."""
    error: str
    """The tracing error, one line."""
    location: str
    """``file:line: code`` of the source line where tracing failed, if known."""

    def __str__(self) -> str:
        where = self.path or f"<top-level {self.module_type.__name__}>"
        loc = f" at {self.location}" if self.location else ""
        return f"{where}: {self.error}{loc}"


@dataclass(frozen=True)
class DynamoTarget:
    """A module that runs under torch dynamo: its graphs are tapped when it first runs."""

    path: str
    """Qualified path of the module ('' for the top-level model)."""
    module_type: type[nn.Module]
    """Its class."""
    reason: str
    """Why: the torch.fx error, one line, or that ``tracer="dynamo"`` asked for it."""


@dataclass
class Region:
    """A module traced into one fx graph (named nodes, before any tap is inserted)."""

    path: str
    module: nn.Module
    graph: fx.Graph
    names: dict[fx.Node, str]
    module_paths: dict[fx.Node, str]


@dataclass
class Plan:
    """How one mode (train or eval) of a model is reached: regions, fallbacks, sites in order."""

    root_region: Region | None
    regions: dict[str, Region]
    fallbacks: list[Fallback]
    sites: list[Site]
    dynamo: list[DynamoTarget] = field(default_factory=list)
    """Modules captured by torch dynamo (their sites are known after the first forward)."""


class SiteTracer(fx.Tracer):
    """An fx tracer that names every node as torchvision does and notes where tracing failed.

    Buffers are traced as graph values (``proxy_buffer_attributes``): otherwise a forward that
    updates a buffer in place (a counter, a running statistic) would write into the model's
    real buffer once while tracing and be missing from the graph.
    """

    proxy_buffer_attributes = True

    def __init__(self, prefix: str, leaf_types: tuple[type, ...], leaf_paths: frozenset[str],
                 opaque: set[str], autowrap_functions: tuple[Callable[..., Any], ...]) -> None:
        super().__init__(autowrap_functions=autowrap_functions)
        self.prefix = prefix
        self.leaf_types = leaf_types
        self.leaf_paths = leaf_paths
        self.opaque = opaque
        self.current = ""
        self.names: dict[fx.Node, str] = {}
        self.module_paths: dict[fx.Node, str] = {}
        self.failed_path: str | None = None
        self._counts: dict[str, int] = {}

    def absolute(self, path: str) -> str:
        if not self.prefix:
            return path
        return f"{self.prefix}.{path}" if path else self.prefix

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if module_qualified_name in self.opaque:
            return True
        return is_leaf(m, self.absolute(module_qualified_name), self.leaf_types, self.leaf_paths)

    def call_module(self, m: nn.Module, forward: Callable[..., Any], args: tuple[Any, ...],
                    kwargs: dict[str, Any]) -> Any:
        old = self.current
        try:
            path = self.path_of_module(m)
            self.current = path
            if self.is_leaf_module(m, path):
                return self.create_proxy("call_module", path, args, kwargs)
            try:
                return forward(*args, **kwargs)
            except Exception:
                if self.failed_path is None:  # the innermost module sees the error first
                    self.failed_path = path
                raise
        finally:
            self.current = old

    def create_proxy(self, kind: str, target: Any, args: tuple[Any, ...],
                     kwargs: dict[str, Any], name: str | None = None, type_expr: Any = None,
                     *rest: Any) -> fx.Proxy:
        proxy = super().create_proxy(kind, target, args, kwargs, name, type_expr, *rest)
        node = proxy.node
        if kind == "get_attr" and self._is_buffer(str(target)):
            return proxy  # torchvision's tracer makes no named node for a buffer
        module_path = self.absolute(self.current)
        self.names[node] = self._qualname(module_path, node)
        self.module_paths[node] = module_path
        return proxy

    def _is_buffer(self, target: str) -> bool:
        owner, _, attr = target.rpartition(".")
        try:
            module = self.root.get_submodule(owner)
        except AttributeError:
            return False
        return attr in module._buffers

    def _qualname(self, module_path: str, node: fx.Node) -> str:
        # torchvision's convention: module calls by path, other nodes as <module path>.<node>,
        # fx's global _N suffix replaced by a count local to the module.
        name = module_path
        if node.op != "call_module":
            name = f"{name}.{node.name}" if name else node.name
        base, sep, digits = name.rpartition("_")
        if sep and base and digits.isdigit():
            name = base
        count = self._counts.get(name, 0)
        self._counts[name] = count + 1
        return f"{name}_{count}" if count else name


class TracedStateError(RuntimeError):
    """The traced forward stored a traced value into a module (``self.count += 1``)."""


@contextlib.contextmanager
def refuse_state_writes(tracer: SiteTracer) -> Iterator[None]:
    """While tracing, fail (before writing) when a forward stores a traced value in a module.

    ``self.count += 1`` on a buffer would otherwise put a Proxy into fxprobe's copy of the
    module and leave the update out of the graph; failing sends the module to the fallback,
    where it runs as written.
    """
    original = nn.Module.__setattr__

    def guarded(module: nn.Module, name: str, value: Any) -> None:
        if isinstance(value, fx.Proxy):
            try:
                where = tracer.absolute(_join(tracer.path_of_module(module), name))
            except NameError:
                where = name
            raise TracedStateError(
                f"the forward stores a traced value in {where!r} (self.{name} = ...): "
                "module state that torch.fx cannot record"
            )
        original(module, name, value)

    nn.Module.__setattr__ = guarded  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        nn.Module.__setattr__ = original  # type: ignore[method-assign]


def is_leaf(m: nn.Module, path: str, leaf_types: tuple[type, ...],
            leaf_paths: frozenset[str]) -> bool:
    """fx's default leaves (torch.nn modules but Sequential) plus the user's ``leaf_modules``."""
    if path in leaf_paths or (leaf_types and isinstance(m, leaf_types)):
        return True
    mod = type(m).__module__
    return (mod.startswith("torch.nn") or mod.startswith("torch.ao.nn")) and not isinstance(
        m, nn.Sequential
    )


def failure_location(exc: BaseException) -> str:
    """``file:line: code`` of the deepest frame outside torch and fxprobe."""
    frames = traceback.extract_tb(exc.__traceback__)
    for frame in reversed(frames):
        if frame.filename.startswith(_TORCH_DIR) or frame.filename == __file__:
            continue
        code = (frame.line or "").strip()
        return f"{frame.filename}:{frame.lineno}: {code}"
    return ""


def one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    first = text[0] if text else ""
    return f"{type(exc).__name__}: {first}"


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


class _Planner:
    def __init__(self, tracer: TracerKind, leaf_types: tuple[type, ...],
                 leaf_paths: frozenset[str], autowrap: tuple[Callable[..., Any], ...]) -> None:
        self.tracer = tracer
        self.leaf_types = leaf_types
        self.leaf_paths = leaf_paths
        self.autowrap = autowrap
        self.regions: dict[str, Region] = {}
        self.fallbacks: list[Fallback] = []
        self.sites: list[Site] = []
        self.dynamo: list[DynamoTarget] = []
        # "fx+dynamo": what fx cannot trace goes to dynamo ("dynamo" sends everything there).
        self.use_dynamo = tracer == "fx+dynamo"

    def visit(self, module: nn.Module, path: str) -> Region | None:
        """Trace ``module`` (marking untraceable descendants opaque) or make it opaque."""
        if self.tracer == "hooks" or isinstance(module, _CONTAINERS):
            self.open_up(module, path)
            return None
        if self.tracer == "dynamo":
            self.dynamo.append(DynamoTarget(path, type(module), "tracer='dynamo'"))
            return None
        opaque: set[str] = set()
        errors: dict[str, BaseException] = {}
        while True:
            tracer = SiteTracer(path, self.leaf_types, self.leaf_paths, opaque, self.autowrap)
            try:
                with refuse_state_writes(tracer):
                    graph = tracer.trace(module)
                break
            except Exception as e:  # any failure of tracing sends that module to the fallback
                rel = tracer.failed_path or ""
                if self.tracer == "fx":
                    raise _trace_error(module, path, rel, e) from e
                if (rel == "" or rel in opaque) and self.use_dynamo:
                    self.dynamo.append(DynamoTarget(path, type(module), one_line(e)))
                    return None
                if rel == "" or rel in opaque:
                    self.fallbacks.append(Fallback(path, type(module), one_line(e),
                                                   failure_location(e)))
                    self.open_up(module, path)
                    return None
                opaque.add(rel)
                errors[rel] = e
        region = Region(path, module, graph, tracer.names, tracer.module_paths)
        self.regions[path] = region
        for node in graph.nodes:
            if node.op == "output" or node not in tracer.names:
                continue
            if node.op == "call_module" and node.target in opaque:
                sub_path = _join(path, str(node.target))
                sub = module.get_submodule(str(node.target))
                err = errors[str(node.target)]
                if self.use_dynamo:
                    self.dynamo.append(DynamoTarget(sub_path, type(sub), one_line(err)))
                    self.sites.append(self.fx_site(region, node))
                    continue
                self.fallbacks.append(Fallback(sub_path, type(sub), one_line(err),
                                               failure_location(err)))
                self.open_up(sub, sub_path)
            self.sites.append(self.fx_site(region, node))
        return region

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

    def fx_site(self, region: Region, node: fx.Node) -> Site:
        name = region.names[node]
        mpath = region.module_paths[node]
        if node.op == "call_module":
            target = _join(region.path, str(node.target))
            mtype = type(region.module.get_submodule(str(node.target)))
            return Site(name, "fx", node.op, target, target, mtype, None)
        if node.op == "call_function":
            return Site(name, "fx", node.op, node.target, mpath, None, op_key(node.target))
        if node.op == "call_method":
            return Site(name, "fx", node.op, node.target, mpath, None, method_key(str(node.target)))
        return Site(name, "fx", node.op, node.target, mpath, None, None)


def _trace_error(module: nn.Module, path: str, rel: str, e: BaseException) -> TraceError:
    failed = _join(path, rel)
    sub = module.get_submodule(rel) if rel else module
    what = f"module {failed!r} ({type(sub).__name__})" if failed else (
        f"the top-level forward of {type(module).__name__}")
    loc = failure_location(e)
    return TraceError(
        f"torch.fx could not trace {what}: {one_line(e)}"
        + (f"\n  at {loc}" if loc else "")
        + "\nUse tracer='auto' to tap the rest at op level and reach this module by hooks, "
        "or pass leaf_modules=[...] naming it (type or path) to keep it opaque."
    )


def hook_site(module: nn.Module, path: str) -> Site:
    return Site(path, "hook", "call_module", path, path, type(module), None)


def plan(root: nn.Module, *, tracer: TracerKind, leaf_modules: Sequence[Any] = (),
         autowrap_functions: Sequence[Callable[..., Any]] = ()) -> Plan:
    """Trace ``root`` (a copy of the user's model, already in the wanted mode)."""
    leaf_types = tuple(t for t in leaf_modules if isinstance(t, type))
    leaf_paths = frozenset(p for p in leaf_modules if isinstance(p, str))
    planner = _Planner(tracer, leaf_types, leaf_paths, tuple(autowrap_functions))
    root_region = planner.visit(root, "")
    return Plan(root_region, planner.regions, planner.fallbacks, planner.sites, planner.dynamo)
