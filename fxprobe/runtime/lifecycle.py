"""What changes while a program runs: the ``tracer="auto"`` lifecycle and the sites dynamo finds.

:func:`~.program.build_program` returns a fixed :class:`~.program.Program`. Running it may
still learn two things, and they live here, in one :class:`Lifecycle` per program:

- **the state of each deferred module** (``tracer="auto"``: a module fx could not trace, that
  torch dynamo gets a try at), one of :class:`State`::

      PENDING --first call--> DYNAMO --dynamo failed, parameters and buffers untouched--> FALLBACK
         ^                      |                                                          |
         +--the model's own error at the first call (as written too, after a fallback)-----+
      PENDING or DYNAMO --an outer torch.compile traces the tapped module--> FALLBACK

  In ``PENDING`` the module is a fallback like any other (its hook sites and inner regions are
  known before the first forward); in ``DYNAMO`` its dynamo sites replace those; in
  ``FALLBACK`` it runs as written, with its hooks, and ``fallbacks`` gives dynamo's reason;
- **the sites dynamo regions select** as they capture graphs (the first forward, a branch
  taken later), which join the program's selection, and the selectors still to check against
  them once the first forward ran.

Installing what a state needs (hooks and region dispatchers exactly while a deferred module runs
as written, since dynamo would trace them) is the tapped module's part: it is told of every move.
"""

from __future__ import annotations

import dataclasses
import enum
import re
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import torch

from ..core.errors import DynamoError, FxProbeError, SelectorError
from ..core.names import one_line, some
from ..core.record import Frame, Recording
from ..core.select import Selector, no_match_message, select
from ..core.site import Site
from ..core.view import CapturedGraph, DynamoInfo, Fallback, Plan
from ..frontends.dynamo import DynamoRegion, dynamo_failed
from .program import Program, SiteNames

_TRACED_THROUGH = (
    "DynamoError: an outer torch.compile traces through this module (torch dynamo does not "
    "run a compiled region of its own inside another one); it runs as written, with hooks")


@torch.compiler.disable
def fall_back_all(life: Lifecycle) -> None:
    """:meth:`Lifecycle.traced_through`, run eagerly: called from a forward that an outer
    ``torch.compile`` traces, it makes a graph break, so that the hooks it installs are in
    place before the trace goes on (a hook registered inside the trace would be missed by the
    module calls of that same trace)."""
    life.traced_through()


class State(enum.StrEnum):
    """Where a deferred module stands (see the module docstring)."""

    PENDING = "pending"
    """Before its first call (or after a first call that raised the model's own error): a
    fallback, its hook sites and inner regions known; nothing of it is installed."""
    DYNAMO = "dynamo"
    """Torch dynamo runs it: its dynamo sites replace the fallback's."""
    FALLBACK = "fallback"
    """Dynamo failed on it: it runs as written, its hooks and inner regions installed."""


MOVES: frozenset[tuple[State, State]] = frozenset({
    (State.PENDING, State.DYNAMO),  # the first call: dynamo's try
    (State.DYNAMO, State.PENDING),  # the first call raised the model's own error
    (State.DYNAMO, State.FALLBACK),  # dynamo failed (at any call), the module state untouched
    (State.FALLBACK, State.PENDING),  # the first call failed as written too
    (State.PENDING, State.FALLBACK),  # an outer torch.compile traces the tapped module
})
"""The transitions a deferred module makes, (from, to)."""


