"""The dynamo frontend: modules that torch.fx cannot trace, captured by torch dynamo.

A :class:`DynamoRegion` runs a module's own ``forward`` under ``torch.compile`` with fxprobe's
backend. Every graph dynamo captures (one per frame, per graph break, per recompilation) reaches
the backend as an fx graph; the backend attaches a :class:`~fxprobe.Site` to its nodes
(``node.meta["fxprobe_sites"]``, :mod:`frontends.dynamo_names`), selects sites, inserts the taps
with the same pass as the fx frontend (:func:`fxprobe.capture.rewrite.insert_taps`, which calls the
shared :class:`~capture.pipeline.Pipeline`) and returns a plain function that runs the result
eagerly (no inductor)::

    frame -> dynamo -> fx graph -> name_graph -> insert_taps -> compile_region -> run eagerly
                                                                     |
                                           kept values -> Pipeline.store (one frame/forward)

Sites are discovered at the first call with real inputs; code between graphs (graph breaks) runs
as written. With inlined ``nn.Module`` calls (always, from torch 2.5), one graph compiled for a
frame of ``layers[0]`` may be reused for ``layers[1]``: each instrumented graph is therefore
keyed by the identity of a parameter it receives, and a new instance gets its own names.
"""

from __future__ import annotations

import dataclasses
import warnings
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import fx, nn

from ..capture.pipeline import Pipeline
from ..capture.points import insert_points
from ..capture.rewrite import Compiled, compile_region, copy_graph, insert_taps
from ..core.errors import DynamoError
from ..core.names import join, one_line, some
from ..core.options import Capture, CopyPolicy
from ..core.site import Site, attach
from ..core.view import CapturedGraph, DynamoInfo
from . import dynamo_inline as inline
from . import sharding
from .attention import attention_probs, attention_scores, beside, drive_output
from .canonical import annotate
from .dynamo_blocks import Blocks, block_inputs, inner_names
from .dynamo_blocks_cache import KVBlocks, marks
from .dynamo_kv import made_cache
from .dynamo_names import (
    INPUT,
    NamedGraph,
    StableNamer,
    name_graph,
    positional,
)
from .dynamo_quiet import quiet_compile, side_effects_logged
from .dynamo_rearm import forward_codes, rearm
from .dynamo_shapes import batch_of_one, cached, call_frame, static_inputs, symbolic_batch
from .dynamo_versions import Instrumented, _Captured
from .mirror import has_patched_forward
from .wrappers import offloaded, weights_loaded


def dynamo_failed(e: BaseException) -> bool:
    """Whether ``e`` is torch dynamo's failure (or fxprobe's backend's), not the model's."""
    return isinstance(e, (torch._dynamo.exc.TorchDynamoException, DynamoError))


def _known(old: Site | None, site: Site) -> Site:
    """``site`` as the region lists it, met again in another graph: with the canonical names
    an earlier graph gave it (a graph the canonical pass does not recognise, as a generation
    step's, names none; the site keeps ``logits`` for the selectors checked later)."""
    if old is None or set(old.canonical) <= set(site.canonical):
        return site
    return dataclasses.replace(site, canonical=tuple(dict.fromkeys((*site.canonical,
                                                                    *old.canonical))))


