"""One captured graph of a dynamo region, rewritten for one instance of its frame's module:
the function that runs it, the names of what it keeps, and which sites it can edit per call.

:class:`~.dynamo.DynamoRegion` makes them (``instrument``); a graph dynamo reuses for another
instance of the module gets a version of its own, named for that instance. ``_Captured``, what
the region's backend returns for each graph dynamo captured, holds a graph's versions and
picks the one for the instance each call runs (by its anchor parameter).
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Sequence
from typing import Any

from torch import fx, nn

from ..capture.pipeline import CallTable
from ..capture.rewrite import Compiled
from ..core.site import SOURCE, STATE, sites_of, source_name
from .dynamo_names import FILE_LINE, INPUT, frame_id, input_name, param_path


class Instrumented:
    """One captured graph rewritten for one instance of its frame's module."""

    __slots__ = ("fn", "holder", "names", "graph", "copied", "outplaced", "prefix", "named",
                 "ran", "repeat", "count", "pointed", "points", "sites", "served",
                 "aliases")

    def __init__(self, compiled: Compiled, prefix: str, named: fx.Graph, repeat: int = 0,
                 points: frozenset[str] = frozenset(), sites: frozenset[str] = frozenset()
                 ) -> None:
        self.graph = compiled.graph
        self.fn = compiled.fn
        self.holder = compiled.holder
        self.names = compiled.names
        self.copied = compiled.copied
        self.outplaced = compiled.outplaced
        self.prefix = prefix
        """The path, relative to the region, of the module instance it runs for."""
        self.named = named
        """The graph with its sites, before the taps went in (for the pictures)."""
        self.ran = (-1, -1)
        """(forward, place among the graphs it ran) of its first run in the last forward it
        ran in (for the pictures: graphs drawn in the order they ran)."""
        self.repeat = repeat
        """0; n for the version named for the (n+1)-th run of its code for the same module
        instance in one forward (the module called again)."""
        self.count = ""
        """The key counting the runs of its code for its instance in a forward
        (``Frame.hook_calls``; set by ``_Captured``)."""
        self.pointed: Instrumented | None = None
        """The same graph with an intervention point at every site (``capture.points``):
        what runs while the calling thread has a per-call table (``tapped.intervene``) that
        names a site without a point here."""
        self.points = points
        """The sites with an intervention point in this version: a graph built for ``tap()``
        has one at each site it selected (but the pattern beside SDPA), so a per-call block
        on those runs it as it is, with no graph built."""
        self.sites = sites
        """The names of every site of the graph."""
        kept = set(self.names)
        self.aliases = {c: s.name for node in named.nodes for s in sites_of(node)
                        if s.name in kept for c in s.canonical}
        """The canonical names this graph gives the sites it keeps (another graph of the same
        code may give them to others: ``Frame.aliases``)."""
        self.served: tuple[int, int, int, bool] = (0, -1, -1, False)
        """(table serial, its sizes, whether this version serves it): :meth:`serves`, once
        per table and resolution (a serial, not an ``id``, which a later table may reuse)."""

    def serves(self, table: CallTable) -> bool:
        """Whether every site of this graph that ``table`` intervenes on or keeps has a point
        here (else the version with a point at every site runs)."""
        key = (table.serial, len(table.fns), len(table.cache))
        served = self.served  # read once: another thread's table may write it meanwhile
        if served[:3] == key:
            return served[3]
        sites, points = self.sites, self.points
        ok = all(n in points for n in table.fns if n in sites) and all(
            n in points for n in table.cache if n in sites)
        self.served = (*key, ok)
        return ok


def forget_when_freed(owner: Any, anchor: Any, key: Any) -> None:
    """Drop ``owner.versions[key]`` (a version looked up by ``id(anchor)``, the parameter that
    tells which instance runs the graph) once ``anchor`` is freed: Python may give its address
    to a new parameter of another instance (a block's weights replaced, a checkpoint loaded
    with ``assign=True``), which would otherwise run under this instance's names."""
    weakref.finalize(anchor, _forget, weakref.ref(owner), key).atexit = False


def _forget(owner: weakref.ref[Any], key: Any) -> None:
    found = owner()
    if found is not None:
        found.versions.pop(key, None)


def _unwrapped(fn: Any) -> Any:
    """The function a decorator's ``functools.wraps`` wrapper calls (``fn`` itself where
    there is none, or where the chain of ``__wrapped__`` loops)."""
    try:
        return inspect.unwrap(fn)
    except ValueError:
        return fn