class Lifecycle:
    """Everything of one program that running it changes (see the module docstring).

    Args:
        program: the fixed program.
        rec: the tapped module's recording (a failed dynamo attempt's values are dropped from
            its frame; the hook names recorded now follow the states).
        on_move: called as ``on_move(self, path, state)`` after a deferred module moved, to
            install (or drop) what runs inside it.
        lives: the programs of the tapped module's modes (this one's included), by mode: the
            sites dynamo found in a module in the other mode are sites only dynamo reaches in
            this one too (:meth:`_refuse_lost_edits`).
    """

    def __init__(self, program: Program, rec: Recording,
                 on_move: Callable[[Lifecycle, str, State], None],
                 lives: Mapping[bool, Lifecycle] | None = None) -> None:
        self.program = program
        self.rec = rec
        self.on_move = on_move
        self.lives = lives if lives is not None else {}  # the modes' own, even while empty
        self.state: dict[str, State] = {path: State.PENDING for path in program.deferred}
        self.reasons: dict[str, str] = {}
        """Why dynamo failed on a deferred module, by path."""
        self.found: dict[str, tuple[str, Site]] = {}
        """The sites dynamo regions selected, by name: the region's path and the site, in the
        order found."""
        self.unchecked: list[Selector] | None = (
            list(program.selectors) if program.selectors else None)
        """The selectors to check once the first forward found the dynamo regions' sites."""
        self.selected: tuple[Site, ...] = program.selected
        """The selected sites as they stand now, in execution order."""
        self.order: dict[str, int] = {}
        self.aliases: dict[str, str] = {}
        """The canonical names of the selected sites (``blocks.3.resid_post``), to their names."""
        self.hook_names: frozenset[str] = frozenset()
        """The hooked sites that record now (not those inside a module dynamo runs)."""
        self.waiting = False
        """Whether a deferred module does not run as written yet (see :meth:`traced_through`)."""
        self.called: set[str] = set()
        """The deferred modules dynamo ran a call of in the forward running now."""
        self.completed: set[str] = set()
        """The deferred modules dynamo ran (every call of them) in a forward that ran to its
        end: the sites of such a forward's calls are all known (:meth:`ran_through`)."""
        for path, region in program.dynamo.items():
            region.on_sites = self._on_sites(path)
        self._refresh()

    # -- transitions ------------------------------------------------------------------------
    def run(self, path: str, own: Callable[..., Any], args: tuple[Any, ...],
            kwargs: dict[str, Any]) -> Any:
        """Call the deferred module at ``path``: under dynamo unless dynamo failed on it; if
        dynamo fails now, run it as written (``own``) with its hook fallback instead."""
        region = self.program.dynamo[path]
        state = self.state[path]
        if state is State.FALLBACK:
            table = region.pipeline.per_call.table
            if table is not None:
                self._refuse_lost_edits(path, table)
            return own(*args, **kwargs)
        if state is State.PENDING:
            self._move(path, State.DYNAMO)
        versions = region.versions()
        frame = self.rec.frame
        stored = len(frame.parts)
        try:
            out = region(*args, **kwargs)
            self.called.add(path)
            return out
        except Exception as e:
            if not dynamo_failed(e):
                if state is State.PENDING:  # the model's own error: dynamo may still work
                    self._move(path, State.PENDING)
                raise
            if region.versions() != versions:
                raise DynamoError(
                    f"torch dynamo failed on {region.what} "
                    f"({one_line(getattr(e, 'inner_exception', None) or e)}) after the "
                    "forward had written the module's parameters or buffers in place, so it "
                    "cannot be run again as written without writing them twice. Use "
                    "tracer='hooks' for this model, or tracer='fx+dynamo' to see dynamo's "
                    "error."
                ) from e
            # dynamo's own one-line summary of a backend failure names no cause
            reason = one_line(getattr(e, "inner_exception", None) or e)
        # Nothing the failed attempt kept stays: the module runs again, as written.
        del frame.parts[stored:]
        frame._cache = None
        _count_calls(region, frame)
        before = self.selected
        self._move(path, State.FALLBACK, reason)
        if state is State.DYNAMO or "recompile_limit" in reason:  # not dynamo's inability:
            self._warn_fallen(path, region.what, reason, before, state is State.DYNAMO)
        if region.pipeline.per_call.table is not None:
            # The block's edits and caches reach dynamo's sites only: run as written, the
            # module would silently go unedited (or uncached).
            raise DynamoError(
                f"torch dynamo failed on {region.what} during a per-call run ({reason}): "
                "its edits and cache reach the sites dynamo captures, so this forward is not "
                "run as written without them. The module runs as written from now on; "
                "raise torch._dynamo.config.recompile_limit or call torch._dynamo.reset() "
                "and tap again to edit it per call.")
        try:
            return own(*args, **kwargs)
        except Exception:
            if state is State.PENDING:  # fails as written too: not dynamo's failure
                self._move(path, State.PENDING)
            raise

    def _refuse_lost_edits(self, path: str, table: Any) -> None:
        """Raise where the per-call ``table`` edits sites of the module at ``path`` that only
        dynamo's graphs reached (resolved to them, or a selector matching them): run as
        written, the module would silently go unedited there (a block entered before dynamo
        stopped capturing it, or one made since)."""
        region = self.program.dynamo[path]
        covers = self.program.deferred[path].sites
        hooked = re.compile("|".join(re.escape(k) + r"(_\d+)?" for k in covers) or "(?!)")
        found = self.captured(path, table.sites)
        lost = [n for n, s in found.items() if not hooked.fullmatch(n)
                and (n in table.fns or any(sel(s) for sel, _, _ in table.entries))]
        # A plain name inside the module that no site met: no graph of it was captured here
        # (another tap of the model used up the limit), and no hooked call is named so.
        if lost:
            raise DynamoError(
                f"{region.what} runs as written since torch dynamo stopped capturing it "
                f"({self.reasons.get(path, 'failed')}), and this block edits {some(lost, 5)}, "
                "which only dynamo's graphs reached: the forward is not run without the "
                "edit. Edit the module's calls instead (its hook sites), or raise "
                "torch._dynamo.config.recompile_limit / call torch._dynamo.reset() and tap "
                "again.")
        # A plain name inside the module that no site met: misspelt where a graph of the
        # module is known (it is none of its sites); else unknown (no graph of it was
        # captured here: another tap of the model used up the limit), and no hooked call.
        unmet = [(sel, n) for i, (sel, _, n) in enumerate(table.entries) if n is not None
                 and path and i not in table.matched and n.startswith(path + ".")
                 and not hooked.fullmatch(n)]
        if unmet:
            known = found if self.ran_through(path, table) else {}
            raise _unmet(region.what, self.reasons.get(path, "failed"), unmet, known, table,
                         sorted(covers))

    def ran(self) -> None:
        """A forward ran to its end: the modules dynamo ran in it, and runs still, complete."""
        self.completed |= {p for p in self.called if self.state[p] is State.DYNAMO}
        self.called.clear()

    def ran_through(self, path: str, table: Any) -> bool:
        """Whether dynamo ran the module at ``path`` in a whole forward (:meth:`ran`), of either
        mode, or of a program traced away inside ``table``'s block: a name no site there has
        is then misspelt, not one of graphs dynamo stopped before capturing."""
        return (any(path in life.completed for life in self.lives.values())
                or path in self.completed or path in table.completed)

    def captured(self, path: str, sites: Mapping[str, Site]) -> dict[str, Site]:
        """The sites of the deferred module at ``path`` that dynamo's graphs have: this
        program's, the other mode's (same code), and those of ``sites`` (a per-call table's)
        resolved there under a program traced away since (a hook registered in the block)."""
        found = {n: s for life in self.lives.values() if path in life.program.dynamo
                 for n, s in life.program.dynamo[path].sites.items()}
        found.update({n: s for n, s in sites.items() if s.how == "dynamo" and (
            not path or s.module_path == path or s.module_path.startswith(path + "."))})
        found.update(self.program.dynamo[path].sites)
        return found

    def _warn_fallen(self, path: str, what: str, reason: str,
                     before: Sequence[Site], earlier: bool) -> None:
        """Say, once per module (it stays a fallback), that dynamo failed on a module it had
        run at earlier calls (or could have run, but for its recompile limit: the code of a
        module shares its compiled entries with every tap of that model in the process), and
        what is captured there from now on."""
        now = {s.name for s in self.selected}
        covers = self.program.deferred[path].sites
        kept = [s.name for s in self.selected if s.name in covers]
        repeats = re.compile("|".join(re.escape(k) + r"_\d+" for k in kept) or "(?!)")
        lost = [s.name for s in before if s.name not in now and not repeats.fullmatch(s.name)]
        warnings.warn(
            f"fxprobe: torch dynamo failed on {what} "
            + ("at a later call" if earlier else "at its first call") + f" ({reason})"
            + (", after it had captured it at earlier calls" if earlier else
               ", its code having been compiled for earlier taps of this model in the process "
               "(torch._dynamo.reset() clears that)")
            + "; it runs as written from now on, its values "
            "captured at the level of module calls (hooks)"
            + (f": {some(kept, 5)}" if kept else "")
            + (f". No longer captured: {some(lost, 5)} (inside it, where no hook reaches)"
               if lost else "")
            + ". tracer='hooks' captures at the level of module calls from the start.",
            stacklevel=2)

    def traced_through(self) -> None:
        """An outer ``torch.compile`` traces the tapped module: it traces through the dynamo
        regions too (dynamo does not nest), so every deferred module runs as written from now
        on. Called before the trace reaches them, outside it (:func:`fall_back_all`), so that
        the trace sees the hooks installed inside them."""
        for path, state in list(self.state.items()):
            if state is not State.FALLBACK:
                self._move(path, State.FALLBACK, _TRACED_THROUGH)

    def _move(self, path: str, to: State, reason: str = "") -> None:
        """Move the deferred module at ``path`` to ``to``; its installation follows."""
        now = self.state[path]
        if (now, to) not in MOVES:
            raise RuntimeError(f"fxprobe: a deferred module cannot go from {now} to {to}")
        self.state[path] = to
        if reason:
            self.reasons[path] = reason
        self._refresh()
        self.on_move(self, path, to)
        rec = self.rec.state
        if rec.active:
            rec.hook_paths = self.hook_names

    def _on_sites(self, path: str) -> Callable[[list[Site], list[Site]], None]:
        """The callback of the dynamo region at ``path``: the sites it selected join."""

        def on_sites(new: list[Site], chosen: list[Site]) -> None:
            fresh = [s for s in chosen if s.name not in self.found]
            if fresh:
                self.found.update((s.name, (path, s)) for s in fresh)
                self._refresh()

        return on_sites

    def check(self, model_name: str) -> None:
        """After a forward: the selectors, against every site found so far (``select``'s
        rules: a union may leave a type or function unmatched); checked once."""
        mode = "train" if self.program.training else "eval"
        try:
            select(self.known_sites(), self.unchecked, fallbacks=self.fallbacks,
                   context=f"{model_name} ({mode} mode; sites found by the first forward: "
                   "dynamo captures graphs as the model runs; a module call that a graph "
                   "break splits, or that returns several values, is no site under dynamo: "
                   "select the ops inside it, or use tracer='hooks')")
        except SelectorError as e:
            limited = [self.program.dynamo[p].what for p, why in self.reasons.items()
                       if "recompile_limit" in why and self.state[p] is State.FALLBACK]
            if not limited:
                raise
            # Not the model's lack of that site: dynamo stopped before its first forward ran
            # to its end (earlier calls that raised, other taps, dtypes used up the limit).
            raise DynamoError(
                f"the selectors of tap() are checked at the first forward that runs to its "
                f"end, and torch dynamo had stopped capturing {', '.join(limited)} before it "
                "(past torch._dynamo.config.recompile_limit: calls that raised, earlier taps "
                "of this model and other dtypes count too), so it ran as written, where "
                f"this fails: {e} Raise the limit, or call torch._dynamo.reset() and tap "
                "again.") from e
        self.unchecked = None

    # -- what stands now --------------------------------------------------------------------
    def _refresh(self) -> None:
        """Recompute ``selected``, ``order`` and ``hook_names`` from the states and the sites
        dynamo selected."""
        seen: set[str] = set()
        selected = []
        for s in self._current(self.program.selected, in_place=True):
            if s.name not in seen:
                seen.add(s.name)
                selected.append(s)
        for path, s in self.found.values():
            if self.state.get(path) is not State.FALLBACK and s.name not in seen:
                seen.add(s.name)
                selected.append(s)
        self.selected = tuple(selected)
        self.order = {s.name: i for i, s in enumerate(selected)}
        self.aliases = {c: s.name for s in selected for c in s.canonical}
        self.waiting = any(s is not State.FALLBACK for s in self.state.values())
        hidden = self.hidden()
        self.hook_names = frozenset(h.name for h in self.program.hooks if h.name not in hidden)

    def _in(self, state: State) -> list[str]:
        return [path for path, s in self.state.items() if s is state]

    def fallen(self) -> frozenset[str]:
        """The deferred modules that run as written (dynamo stopped capturing them)."""
        return frozenset(self._in(State.FALLBACK))

    def hidden(self) -> frozenset[str]:
        """Site names of fallbacks that dynamo runs instead (or will, before the first call)."""
        deferred = self.program.deferred
        return frozenset(n for path, s in self.state.items() if s is not State.FALLBACK
                         for n in deferred[path].sites)

    def _current(self, sites: Sequence[Site], in_place: bool = False) -> list[Site]:
        """``sites`` as they stand now: a fallback's site inside a module dynamo runs is gone
        once dynamo ran its module's code (dynamo's own sites replace it), and a dynamo site
        not run yet before that (a branch not taken: dynamo names a module call by its path,
        as the hook did). With ``in_place``, dynamo's site of the same name takes its place."""
        deferred = self.program.deferred
        captured = {n for path in self._in(State.DYNAMO) for n in deferred[path].sites}
        if not captured:
            return list(sites)
        reached = {m for region in self.program.dynamo.values() for m in region.modules}
        out = []
        for s in sites:
            found = self.found.get(s.name) if in_place and s.name in captured else None
            if s.name not in captured:
                out.append(s)
            elif found is not None:
                out.append(found[1])
            elif (s.module_path not in reached and s.name not in reached
                  and s.kind not in ("placeholder", "get_attr")):
                out.append(dataclasses.replace(s, how="dynamo"))
        return out

    def active(self, path: str) -> bool:
        """Whether the hooks and regions at ``path`` run: not inside a module dynamo runs."""
        deferred = self.program.deferred
        return not any(deferred[p].covers(path) for p, s in self.state.items()
                       if s is not State.FALLBACK)

    @property
    def fallbacks(self) -> tuple[Fallback, ...]:
        """The modules that run as written now (a deferred one once dynamo failed on it,
        with dynamo's reason)."""
        deferred = self.program.deferred
        gone = {f for path in self._in(State.DYNAMO) for f in deferred[path].fallbacks}
        out = []
        for f in self.program.plan.fallbacks:
            if f in gone:
                continue
            reason = self.reasons.get(f.path)
            if reason is not None and f.path in deferred and f is deferred[f.path].fallback:
                f = dataclasses.replace(f, error=f"{f.error}; torch dynamo failed too: {reason}")
            out.append(f)
        return tuple(out)

    def known_sites(self) -> list[Site]:
        """Every site known now: the plan's (see :meth:`_current`), then the sites dynamo
        found so far."""
        found = self._current(self.program.plan.sites)
        for path, region in self.program.dynamo.items():
            if self.state.get(path) is not State.FALLBACK:
                found.extend(region.sites.values())
        return found

    def site_names(self) -> SiteNames:
        """:meth:`known_sites` with the modules that run as written (``fxprobe.sites``)."""
        return SiteNames(self.known_sites(), self.fallbacks)

    def current_plan(self) -> Plan:
        """The plan as the pictures draw it now: without the fallbacks dynamo replaced (the
        modules dynamo runs are drawn as one call each)."""
        plan, deferred = self.program.plan, self.program.deferred
        if not deferred:
            return plan
        captured = self._in(State.DYNAMO)
        gone = {r for path in captured for r in deferred[path].regions}
        names = {n for path in captured for n in deferred[path].sites}
        return dataclasses.replace(
            plan, fallbacks=list(self.fallbacks),
            sites=[s for s in plan.sites if s.name not in names],
            regions={k: r for k, r in plan.regions.items() if k not in gone})

    def site(self, name: str) -> Site | None:
        """The selected site of ``name`` (``name_1``, a hooked module's second call: its site)."""
        i = self.order.get(self.aliases.get(name, name))
        if i is None:
            base, sep, n = name.rpartition("_")
            i = self.order.get(base) if sep and n.isdigit() else None
        return self.selected[i] if i is not None else None

    def dynamo_info(self) -> tuple[DynamoInfo, ...]:
        """What each dynamo region captured so far (``tapped.dynamo_info``)."""
        return tuple(region.info for region in self.program.dynamo.values())

    def dynamo_graphs(self) -> dict[str, Any]:
        """The instrumented graphs of the regions dynamo runs (not those it failed on), by
        key (``tapped.graphs``)."""
        return {key: version for path, region in self.program.dynamo.items()
                if self.state.get(path) is not State.FALLBACK
                for key, version in region.instrumented().items()}

    def kept_safe(self, how: Literal["copied", "outplaced"]) -> frozenset[str]:
        """The traced sites kept safe from a later in-place op by a copy (``"copied"``) or by
        running that op out of place (``"outplaced"``), in dynamo's graphs too."""
        return frozenset([n for c in self.program.compiled.values() for n in getattr(c, how)]
                         + [n for v in self.dynamo_graphs().values() for n in getattr(v, how)])

    def graphs(self) -> tuple[CapturedGraph, ...]:
        """The graphs dynamo captured so far in the modules it runs, for the pictures."""
        return tuple(g for path, region in self.program.dynamo.items()
                     if self.state.get(path) is not State.FALLBACK for g in region.drawn())