class DynamoRegion:
    """A module run under torch dynamo with fxprobe's backend (see the module docstring)."""

    def __init__(self, path: str, module: nn.Module, *, pipeline: Pipeline,
                 capture: Capture, copy: CopyPolicy,
                 is_leaf: Callable[[nn.Module, str], bool],
                 choose: Callable[[Sequence[Site]], list[Site]],
                 on_sites: Callable[[list[Site], list[Site]], None] | None = None) -> None:
        self.path = path
        self.module = module
        self.pipeline = pipeline
        self.capture = capture
        self.copy = copy
        self.is_leaf = is_leaf
        self.choose = choose
        self.on_sites = on_sites
        """Called as ``on_sites(new, selected)`` for each graph named: the sites not seen
        before and those the graph selects. Whoever runs the region may set it (the runtime's
        ``Lifecycle``, which is made after the program that holds the region)."""
        self.namer = StableNamer()
        # Every name of each parameter (tied weights have several).
        self.param_names: dict[int, list[str]] = {}
        self._index_parameters()
        self.module_ids = {id(m): n for n, m in module.named_modules(remove_duplicate=False)}
        self.state = [*module.parameters(), *module.buffers()]
        self.sites: dict[str, Site] = {}
        self.modules: set[str] = set()
        """The paths of the modules whose code ran in a captured graph."""
        self.pointable: set[str] = set()
        """The sites that have an intervention point in a graph built so far."""
        self.captured: list[_Captured] = []
        self.graphs = 0
        self.calls = 0
        self.runs = 0
        self.steps = 0
        """Instrumented graphs run so far (each counted once per forward)."""
        self.last_runs = 0
        self.finished = False
        """Whether the last call ran to its end (an edit that raised leaves the sites after
        it unknown, in this call and in the module's later calls): only then are all the
        sites of the code it runs known."""
        # The forward the model runs: a wrapper replaced on the instance (run on the copy,
        # frontends/wrappers.py) is traced through, as dynamo traces it inside a region.
        patched = module.__dict__.get("forward") if has_patched_forward(module) else None
        self._forward = (type(module).forward if patched is None
                         else lambda _module, *a, **k: patched(*a, **k))
        self.arg_names = positional(self._forward)
        """The forward's positional parameters (none for a replaced forward): its inputs are sites
        by these names."""
        self.made_cache = made_cache(module, self._forward)
        """The key/value cache the model would make for a call, made before dynamo traces it
        (``dynamo_kv``), where the model's code says it makes one."""
        self._compiled: Callable[..., Any] | None = None
        self._run: Callable[..., Any] | None = None
        self.static: list[tuple[str, tuple[int, ...]]] = []
        """The inputs of the forward (and their dims) that dynamo kept static at the first
        capture: a new size there is captured again (``dynamo_shapes``)."""
        self.warned_unplaced: set[tuple[str, int]] = set()  # (file, line): _unplaced
        self.offloaded = offloaded(module)
        """accelerate's offloaded modules (``device_map=``, ``cpu_offload``), loaded per run."""
        found = inline.repeated_blocks(module) if inline.enabled() else []
        self.blocks = inline.marks(found)
        self.hooked = inline.HookCheck(self.blocks)
        """The layers dynamo traces once per call without a cache (``dynamo_inline``)."""
        # One list of blocks of one class is shared: blocks of two classes (FSMT's encoder
        # and decoder layers), in two lists (T5's encoder and decoder stacks of T5Block,
        # whose canonical names say which stack) or beside another list (an encoder-decoder
        # with a one-layer stack) are marked instead.
        self.shared = Blocks(found, self.backend, self.module_ids) if inline.shared() and \
            inline.shareable(module, found) else None
        """The same layers captured once for every instance (``dynamo_blocks``)."""
        self.shared_kv = KVBlocks(self.shared, self.backend, self.module_ids) if \
            self.shared is not None else None  # and called with a KV cache
        """The shared layers for a call with a key/value cache (``dynamo_blocks_cache``)."""
        for shared in (self.shared, self.shared_kv):
            if shared is not None:  # a batch of one a symbol in the blocks' graphs too
                shared.symbolic = symbolic_batch
        self.bare: weakref.WeakKeyDictionary[fx.GraphModule, Compiled] = \
            weakref.WeakKeyDictionary()  # each captured graph untapped (_untapped)
        self.inlined = (0, 0)  # block calls inlined so far, and the bodies dynamo traced
        self.marking: list[tuple[nn.Module, Any]] = []  # the blocks marked in this call

    @property
    def in_block_capture(self) -> bool:
        """Whether dynamo is capturing a shared block's own code now (``dynamo_versions``)."""
        return any(b is not None and b.capturing for b in (self.shared, self.shared_kv))

    @property
    def what(self) -> str:
        """``GPT2Model ('transformer')``, for messages."""
        return type(self.module).__name__ + (f" ({self.path!r})" if self.path else "")

    def versions(self) -> list[int]:
        """The version counters of the module's parameters and buffers: a change shows an
        in-place write by the forward (see ``runtime.lifecycle.Lifecycle.run``)."""
        return [t._version for t in self.state]

    def instrumented(self) -> dict[str, Instrumented]:
        """Every instrumented graph so far, by key (``tapped.graphs``):
        ``"dynamo:<region path>:<graph number>"``, the graphs numbered from 0 in the order
        dynamo captured them, then ``"@<module path>"`` for a graph dynamo reuses for another
        instance of the module it was captured for (``layers.1`` running ``layers.0``'s graph).
        """
        return {key: version for key, _, _, version in self._versions()}

    def _versions(self) -> list[tuple[str, int, _Captured, Instrumented]]:
        out = []
        for i, captured in enumerate(self.captured):
            for version in captured.named_for.values():
                key = f"dynamo:{self.path}:{i}"
                if version.prefix != captured.captured_prefix:
                    key += f"@{join(self.path, version.prefix)}"
                if version.repeat:
                    key += f"#{version.repeat}"
                out.append((key, i, captured, version))
        return out

    def drawn(self) -> list[CapturedGraph]:
        """Every named graph so far (see :meth:`instrumented`), for the pictures."""
        out = []
        for key, number, captured, version in self._versions():
            if version.repeat:
                continue
            instance = join(self.path, version.prefix)
            out.append(CapturedGraph(
                key, self.path, number, captured.frame, instance, version.named, version.ran,
                called_by=instance if captured.block else "",
                inputs=block_inputs(version.named) if captured.block else {}))
        return out

    @property
    def info(self) -> DynamoInfo:
        return DynamoInfo(self.path, self.graphs, max(self.last_runs - 1, 0), len(self.sites))

    def backend(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        """The torch.compile backend: each captured graph is tapped and runs eagerly."""
        self.graphs += 1
        calls, bodies = inline.inline_calls(gm, self.module_ids, self.module, example_inputs)
        inline.drop_dead_sizes(gm, bool(self.marking))
        self.inlined = (self.inlined[0] + calls, self.inlined[1] + bodies)
        captured = _Captured(self, gm, example_inputs)  # marks the forward's inputs
        if self.graphs == 1:
            self.static = static_inputs(gm, INPUT, {n for t in self.state for n in t.shape})
        version = captured.version(example_inputs)
        if captured.unplaced is not None and not captured.block:
            self._unplaced(captured.unplaced, version)
        self.captured.append(captured)
        return captured

    def _unplaced(self, where: tuple[str, int], version: Instrumented) -> None:
        """Say, once per code location, that a graph's sites are named with no module path."""
        if where in self.warned_unplaced or not version.sites:
            return
        self.warned_unplaced.add(where)
        warnings.warn(
            f"fxprobe: torch dynamo captured the code at {Path(where[0]).name}:{where[1]} "
            f"in {self.what} as a graph of its own (a graph break split the call around it: "
            "a function the model calls with a module as an argument, or a module class it "
            "holds several of), and fxprobe cannot tell which module it ran for: its "
            f"{len(version.sites)} site(s) ({some(sorted(version.sites))}) are named with no "
            "module path and have no canonical names. A glob over module paths does not "
            "reach them. Avoid the graph break (tapped.dynamo_info counts them; transformers "
            "breaks the graph where "
            "it warns through `logger.warning_once`, e.g. sdpa attention called with "
            "output_attentions=True), or use tracer='hooks'.", stacklevel=2)

    def _index_parameters(self) -> None:
        self.param_names = {}
        for name, p in self.module.named_parameters(remove_duplicate=False):
            self.param_names.setdefault(id(p), []).append(name)

    def owners(self, p: torch.Tensor) -> list[str]:
        """The names of parameter ``p`` in the region's module. Looked up again when ``p`` is
        not what is registered under them: FSDP2 (``fully_shard``) registers an unsharded
        parameter for the duration of a forward in place of the sharded one, which the names
        read at ``tap()`` knew; every block would otherwise look like the first one."""
        names = self.param_names.get(id(p))
        if names is None or not self._registered(names[0], p):
            self._index_parameters()
            names = self.param_names.get(id(p))
        return names or []

    def _registered(self, name: str, p: torch.Tensor) -> bool:
        try:
            return self.module.get_parameter(name) is p
        except AttributeError:
            return False

    def instrument(self, gm: fx.GraphModule, captured_prefix: str, prefix: str,
                   repeat: int = 0, drawn: fx.Graph | None = None) -> Instrumented:
        """Name the graph's nodes for the module instance at ``prefix`` (for its run
        ``repeat`` in one forward, from 0) and insert its taps, each selected site behind an
        intervention point (``capture.points``). Given ``drawn``, the named graph of the version
        built for ``tap()`` (which the pictures draw), every site gets a point: the version a
        per-call block on an unselected site runs, whose named graph is that one."""
        points = drawn is not None
        graph = copy_graph(gm.graph)
        named: NamedGraph = name_graph(
            graph, root=self.module, root_path=self.path, module_ids=self.module_ids,
            captured_prefix=captured_prefix, frame_prefix=prefix,
            is_leaf=self.is_leaf, namer=self.namer, probs_fn=attention_probs, repeat=repeat)
        named = annotate(graph, named, root=self.module, root_path=self.path,
                         namer=self.namer, repeat=repeat)
        named = inner_names(self.shared, prefix, graph, named)
        named = sharding.mark(graph, named, self.pipeline.options.gather)  # Site.sharding
        self.modules |= named.modules
        new = [s for s in named.order if s.name not in self.sites]
        self.sites.update((s.name, _known(self.sites.get(s.name), s)) for s in named.order)
        selected = self.choose(named.order)
        chosen = {s.name for s in selected}
        for node, probs in [*named.scores.items(), *named.sdpa.items()]:
            if probs.name not in chosen:
                continue  # computed only where selected: the model keeps its fused attention
            edits = self.pipeline.fn is not None or points  # an edit must reach the output
            attach(drive_output(graph, node, probs) if edits else beside(graph, node, probs),
                   probs)
        if self.on_sites is not None:
            self.on_sites(new, selected)
        if not chosen and not points and not self.pipeline.options.gather:
            # Nothing to tap or point here (a layer whose only selected site is its output,
            # named in the graph around it; a layer outside the selection): every instance
            # runs one untapped function of the captured graph, compiled once.
            return Instrumented(dataclasses.replace(self._untapped(gm), graph=graph), prefix,
                                graph, repeat, frozenset(), frozenset(s.name for s in named.order))
        if self.pipeline.options.gather:  # the full values of sharded sites (tap(gather=True))
            sharding.gather(graph, {s.name for s in named.order} if points else chosen)
        named_graph = drawn if drawn is not None else copy_graph(graph)

        def beside_sdpa(s: Site) -> bool:
            return s.target in (attention_probs, attention_scores)

        if points:  # not beside SDPA where not computed (a pattern not selected at tap())
            pointed = insert_points(graph, gm.get_submodule, self.pipeline,
                                    lambda s: beside_sdpa(s) and s.name not in chosen)
        elif chosen:  # a point at each selected site: a per-call block on them needs no
            # graph of its own. Not beside SDPA (the pattern, the scores): an edit there must
            # drive the attention's output, which would then no longer be the fused kernel's.
            pointed = insert_points(graph, gm.get_submodule, self.pipeline,
                                    lambda s: s.name not in chosen or beside_sdpa(s))
        else:
            pointed = frozenset()
        self.pointable |= pointed
        # A captured graph returns to dynamo's bytecode (the code between graph breaks, or
        # the caller), which fxprobe does not see and which may write into what it returns.
        order, copied, outplaced = insert_taps(
            graph, gm.get_submodule, chosen, capture=self.capture, copy=self.copy,
            pipeline=self.pipeline, escapes=True)
        return Instrumented(compile_region(self.path, gm, graph, order, copied, outplaced),
                             prefix, named_graph, repeat, pointed,
                             frozenset(s.name for s in named.order))

    def _untapped(self, gm: fx.GraphModule) -> Compiled:
        """The captured graph as it is (no site kept), as one function for every instance."""
        found = self.bare.get(gm)
        if found is None:
            graph = copy_graph(gm.graph)
            order, copied, outplaced = insert_taps(
                graph, gm.get_submodule, set(), capture=self.capture, copy=self.copy,
                pipeline=self.pipeline, escapes=True)
            found = self.bare[gm] = compile_region(self.path, gm, graph, order, copied,
                                                   outplaced)
        return found

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.finished = False  # until this call ends: an error inside leaves sites unseen
        try:
            result = self._call(*args, **kwargs)
        except Exception as e:
            if not dynamo_failed(e) and self._run is not None:  # the model's own error:
                # dynamo skips for good a frame that raised while it traced it
                rearm([self._run.__code__, *forward_codes(self.module), *(
                    b.run_block.__code__ for b in (self.shared, self.shared_kv)
                    if b is not None)])
            raise
        self.finished = True
        return result

    def _call(self, *args: Any, **kwargs: Any) -> Any:
        compiled = self._compiled
        if compiled is None:
            own_forward = self._forward

            def run(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
                # Not the forward itself: a decorated forward (transformers' wrappers) as the
                # top frame is split at its first call; called from here it is inlined.
                return own_forward(module, *args, **kwargs)

            # A code object of its own: dynamo caches graphs (and counts recompilations
            # against recompile_limit) per code object, and this one is per region.
            run.__code__ = run.__code__.replace(co_name=f"fxprobe_{type(self.module).__name__}")
            self._run = run
            # Sizes are symbols from the first call: a new length or batch reuses the graphs.
            compiled = self._compiled = torch.compile(run, backend=self.backend, dynamic=True)
        self.calls += 1
        before = self.runs
        if torch.compiler.is_compiling():  # an outer torch.compile traces this call
            result = compiled(self.module, *args, **kwargs)
        else:
            # A frame past recompile_limit runs as written, its sites silently not captured:
            # the resume frame after a graph break too, while the graphs before it ran.
            # Dynamo raises instead, and the caller falls back (runs the module as written).
            if self.made_cache is not None:
                args, kwargs = self.made_cache.call(args, kwargs)
            config = torch._dynamo.config  # its settings are thread-local
            hard, policy = config.fail_on_recompile_limit_hit, config.side_effect_replay_policy
            config.fail_on_recompile_limit_hit = True
            if policy == "info" and not side_effects_logged():
                # Dynamo keeps the stack of each write into an object it replays (every
                # layer's cache entry) for a log message: ~5 ms a layer, for no reader.
                config.side_effect_replay_policy = "silent"
            try:
                # accelerate's offloaded weights are loaded for the whole region (wrappers.py).
                with weights_loaded(self.offloaded), batch_of_one(
                        (args, kwargs), lambda: self.calls > 1 and self._cached(args, kwargs)):
                    self.marking = [] if self.hooked() else marks(self, kwargs)
                    result = inline.run_marked(  # 1st call: dynamo's pages of messages made one
                        self.marking, lambda: self._first(*args, **kwargs) if self.calls == 1
                        else compiled(self.module, *args, **kwargs),
                        lambda: self.runs != before, self._unmark)
            except torch._dynamo.exc.FailOnRecompileLimitHit as e:
                raise DynamoError(self._limit_hit(
                    "a frame of it (the code after a graph break, or the forward) past "
                    "torch._dynamo.config.recompile_limit would run as written, its sites not "
                    "captured")) from e
            finally:
                config.fail_on_recompile_limit_hit = hard
                config.side_effect_replay_policy = policy
        self.last_runs = ran = self.runs - before
        if ran == 0:
            raise DynamoError(self._limit_hit(
                "it ran without any of fxprobe's graphs, so nothing could be tapped: it hit "
                "torch._dynamo.config.recompile_limit or skipped the frame (as it does inside "
                "an outer torch.compile, which traces through it)"))
        return result

    def _first(self, *args: Any, **kwargs: Any) -> Any:
        """The first call, with dynamic shapes; where dynamo cannot capture the module with
        symbolic sizes at all (before any graph), once more with static ones, said once."""
        try:
            with quiet_compile(self.what, lambda: self.graphs):
                result = self._compiled(self.module, *args, **kwargs)  # type: ignore[misc]
        except Exception as e:
            if not dynamo_failed(e) or self.graphs or self.marking or isinstance(
                    e, torch._dynamo.exc.FailOnRecompileLimitHit):  # marked: run_marked
                raise
            self._compiled = torch.compile(self._run, backend=self.backend, dynamic=False)
            with quiet_compile(self.what, lambda: self.graphs):
                result = self._compiled(self.module, *args, **kwargs)
            warnings.warn(
                f"fxprobe: torch dynamo could not capture {self.what} with dynamic shapes "
                f"({one_line(getattr(e, 'inner_exception', None) or e)}); it is captured "
                "with static shapes instead, so each new sequence length or batch size is "
                "captured again (values stay right).", stacklevel=5)
            return result
        if self.static:
            fixed = ", ".join(f"{name!r} (dim {', '.join(map(str, dims))})"
                              for name, dims in self.static)
            warnings.warn(
                f"fxprobe: torch dynamo kept these input sizes of {self.what} static: "
                f"{fixed}; the model's code needs them exactly (a view with a literal shape, "
                "a branch on a length), so a new size there is captured again (values stay "
                "right); every other size is dynamic.", stacklevel=5)
        return result

    def _cached(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """Whether a graph dynamo compiled serves this call (``dynamo_shapes.cached``)."""
        run = self._run
        assert run is not None
        return cached(run, call_frame(run, self.module, args, kwargs))

    def _unmark(self) -> None:
        self.blocks, self.marking, self.shared, self.shared_kv = [], [], None, None

    def _limit_hit(self, what: str) -> str:
        return (f"torch dynamo on {type(self.module).__name__}"
                f"{f' ({self.path})' if self.path else ''}: {what}. The limit is now "
                f"{torch._dynamo.config.recompile_limit}: raise it, call "
                "torch._dynamo.reset(), or use tracer='hooks'.")