class _Captured:
    """A graph dynamo handed to the backend, and its instrumented versions."""

    def __init__(self, region: Any, gm: fx.GraphModule,  # a dynamo.DynamoRegion
                 example_inputs: Sequence[Any]) -> None:
        self.region = region
        self.gm = gm
        self.frame = frame_id()
        self.block = bool(getattr(region, "in_block_capture", False))
        """Whether this is a shared block's own graph (``dynamo_blocks``), run inside an op
        of the graph around it: not a graph break."""
        # A parameter the graph receives, to tell which module instance runs the frame:
        # preferably one reached from the frame's ``self`` and no other module's (a weight
        # tied across layers names both: layer 1 would run as layer 0's second call).
        self.anchor: int | None = None
        self.anchor_rel, best = "", (False, False)
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        for node in placeholders:  # dynamo drops its grapharg when the backend returns
            kept = source_name(node)
            if kept is not None:
                node.meta[SOURCE] = kept
            arg = input_name(node, region.arg_names)
            if arg is not None:
                node.meta[INPUT] = arg
        for i, node in enumerate(placeholders[: len(example_inputs)]):
            name = source_name(node)
            if isinstance(example_inputs[i], nn.Parameter) or (
                    isinstance(name, str) and "_buffers" in name):
                node.meta[STATE] = True  # the module's own: no code around the graph writes it
            if not isinstance(name, str) or not isinstance(example_inputs[i], nn.Parameter):
                continue
            rel = param_path(name)
            if rel is None:
                continue
            rank = (name.startswith("L['self']"), len(region.owners(example_inputs[i])) < 2)
            if self.anchor is None or rank > best:
                self.anchor, self.anchor_rel, best = i, rel, rank
                if all(rank):
                    break
        self.unplaced: tuple[str, int] | None = None
        """Where the frame's own code is (file, line), where it is no module's ``forward`` of
        the region, or several modules' (set by :meth:`_locate`): its sites are named as the
        region module's own, with no module path."""
        self.located = self._locate() if self.anchor is None else ""
        self.captured_prefix = self.prefix_of(example_inputs)
        self.versions: dict[int | tuple[int, int], Instrumented] = {}
        """Each version by ``id()`` of the anchor it ran with (and its repeat)."""
        self.named_for: dict[tuple[str, int], Instrumented] = {}  # by instance and repeat
        self.stamp = -1

    def _locate(self) -> str:
        """Without a parameter to tell: the one module of the region whose ``forward`` holds
        the frame's own code (a module's forward split by a graph break runs as a frame of
        its own); "" (the region's module) if none or several do."""
        lines = set()
        for node in self.gm.graph.nodes:
            if node.op in ("call_function", "call_method", "call_module") and not node.meta.get(
                    "nn_module_stack"):
                found = FILE_LINE.findall(node.meta.get("stack_trace") or "")
                if found:
                    lines.add((found[-1][0], int(found[-1][1])))
        if not lines:
            return ""
        owners = set()
        for rel, m in self.region.module.named_modules():
            forward = type(m).forward  # and the function a decorator wraps (transformers'
            for fn in {forward, _unwrapped(forward)}:  # dynamic_rope_update)
                code = getattr(fn, "__code__", None)
                if code is None:
                    continue
                last = max((ln for _, _, ln in code.co_lines() if ln is not None),
                           default=code.co_firstlineno)
                if all(f == code.co_filename and code.co_firstlineno <= ln <= last
                       for f, ln in lines):
                    owners.add(rel)
        if len(owners) != 1:  # a function of its own (after a graph break inside it), or the
            # code of a module class the region holds several of, with no parameter to tell
            self.unplaced = min(lines)
        return owners.pop() if len(owners) == 1 else ""

    def prefix_of(self, args: Sequence[Any]) -> str:
        if self.anchor is None:
            return self.located
        rel = self.anchor_rel
        for owner in self.region.owners(args[self.anchor]):
            if owner == rel or owner.endswith("." + rel):
                return owner[: len(owner) - len(rel)].rstrip(".")
        return ""

    def version(self, args: Sequence[Any], repeat: int = 0) -> Instrumented:
        anchor = id(args[self.anchor]) if self.anchor is not None else 0
        key = (anchor, repeat) if repeat else anchor
        found = self.versions.get(key)
        if found is None:
            prefix = self.prefix_of(args)
            found = self.named_for.get((prefix, repeat))
            if found is None:  # (an instance whose anchor was replaced keeps its version)
                found = self.named_for[prefix, repeat] = self.region.instrument(
                    self.gm, self.captured_prefix, prefix, repeat)
            # Graphs of one frame (recompilations) run the same code, under the same names.
            found.count = (f"\0dynamo:{self.region.path}:"
                           f"{self.frame if self.frame is not None else id(self)}:{found.prefix}")
            self.versions[key] = found
            if self.anchor is not None:  # its address is another parameter's once freed
                forget_when_freed(self, args[self.anchor], key)
        return found

    def __call__(self, *args: Any) -> Any:
        region = self.region
        anchor = self.anchor
        version = self.versions.get(id(args[anchor]) if anchor is not None else 0)
        if version is None:
            version = self.version(args)
        state = region.pipeline.rec.state
        if state.active:
            # The same code for the same module ran before in this forward (code around the
            # graphs called the module again): the values of this run are sites of their own.
            calls = state.frame.hook_calls
            n = calls.get(version.count, 0)
            calls[version.count] = n + 1
            if n:
                version = self.version(args, n)
        table = region.pipeline.per_call.table
        if table is not None:  # one check per graph run: per-call interventions or a cache
            table.check(region)
            if not version.serves(table):
                if version.pointed is None:  # no dynamo: the captured graph, rewritten again
                    version.pointed = region.instrument(self.gm, self.captured_prefix,
                                                        version.prefix, version.repeat,
                                                        drawn=version.named)
                version = version.pointed
        result = version.fn(version.holder, *args)
        if self.stamp != region.calls:  # the first run of this graph in this forward
            self.stamp = region.calls
            region.runs += not self.block
        if version.ran[0] != region.calls:
            region.steps += 1
            version.ran = (region.calls, region.steps)
        region.pipeline.store(version.names, result[1], version.aliases)
        return result[0]
