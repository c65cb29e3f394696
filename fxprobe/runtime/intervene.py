"""Per-call interventions and caching on a tapped module, without a new capture.

``with tapped.intervene({selector: fn}): tapped(...)`` and ``tapped.run_with_cache(...)`` set a
table for the calling thread (:class:`Table`, the ``CallTable`` that ``Pipeline.point``
reads). While one is set, each graph that torch dynamo captured runs its second version, with
an intervention point at every site (``capture.points``; built once per graph, the first time,
from the graph dynamo already handed over: dynamo captures nothing again). Without a table the
graphs run as ``tap()`` built them: one check per graph run is all that a block costs outside.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch

from ..core.errors import ConfigError, InterventionError, SelectorError, UnknownSiteError
from ..core.names import did_you_mean
from ..core.select import Selector, as_selector, as_selectors, no_match_message
from ..core.site import Site
from ..frontends.attention import attention_probs
from ..frontends.dynamo import DynamoRegion
from .lifecycle import Lifecycle, State

TappedModule = Any
"""``tapped.TappedModule``, which imports this module (no import back: no cycle)."""

Fn = Callable[[Site, Any], Any]
Entry = tuple[Selector, Fn, str | None]
"""A selector, its function and the site name it is (a plain string), if one."""


class Table:
    """One thread's per-call interventions (selectors and functions) and cache selectors,
    resolved against each dynamo region's sites as they are found.

    Args:
        prog: the lifecycle of the tapped module's program (which sites are selected now).
        fns: ``(selector, fn, name)`` entries, applied in this order where several match a site.
        cache: the selectors of the sites to keep (None: every site; ``()``: none).
        model: the model's name, for messages.
    """

    def __init__(self, prog: Lifecycle, fns: list[Entry],
                 cache: list[Selector] | None | tuple[()], model: str) -> None:
        self.prog = prog
        self.entries = fns
        self.cache_selectors = cache
        self.model = model
        self.fns: dict[str, tuple[Site, tuple[Fn, ...]]] = {}
        self.cache: frozenset[str] = frozenset()
        self.values: dict[str, Any] = {}
        self.replaced: set[str] = set()
        self.known: dict[int, int] = {}
        self.matched: set[int] = set()
        self.cache_matched: set[int] = set()

    def check(self, region: DynamoRegion) -> None:
        """Resolve the selectors against ``region``'s sites if it found new ones since."""
        if self.known.get(id(region)) == len(region.sites):
            return
        self.known[id(region)] = len(region.sites)
        cached = set(self.cache)
        sites: Iterable[Site] = region.sites.values()
        names = [name for _, _, name in self.entries]
        if self.cache_selectors == () and all(n in region.sites for n in names):  # no scan
            sites = [region.sites[n] for n in dict.fromkeys(names) if n in region.sites]
        for site in sites:
            fns = []
            for i, (sel, fn, _) in enumerate(self.entries):
                if sel(site):
                    self.matched.add(i)
                    fns.append(fn)
            if fns:
                self._editable(site)
                self.fns[site.name] = (site, tuple(fns))
            if self._cached(site):
                cached.add(site.name)
        self.cache = frozenset(cached)

    def _cached(self, site: Site) -> bool:
        sels = self.cache_selectors
        if sels is None:
            return self._reason(site) is None
        hit = False
        for i, sel in enumerate(sels):
            if sel(site):
                self.cache_matched.add(i)
                hit = True
        if hit:
            self._editable(site, "cache")
        return hit

    def _reason(self, site: Site) -> str | None:
        if site.kind == "get_attr":
            return "it is a parameter or buffer the graph reads, not a value it computes"
        if site.target is attention_probs and site.name not in self.prog.order:
            return ("the pattern beside SDPA is computed only where tap() selected it: "
                    "fxprobe.tap(model, ops=[..., fxprobe.attention_probs], tracer='dynamo')")
        return None

    def _editable(self, site: Site, what: str = "intervene on") -> None:
        why = self._reason(site)
        if why is not None:
            raise InterventionError(f"cannot {what} site {site.name!r} per call: {why}")

    def unmatched(self, sites: list[Site]) -> None:
        """Raise :class:`SelectorError` for a selector that matched no site found so far."""
        context = f"{self.model} (the sites torch dynamo captured so far)"
        for i, (sel, _, _) in enumerate(self.entries):
            if i not in self.matched:
                raise SelectorError(no_match_message(sel, sites, context))
        sels = self.cache_selectors
        if sels and not self.cache_matched:
            raise SelectorError(no_match_message(sels[0], sites, context))


