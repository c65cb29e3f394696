"""The records the readers read: what the tables and pictures may see of a model.

The frontends write these records (a :class:`Plan` of regions and fallbacks, the graphs torch
dynamo captured as :class:`CapturedGraph`, :class:`DynamoInfo`), the runtime gathers them into
one :class:`View` per object (a tapped module, a tapped artifact, a listing of sites, a plain
model planned for a picture), and ``fxprobe.present`` reads only that, the way torch.fx's
``graph_drawer`` reads only the ``TensorMetadata`` that ``shape_prop`` wrote.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import fx, nn

from .site import Site, sites_of, source_name


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

    @property
    def where(self) -> str:
        """The module's path, or "the top-level module"."""
        return self.path or "the top-level module"

    @property
    def what(self) -> str:
        """``module 'gate' (Gate)``, or ``the top-level forward of Net``."""
        if self.path:
            return f"module {self.path!r} ({self.module_type.__name__})"
        return f"the top-level forward of {self.module_type.__name__}"

    def __str__(self) -> str:
        where = self.path or f"<top-level {self.module_type.__name__}>"
        loc = f" at {self.location}" if self.location else ""
        return f"{where}: {self.error}{loc}"


@dataclass(frozen=True)
class Region:
    """A module traced into one fx graph whose nodes carry their sites (before any tap)."""

    path: str
    """Qualified path of the traced module ('' for the model)."""
    module: nn.Module
    """fxprobe's copy of that module."""
    graph: fx.Graph
    """The traced graph; ``sites_of(node)`` gives each node's sites."""

    def sites(self) -> Iterator[tuple[fx.Node, Site]]:
        """Every (node, site) of the graph, in execution order."""
        for node in self.graph.nodes:
            for site in sites_of(node):
                yield node, site


@dataclass(frozen=True)
class Plan:
    """How one mode (train or eval) of a model is reached: regions, fallbacks, sites in order."""

    root_region: Region | None
    """The region of the whole model, when fx traced its top-level forward; else None."""
    regions: dict[str, Region]
    """Every traced region, by module path ('' for the model)."""
    fallbacks: list[Fallback]
    """The modules that run as written (reached by hooks), outermost first."""
    sites: list[Site]
    """Every site, in execution order."""
    dynamo: list[Any] = field(default_factory=list)
    """Modules captured by torch dynamo (the fx frontend's ``DynamoTarget`` s); their sites
    are known after their first forward."""
    deferred: list[Any] = field(default_factory=list)
    """``tracer="auto"``: fallbacks to try with torch dynamo at their first call (the fx
    frontend's ``Deferred`` records)."""


@dataclass(frozen=True)
class DynamoInfo:
    """What the dynamo frontend captured for one module (``tapped.dynamo_info``)."""

    path: str
    """Path of the module dynamo runs ('' for the whole model)."""
    graphs: int
    """Graphs captured so far: one per frame and graph break, plus one per recompilation."""
    breaks: int
    """Graph breaks in the last forward: the distinct graphs it ran, minus one (as
    ``torch._dynamo.explain`` counts them)."""
    sites: int
    """Sites discovered so far in these graphs."""

    def __str__(self) -> str:
        where = self.path or "<model>"
        return (f"{where}: {self.graphs} graph(s) captured by dynamo, {self.breaks} graph "
                f"break(s) in the last forward, {self.sites} site(s)")


@dataclass(frozen=True)
class CapturedGraph:
    """One graph torch dynamo captured, named for one module instance: what pictures draw."""

    key: str
    """Its key in ``tapped.graphs`` (``"dynamo:<path>:<n>"``, ``"@<instance>"`` when reused)."""
    path: str
    """Path of the module dynamo runs ('' for the whole model)."""
    number: int
    """Its place in the order dynamo captured the region's graphs, from 0."""
    frame: int | None
    """Dynamo's id of the frame (code object) it was captured from: a recompilation (a new
    sequence length) captures the same frame again under the same id; None if unknown."""
    instance: str
    """Path of the module instance its names are for (``h.1`` running ``h.0``'s graph)."""
    graph: fx.Graph
    """The captured graph with its sites (``node.meta``), before the taps went in."""
    ran: tuple[int, int]
    """When it last ran: (forward, place among the graphs that forward ran), (-1, -1) if never;
    the graphs of the last forward sorted by it are in the order they ran."""
    called_by: str = ""
    """For a graph that runs inside one op of another graph (a repeated block captured once
    and called as one op, ``frontends/dynamo_blocks``), the path of the module whose call
    that op is (``model.layers.7``); "" for a graph that runs on its own."""
    inputs: Mapping[str, tuple[int | str, ...]] = field(default_factory=dict, compare=False,
                                                        hash=False)
    """For such a graph, where each of its inputs comes from in that op's arguments, by
    placeholder name: ``(0, i, ...)`` indexes the op node's ``args``, ``(1, name, ...)`` its
    ``kwargs``, the rest into the tuples they hold."""


