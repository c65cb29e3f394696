"""Per-call interventions and caching on a tapped module, without a new capture.

``with tapped.intervene({selector: fn}): tapped(...)`` and ``tapped.run_with_cache(...)`` set a
table for the calling thread (:class:`Table`, the ``CallTable`` that ``Pipeline.point``
reads). While one is set, every graph runs its second version, with an intervention point at
every site (``capture.points``): each fx region's (built once per mode, the first time a table
is set: ``runtime.build.compile_points``) and each graph torch dynamo captured (built once per
graph, from the graph dynamo already handed over); a module run as written applies the table
in its forward hook (``frontends.hooks``: installed for the sites a table reaches). One
mechanism, one order: the per-call functions, then ``fn=`` and the taps of ``tap()``, which
keep the value that flows on. Without a table the graphs run as ``tap()`` built them: one
check per graph (or hooked call) is all that a block costs outside.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch

from ..core.errors import (
    ConfigError,
    DynamoError,
    InterventionError,
    SelectorError,
    SiteNotRunError,
    UnknownSiteError,
)
from ..core.names import did_you_mean
from ..core.select import Selector, as_selector, as_selectors, no_match_message
from ..core.site import Site
from ..frontends.attention import attention_probs, attention_scores
from ..frontends.dynamo import DynamoRegion
from .lifecycle import Lifecycle, State
from .run import lifecycle, pointed
from .state import TapState

_serials = itertools.count(1)
"""Each table's ``serial``."""

Fn = Callable[[Site, Any], Any]
Entry = tuple[Selector, Fn, str | None]
"""A selector, its function and the site name it is (a plain string), if one."""