def _literal(key: Any) -> str | None:
    """The one site name a plain string selector names (None: a glob or not a string)."""
    return key if isinstance(key, str) and not any(c in key for c in "*?[") else None


def _regions(life: Lifecycle) -> list[DynamoRegion]:
    return [r for path, r in life.program.dynamo.items()
            if life.state.get(path) is not State.FALLBACK]


def _start(tapped: TappedModule, fns: list[Entry],
           cache: list[Selector] | None | tuple[()]) -> Table:
    """A table composed with the thread's current one (whose functions run first)."""
    prog = tapped._lifecycle()
    regions = _regions(prog)
    if not regions:
        fallen = [repr(p) if p else "the model" for p in prog.reasons]
        why = (f"torch dynamo failed on {', '.join(fallen)}, which runs as written"
               if fallen else "torch.fx traced it whole")
        raise ConfigError(
            f"per-call interventions and run_with_cache reach the sites torch dynamo captures, "
            f"and {tapped._model_name} has none ({why}): tap it with "
            "fxprobe.tap(model, ..., tracer='dynamo')")
    outer = tapped._pipeline.per_call.table
    if isinstance(outer, Table):
        fns = [*outer.entries, *fns]
    table = Table(prog, fns, cache, tapped._model_name)
    dynamo = {n for r in regions for n in r.sites}
    pending = prog.hidden()  # a deferred module's hook sites, until dynamo has run it
    others = [s for s in prog.known_sites() if s.name not in dynamo and s.how != "dynamo"
              and s.name not in pending] if prog.program.compiled or prog.program.hooks else []
    for sel, _, _ in fns:
        hit = next((s for s in others if sel(s)), None)
        if hit is not None:
            raise ConfigError(
                f"selector {sel.description} matches site {hit.name!r}, which "
                f"{'a hook' if hit.how == 'hook' else 'torch.fx'} captures; per-call "
                "interventions reach the sites torch dynamo captures: tap the model with "
                "tracer='dynamo'")
    for region in regions:
        table.check(region)
    if all(r.finished for r in regions):  # every site is known: check the selectors now
        table.unmatched([s for r in regions for s in r.sites.values()])
    return table


class Intervention:
    """The context manager ``tapped.intervene(...)`` returns (see there)."""

    def __init__(self, tapped: TappedModule, fns: Mapping[Any, Fn]) -> None:
        if not isinstance(fns, Mapping) or not fns:
            raise ConfigError(
                "tapped.intervene() takes a non-empty dict {selector: fn}, fn(site, value) "
                f"returning a replacement or None; got {fns!r}")
        for key, fn in fns.items():
            if not callable(fn):
                raise ConfigError(f"the function for selector {key!r} is {fn!r}, not callable")
        self.tapped = tapped
        self.pairs = [(as_selector(k), fn, _literal(k)) for k, fn in fns.items()]
        self.table: Table | None = None
        self.outer: Any = None

    def __enter__(self) -> Table:
        if self.table is not None:
            raise ConfigError("this intervene() block is already entered; make a new one")
        per_call = self.tapped._pipeline.per_call
        table = _start(self.tapped, self.pairs, ())
        self.outer, self.table = per_call.table, table
        per_call.table = table
        return table

    def __exit__(self, kind: object, *exc: object) -> None:
        per_call = self.tapped._pipeline.per_call
        table, self.table = self.table, None
        if per_call.table is not table:
            per_call.table = self.outer
            raise ConfigError("intervene() blocks must be left in the reverse order they "
                              "were entered, on the thread that entered them")
        per_call.table = self.outer
        regions = _regions(table.prog) if kind is None and table is not None else []
        if table is not None and regions and all(r.finished for r in regions):
            for region in regions:  # sites found by a forward under another table (a cache)
                table.check(region)
            table.unmatched([s for r in regions for s in r.sites.values()])