def is_state(node: fx.Node) -> bool:
    """Whether a placeholder of a dynamo graph is a parameter or buffer of a module (dynamo
    passes the module's state in as graph inputs), not a value the code computed or was given."""
    name = source_name(node)
    return name is not None and ("._parameters[" in name or "._buffers[" in name)


@dataclass(frozen=True)
class ValueInfo:
    """Shape, dtype and size of a captured value, as text (tensors nested anywhere count)."""

    shape: str
    """``[2, 8, 16, 16]`` for a tensor, ``([2, 6, 12], [1, 2, 12])`` for a tuple of them, the
    value itself for a small Python scalar, else empty."""
    dtype: str
    """``float32``; several dtypes joined by commas; the type name of a non-tensor value."""
    nbytes: int | None
    """Sum of ``numel * element_size`` over the tensors in the value (inputs and output for
    ``capture="both"``); None if it holds none."""

    @property
    def label(self) -> str:
        """One line for a graph node: ``float32 [2, 8, 16, 16]``."""
        return f"{self.dtype} {self.shape}".strip()


Shapes = Callable[[tuple[Any, ...], dict[str, Any]], Mapping[str, ValueInfo]]
"""Runs one example input (positional, keyword arguments) where it changes nothing of the
user's and returns the :class:`ValueInfo` of every site it reached, by site name."""


@dataclass(frozen=True)
class View:
    """What the tables and pictures read of one object: a tapped module or artifact, a listing
    of sites, or a model planned for a picture. Nothing in it is private state."""

    title: str
    """How a picture's caption names it: ``Net (eval mode)``, ``ExportedProgram (torch.export)``."""
    sites: tuple[Site, ...] = ()
    """The sites a listing shows, in execution order (``fxprobe.sites``: the listed ones)."""
    selected: tuple[Site, ...] = ()
    """The sites tapped (a tapped object), or marked with ``ops=`` (a model drawn)."""
    fallbacks: tuple[Fallback, ...] = ()
    """The modules that run as written."""
    tapped: bool = False
    """A tapped module or artifact: a table shows what its last forward captured at each of
    ``selected``; otherwise it lists ``sites``."""
    taps: Mapping[str, Any] | None = None
    """The last forward's values, by site name; None before any forward (or not tapped)."""
    capture: str = "output"
    """What a tap captures (``capture=`` of ``fxprobe.tap``)."""
    plan: Plan | None = None
    """What a picture draws; None where there is nothing to draw (a list of sites)."""
    root: nn.Module | None = None
    """The module tree of the plan (for a deployed artifact, a stand-in with its type names)."""
    dynamo_info: tuple[DynamoInfo, ...] = ()
    """What torch dynamo captured (graphs, breaks), for modules it runs."""
    graphs: tuple[CapturedGraph, ...] = ()
    """The graphs torch dynamo captured in the modules it runs, with their sites, in the order
    captured (every version: recompilations and reuses for other instances included)."""
    artifact: bool = False
    """A deployed artifact (TorchScript, torch.export): every site is a value of one graph."""
    shapes: Shapes | None = None
    """Notes the shapes of an example input (see :data:`Shapes`); None where nothing runs."""


class Viewable:
    """What hands the readers one :class:`View`: ``TappedModule``, ``TappedArtifact``,
    ``SiteNames``. Lower layers recognise these objects by this class, never by importing
    them."""

    __slots__ = ()

    def view(self) -> View:
        """What the tables and pictures read of this object."""
        raise NotImplementedError