class Table:
    """One thread's per-call interventions (selectors and functions) and cache selectors,
    resolved against the sites each graph or hook reaches, as they are known (fx and hook
    sites when the table is made; dynamo's as their graphs are captured; a hooked module's
    later calls in a forward as they run).

    Args:
        life: the lifecycle of the tapped module's program (which sites are selected now).
        lives: the tapped module's lifecycles by mode (``TapState.lives``): the model may be
            traced again inside the block (a hook registered there), which replaces ``life``.
        fns: ``(selector, fn, name)`` entries, applied in this order where several match a site.
        cache: the selectors of the sites to keep (None: every site; ``()``: none).
        model: the model's name, for messages.
        pointed: the fx sites that have an intervention point (the others no graph computes).
        literals: the plain site names among the selectors (naming a site no point reaches
            is an error; a pattern matching one leaves it out).
    """

    def __init__(self, life: Lifecycle, fns: list[Entry],
                 cache: list[Selector] | None | tuple[()], model: str,
                 pointed: frozenset[str], literals: frozenset[str] = frozenset(),
                 lives: Mapping[bool, Lifecycle] | None = None) -> None:
        self.lives: Mapping[bool, Lifecycle] = lives if lives is not None else {}
        self.training = life.program.training
        self.serial = next(_serials)
        self.literals = literals
        self.entries = fns
        self.cache_selectors = cache
        self.model = model
        self.pointed = pointed
        self.fns: dict[str, tuple[Site, tuple[Fn, ...]]] = {}
        self.cache: frozenset[str] = frozenset()
        self.values: dict[str, Any] = {}
        self.replaced: set[str] = set()
        self.sites: dict[str, Site] = {}
        """Every site resolved so far, by name, in the order met."""
        self.known: dict[int, int] = {}
        self.outer: Table | None = None
        """The thread's table this one was composed with (told of the hooked calls met)."""
        self.matched: set[int] = set()
        self.cache_matched: set[int] = set()
        self.aliases: dict[str, str] = {}
        """The canonical names of the kept values, to their sites, as the graph that ran
        named them (:meth:`Pipeline.point`)."""
        self._here: dict[tuple[str, tuple[str, ...]], tuple[tuple[Fn, ...], bool]] = {}
        self.owners: dict[str, set[str]] = {}
        """The sites each canonical name names in some graph (one: the name is unambiguous)."""
        self.met = (life, life.fallen())
        """The lifecycle the forwards ran when the selectors last met the hook sites of its
        deferred modules running as written, and those modules."""
        self.completed: set[str] = set()
        """The deferred modules dynamo ran a call of to its end under a program traced away
        inside the block (:meth:`Lifecycle.ran_through`)."""

    @property
    def life(self) -> Lifecycle:
        """The lifecycle of the program the block's mode runs now: the one the table was made
        with until the model is traced again (then the new one; the last one a forward ran
        while none is built yet). Which modules fell past dynamo's limit, which regions
        finished and which sites are selected are that program's, not the one traced away."""
        return self.lives.get(self.training) or self.met[0]

    def refresh(self, life: Lifecycle, state: TapState) -> None:
        """Resolve the selectors against the hook sites of the deferred modules of ``life``
        (the lifecycle a forward runs: the model may have been traced again inside the block)
        that dynamo stopped capturing since (hidden until then, or known by the name dynamo
        gives the call), and install the hooks they reach: run as written, such a module
        would otherwise go unedited, its selector unmatched. The table this one was composed
        with meets them too (told of their later calls, :meth:`see`)."""
        if self.outer is not None:
            self.outer.refresh(life, state)
        if life.program.training != self.training:  # an outer block's, in the other mode
            return
        fallen = life.fallen()
        met, before = self.met
        if met is not life:
            self.completed |= met.completed
        new = fallen - before if met is life else fallen
        self.met = (life, fallen)  # one that left, falling again, is met again (its hooks
        if not new:  # were dropped as it left)
            return
        names = {n for p in new for n in life.program.deferred[p].sites}
        sites = [s for s in life.known_sites() if s.name in names and s.how == "hook"]
        self.resolve([s for s in sites if s.name not in self.sites
                      or self.sites[s.name].how != "hook"])
        _hook(state, self, sites)

    def check(self, region: DynamoRegion) -> None:
        """Resolve the selectors against ``region``'s sites if it found new ones since."""
        if self.known.get(id(region)) == len(region.sites):
            return
        self.known[id(region)] = len(region.sites)
        sites: Iterable[Site] = region.sites.values()
        names = [name for _, _, name in self.entries]
        if self.cache_selectors == () and all(n in region.sites for n in names):  # no scan
            sites = [region.sites[n] for n in dict.fromkeys(names) if n in region.sites]
        self.resolve(sites)

    def see(self, name: str, key: str) -> None:
        """A hooked module's call ``key`` (``fc_1``: the second call of ``fc`` in a forward,
        a site of its own, as under torch.fx and dynamo)."""
        if self.outer is not None:  # a cache inside a block: the block's selectors met it too
            self.outer.see(name, key)
        if key not in self.sites:
            base = self.sites.get(name)
            if base is not None:
                self.resolve([dataclasses.replace(base, name=key, canonical=())])

    def resolve(self, sites: Iterable[Site]) -> None:
        """Match the selectors against ``sites``: which functions apply, which values to keep.
        A site no point reaches (a parameter the graph reads) is an error where a plain name
        names it, and left out where a pattern or type matches it among others."""
        cached = set(self.cache)
        sels = self.cache_selectors
        for site in sites:
            self.sites[site.name] = site  # with the canonical names every graph gave it
            for c in site.canonical:
                self.owners.setdefault(c, set()).add(site.name)
            hits = [i for i, (sel, _, _) in enumerate(self.entries) if sel(site)]
            keeps = [] if sels is None else [i for i, sel in enumerate(sels) if sel(site)]
            why = self._reason(site)
            if why is not None:
                if (hits or keeps) and (site.name in self.literals
                                        or any(c in self.literals for c in site.canonical)):
                    what = "intervene on" if hits else "cache"
                    raise InterventionError(f"cannot {what} site {site.name!r} per call: {why}")
                continue
            if hits:
                self.matched.update(hits)
                self.fns[site.name] = (site, tuple(self.entries[i][1] for i in hits))
            if sels is None or keeps:
                self.cache_matched.update(keeps)
                cached.add(site.name)
        self.cache = frozenset(cached)

    def here(self, name: str, canonical: tuple[str, ...]) -> tuple[tuple[Fn, ...], bool]:
        """The functions that apply to site ``name``, and whether a cache keeps it, where a
        graph gives it the canonical names ``canonical`` (:meth:`Pipeline.point`; another
        graph may give them to another site: with a KV cache ``blocks.1.attn.v`` is the
        concatenated values, without one the layer's own)."""
        got = self._here.get((name, canonical))
        if got is None:
            site = dataclasses.replace(self.sites[name], canonical=canonical)
            sels = self.cache_selectors
            got = self._here[(name, canonical)] = (
                tuple(fn for sel, fn, _ in self.entries if sel(site)),
                sels is None or any(sel(site) for sel in sels))
        return got

    def _reason(self, site: Site) -> str | None:
        if site.kind == "get_attr":
            return "it is a parameter or buffer the graph reads, not a value it computes"
        if site.target is attention_probs and site.name not in self.life.order:
            return ("the pattern beside SDPA is computed only where tap() selected it: "
                    "fxprobe.tap(model, ops=[..., fxprobe.attention_probs], tracer='dynamo')")
        if site.target is attention_scores and site.name not in self.life.order:
            return ("the scores beside SDPA are computed only where tap() selected them: "
                    "fxprobe.tap(model, ops=[..., 'blocks.*.attn.scores'], tracer='dynamo')")
        if site.how == "fx" and site.name not in self.pointed:
            return "no graph of fxprobe's computes it (it is inside a module run as one call)"
        return None

    def unmatched(self) -> None:
        """Raise :class:`SelectorError` for a selector that matched no site known so far."""
        sites = list(self.sites.values())
        context = f"{self.model} (its sites, with those torch dynamo captured so far)"
        for i, (sel, _, _) in enumerate(self.entries):
            if i not in self.matched:
                raise self._no_match(sel, SelectorError(no_match_message(sel, sites, context)))
        sels = self.cache_selectors
        if sels and not self.cache_matched:
            raise self._no_match(sels[0],
                                 SelectorError(no_match_message(sels[0], sites, context)))

    def _no_match(self, sel: Selector, error: SelectorError) -> Exception:
        """``error``, or where ``sel`` matched sites of a module that dynamo stopped capturing
        past its recompile limit (it runs as written since, said once; or one that it stopped
        before any graph of it was known), a ``DynamoError`` that says so: the sites are gone
        because of the limit, not absent from the model. A name no graph of the module has,
        where one was captured (under this program, the other mode's, or one traced away
        inside the block), is ``error``: a misspelt name is not the limit's doing."""
        life = self.life
        gone = []
        for path, region in life.program.dynamo.items():
            if (life.state.get(path) is State.FALLBACK
                    and "recompile_limit" in life.reasons.get(path, "")):
                found = life.captured(path, self.sites)
                if (not life.ran_through(path, self)
                        or any(sel(site) for site in found.values())
                        or self._later_call(sel, path)):
                    gone.append(region.what)
        if not gone:
            return error
        fallen = DynamoError(
            f"torch dynamo stopped capturing {', '.join(gone)} past "
            "torch._dynamo.config.recompile_limit, so it runs as written, where only its "
            f"module calls are sites: {error} Raise the limit, or call "
            "torch._dynamo.reset() and tap again.")
        fallen.__cause__ = error
        return fallen

    def _later_call(self, sel: Selector, path: str) -> bool:
        """Whether ``sel`` names a later call (``fc_3``) of a hooked module inside the
        deferred module at ``path``: a site known once a forward runs it as written."""
        names = self.life.program.deferred[path].sites
        return any(sel(dataclasses.replace(site, name=f"{site.name}_{n}", canonical=()))
                   for site in self.sites.values() if site.name in names for n in range(1, 4))