def run_with_cache(tapped: TappedModule, args: tuple[Any, ...], kwargs: dict[str, Any],
                   names: Any) -> tuple[Any, Cache]:
    """One forward of ``tapped`` keeping the values of the sites ``names`` selects."""
    per_call = tapped._pipeline.per_call
    table = _start(tapped, [], as_selectors(names))
    outer = per_call.table  # inside an intervene block, its functions apply (see _start)
    per_call.table = table
    try:
        out = tapped(*args, **kwargs)
    finally:
        per_call.table = outer
    sites = {s.name: s for r in _regions(table.prog) for s in r.sites.values()}
    table.unmatched(list(sites.values()))
    values: dict[str, Any] = {}
    calls: dict[str, Any] = {}
    others: dict[str, str] = {}
    for name, value in table.values.items():
        if not _tensors(value):  # a call's None (set_grad_enabled), autocast's object, a size
            others[name] = type(value).__name__
        elif names is None and name in sites and sites[name].inlined:
            calls[name] = value  # a module call's value: another site's, listed once
        else:
            values[name] = value
    aliases = {c: n for n in [*values, *calls, *others] if n in sites
               for c in sites[n].canonical}
    return out, Cache(values, aliases, others, calls)


def _tensors(value: Any) -> bool:
    """Whether ``value`` is a tensor, or a tuple, list or dict holding tensors (and None)
    and nothing else."""
    if isinstance(value, torch.Tensor):
        return True
    if not isinstance(value, (tuple, list, dict)) or isinstance(value, torch.Size):
        return False
    items = [v for v in (value.values() if isinstance(value, dict) else value) if v is not None]
    return bool(items) and all(_tensors(v) for v in items)


class Cache(Mapping[str, Any]):
    """The values of one call's selected sites, by site name (or canonical name,
    ``blocks.0.resid_post``), in the order they ran (``tapped.run_with_cache``); detached,
    copied where a later in-place op overwrote them."""

    def __init__(self, values: dict[str, Any], aliases: Mapping[str, str] | None = None,
                 others: Mapping[str, str] | None = None,
                 calls: Mapping[str, Any] | None = None) -> None:
        self._values = values
        self._aliases = dict(aliases or {})
        self._others = dict(others or {})
        """The selected sites whose value was no tensor: the type of that value."""
        self._calls = dict(calls or {})
        """Cached without ``names=``: the values of module calls fx would keep whole
        (``transformer.h.0``), readable by name but not listed: each is another site's."""

    def __getitem__(self, name: str) -> Any:
        key = name if name in self._values else self._aliases.get(name, name)
        try:
            return self._values[key] if key in self._values else self._calls[key]
        except KeyError:
            if key in self._others:
                raise UnknownSiteError(
                    f"site {key!r} ran, but its value is a {self._others[key]}, not a tensor: "
                    "a cache keeps tensors (and tuples, lists and dicts of them) only"
                    ) from None
            hint = did_you_mean(name, [*self._values, *self._aliases])
            raise UnknownSiteError(
                f"{name!r} is not in this cache ({len(self._values)} site(s) that ran and "
                f"were selected by names=).{hint}") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        return f"Cache({len(self._values)} site(s): {', '.join(list(self._values)[:4])}...)"