def _unmet(what: str, reason: str, unmet: list[tuple[Selector, str]],
           found: Mapping[str, Site], table: Any, calls: list[str]) -> FxProbeError:
    """The refusal of a forward of the fallen module ``what`` whose block names ``unmet``
    inside it, which no site met: a misspelt name's ``SelectorError`` where the graphs of a
    whole call are known (``found``), else a ``DynamoError`` saying it is unknown whether
    the names are sites (``calls``: the module's hook sites, which are)."""
    if found:
        sel, _ = unmet[0]
        return SelectorError(
            f"{what} runs as written since torch dynamo stopped capturing it, and the block's "
            + no_match_message(sel, [*found.values(), *table.sites.values()],
                               f"{table.model} (its sites, with those torch dynamo captured "
                               "so far)"))
    plain = [n for _, n in unmet]
    return DynamoError(
        f"{what} runs as written since torch dynamo stopped capturing it ({reason}) before "
        f"it captured any graph of it for this tap, and this block names {some(plain, 5)} "
        "inside it, which no site met: an op that only dynamo's graphs would reach, or a "
        "misspelt name. The forward is not run with the name unmatched. Check the name, name "
        f"the module's calls instead (its hook sites: {some(calls, 5)}, and their later calls "
        "in a forward, _1, _2 ...), or raise "
        "torch._dynamo.config.recompile_limit / call torch._dynamo.reset() and tap again.")


def _count_calls(region: DynamoRegion, frame: Frame) -> None:
    """Count the module calls ``region`` captured earlier in this forward as the hooks' calls:
    a module that falls back at its second call in a forward runs its hooks after calls whose
    values dynamo kept, so the hooks name theirs after them (``fc_2``, not ``fc`` again)."""
    calls = frame.hook_calls
    for names, _ in frame.parts:
        for name in names:
            site = region.sites.get(name)
            if site is not None and site.kind == "call_module" and site.module_path:
                calls[site.module_path] = calls.get(site.module_path, 0) + 1
