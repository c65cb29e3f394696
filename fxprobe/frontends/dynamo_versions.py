"""One captured graph of a dynamo region, rewritten for one instance of its frame's module:
the function that runs it, the names of what it keeps, and which sites it can edit per call.

:class:`~.dynamo.DynamoRegion` makes them (``instrument``); a graph dynamo reuses for another
instance of the module gets a version of its own, named for that instance.
"""

from __future__ import annotations

import weakref
from typing import Any

from torch import fx

from ..capture.pipeline import CallTable
from ..capture.rewrite import Compiled
from ..core.site import sites_of


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