def _literal(key: Any) -> str | None:
    """The one site name a plain string selector names (None: a glob or not a string)."""
    return key if isinstance(key, str) and not any(c in key for c in "*?[") else None


def _regions(life: Lifecycle) -> list[DynamoRegion]:
    return [r for path, r in life.program.dynamo.items()
            if life.state.get(path) is not State.FALLBACK]


def _start(state: TapState, fns: list[Entry], cache: list[Selector] | None | tuple[()],
           literals: frozenset[str] = frozenset()) -> Table:
    """A table composed with the thread's current one (whose functions run first), resolved
    against the sites known now; the hooks of the hooked sites it reaches installed."""
    life = lifecycle(state)
    points = pointed(state, life)
    outer = state.pipeline.per_call.table
    if isinstance(outer, Table):
        fns = [*outer.entries, *fns]
    literals = literals | {name for _, _, name in fns if name is not None}
    table = Table(life, fns, cache, state.model_name, points.names, literals, state.lives)
    table.outer = outer if isinstance(outer, Table) else None
    regions = _regions(life)
    dynamo = {n for r in regions for n in r.sites}
    hidden = life.hidden()  # a deferred module's hook sites, until dynamo has run it
    static = [s for s in life.known_sites() if s.how != "dynamo" and s.name not in dynamo
              and s.name not in hidden]
    table.resolve(static)
    hooked = _hook(state, table, static)
    for region in regions:
        table.check(region)
    if not hooked and all(r.finished for r in regions):  # every site is known: check now
        table.unmatched()  # (a hooked module's second call, fc_1, is known once it ran)
    return table


def _hook(state: TapState, table: Table, sites: Iterable[Site]) -> bool:
    """Install the hooks of the hooked ``sites`` that ``table`` reaches; whether any of
    ``sites`` is hooked."""
    hooked = False
    for site in sites:
        if site.how == "hook":
            hooked = True
            if _reaches(table, site):
                path = site.module_path or site.name
                module = state.root.get_submodule(path) if path else state.root
                state.hookset.ensure(site.name, module)
    return hooked


def _reaches(table: Table, site: Site) -> bool:
    """Whether ``table`` reaches the hooked module of ``site``: at its first call, or at a
    later one in a forward (``fc_1``; a call later than the fourth that only a pattern names
    is not hooked for it, and the block then says that its selector matched nothing)."""
    if site.name in table.fns or site.name in table.cache or table.cache_selectors is None:
        return True
    sels = [sel for sel, _, _ in table.entries] + list(table.cache_selectors)
    literal = re.compile(re.escape(site.name) + r"_\d+")
    return (any(name is not None and literal.fullmatch(name) for _, _, name in table.entries)
            or any(sel(dataclasses.replace(site, name=f"{site.name}_{n}", canonical=()))
                   for sel in sels for n in range(1, 4)))


class Intervention:
    """The context manager ``tapped.intervene(...)`` returns (see there)."""

    def __init__(self, state: TapState, fns: Mapping[Any, Fn]) -> None:
        if not isinstance(fns, Mapping) or not fns:
            raise ConfigError(
                "tapped.intervene() takes a non-empty dict {selector: fn}, fn(site, value) "
                f"returning a replacement or None; got {fns!r}")
        for key, fn in fns.items():
            if not callable(fn):
                raise ConfigError(f"the function for selector {key!r} is {fn!r}, not callable")
        self.state = state
        self.pairs = [(as_selector(k), fn, _literal(k)) for k, fn in fns.items()]
        self.table: Table | None = None
        self.outer: Any = None

    def __enter__(self) -> Table:
        if self.table is not None:
            raise ConfigError("this intervene() block is already entered; make a new one")
        per_call = self.state.pipeline.per_call
        table = _start(self.state, self.pairs, ())
        self.outer, self.table = per_call.table, table
        per_call.table = table
        return table

    def __exit__(self, kind: object, *exc: object) -> None:
        per_call = self.state.pipeline.per_call
        table, self.table = self.table, None
        if per_call.table is not table:
            per_call.table = self.outer
            raise ConfigError("intervene() blocks must be left in the reverse order they "
                              "were entered, on the thread that entered them")
        per_call.table = self.outer
        if kind is not None or table is None:
            return
        table.refresh(table.life, self.state)  # the program the forwards ran, as it stands
        regions = _regions(table.life)
        if all(r.finished for r in regions):
            for region in regions:  # sites found by a forward under another table (a cache)
                table.check(region)
            table.unmatched()


def run_with_cache(state: TapState, call: Callable[..., Any], args: tuple[Any, ...],
                   kwargs: dict[str, Any], names: Any) -> tuple[Any, Cache]:
    """One forward (``call``, the tapped module) keeping the values of the sites ``names``
    selects."""
    per_call = state.pipeline.per_call
    given = names if isinstance(names, (list, tuple, set, frozenset)) else [names]
    table = _start(state, [], as_selectors(names),
                   frozenset(n for n in given if _literal(n) is not None))
    outer = per_call.table  # inside an intervene block, its functions apply (see _start)
    per_call.table = table
    try:
        out = call(*args, **kwargs)
    finally:
        per_call.table = outer
    for region in _regions(table.life):
        table.check(region)
    table.unmatched()
    sites = table.sites
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
    aliases.update(table.aliases)  # as the graph that ran named them
    # Selected sites this call did not run (an encoder given its outputs, a branch not
    # taken): looked up, they say so; nothing of an earlier call stands in for them.
    ran = {*values, *calls, *others}
    absent = {n: n for n in table.cache if n not in ran}
    absent.update({c: n for n in list(absent) if n in sites for c in sites[n].canonical
                   if c not in aliases})
    return out, Cache(values, aliases, others, calls, absent)


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
                 calls: Mapping[str, Any] | None = None,
                 absent: Mapping[str, str] | None = None) -> None:
        self._values = values
        self._aliases = dict(aliases or {})
        self._others = dict(others or {})
        """The selected sites whose value was no tensor: the type of that value."""
        self._calls = dict(calls or {})
        """Cached without ``names=``: the values of module calls fx would keep whole
        (``transformer.h.0``), readable by name but not listed: each is another site's."""
        self._absent = dict(absent or {})
        """The selected sites that did not run in the call (and their canonical names), to
        their site names."""

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
            if name in self._absent:
                site = self._absent[name]
                asked = f" ({name!r})" if site != name else ""
                raise SiteNotRunError(
                    f"site {site!r}{asked} is selected by names= but did not run in this call "
                    "(a module the call did not reach, as an encoder given encoder_outputs, "
                    f"or a branch not taken); the cache holds the {len(self._values)} "
                    "selected site(s) that ran") from None
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
