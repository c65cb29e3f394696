"""The tap pipeline: what happens to a value at a tapped site, written once for every frontend.

At the point where a site's value is produced — by a node that the rewrite inserted into a
traced graph, or by a forward hook — :meth:`Pipeline.output` runs, in this order:

1. ``fn=`` may replace the value for every downstream consumer (*intervene*);
2. the gradient of the value that flows on is watched, on the autograd node that produced it,
   so that a later in-place op cannot move the hook to another node (*grad*);
3. what is kept is made: a reduction (``reduce=``) or, where a later in-place op would overwrite
   it, a copy (*keep*).

Once per traced region and forward (once per hook call), :meth:`Pipeline.store` puts the kept
values into the current thread's frame, detached and, with ``to=``, offloaded. A site whose
options need none of steps 1-3 costs no call at all: the rewrite hands its value straight to
``store`` in the tuple the region returns.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from ..core.errors import InterventionError
from ..core.options import TapOptions
from ..core.record import Frame, InOut, Recording
from ..core.site import Site
from .inplace import OUT_OF_PLACE
from .stats.cpu import NUMPY_MAX as _CPU_SMALL
from .stats.cpu import batched_max, host_reads_free
from .stats.math import _SMALL, _check, checked_vectors, cpu_table, stats_vector
from .stats.pending import PendingStats, resolve_stats


def map_tensors(fn: Callable[[torch.Tensor], Any], value: Any) -> Any:
    """``fn`` applied to every tensor in ``value`` (a tensor, or a nest of tuples/lists/dicts)."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    return tree_map(lambda v: fn(v) if isinstance(v, torch.Tensor) else v, value)


def clone_tree(value: Any) -> Any:
    """A copy of every tensor in ``value``; anything else as it is."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    return map_tensors(torch.Tensor.clone, value)


def detach_tree(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach()
    return map_tensors(torch.Tensor.detach, value)


class CallTable(Protocol):
    """One call's per-call interventions and cache (``runtime.intervene`` makes them):
    what :meth:`Pipeline.point` reads at every intervention point."""

    fns: dict[str, tuple[Site, tuple[Callable[[Site, Any], Any], ...]]]
    """The sites to intervene on: their site and the functions to apply, in order."""
    cache: frozenset[str]
    """The sites whose values this call keeps (``run_with_cache``)."""
    sites: dict[str, Site]
    """Every site resolved so far, by name (with the canonical names every graph gave it)."""
    aliases: dict[str, str]
    """Canonical names of the kept values to their sites, as the graph that ran named them."""
    owners: dict[str, set[str]]
    """The sites each canonical name names in some graph."""
    values: dict[str, Any]
    """The kept values, by site name, in the order the sites ran."""
    replaced: set[str]
    """The sites whose value a function replaced in this call."""
    training: bool
    """The mode the table was made in (whose graphs with points it was resolved against)."""
    serial: int
    """A number no other table of the process has (what a graph remembers it by)."""

    def check(self, region: Any) -> None:
        """Resolve the selectors against ``region``'s sites if it found new ones."""

    def refresh(self, life: Any, state: Any) -> None:
        """Before a forward that the lifecycle ``life`` runs (``runtime.run``; the model may
        have been traced again since the table was made), and as the block is left: resolve
        the selectors against the sites that became known since without a graph reporting
        them (the hook sites of a deferred module dynamo stopped capturing), and install the
        hooks they reach (``state``: the tapped module's)."""

    def see(self, name: str, key: str) -> None:
        """A hooked module's call, named ``key`` (``name``, then ``name_1`` in one forward):
        resolve the selectors against its site if not yet."""

    def here(self, name: str, canonical: tuple[str, ...]
             ) -> tuple[tuple[Callable[[Site, Any], Any], ...], bool]:
        """The functions for site ``name``, and whether its value is kept, in a graph where
        it has the canonical names ``canonical`` (another graph of the same code may give
        them to another site: with a KV cache, ``attn.v`` is the concatenated values)."""


class _PerCall(threading.local):
    """The calling thread's :class:`CallTable` (None: no ``intervene`` block, no cache)."""

    def __init__(self) -> None:
        self.table: CallTable | None = None


class Pipeline:
    """The options of one tapped module, applied to values at sites (see the module docstring).

    Args:
        options: the validated options.
        recording: where kept values go.
        site: the :class:`Site` of a name (for ``fn`` and ``grad_fn``, which receive it).
    """

    def __init__(self, options: TapOptions, recording: Recording,
                 site: Callable[[str], Site | None]) -> None:
        self.options = options
        self.rec = recording
        self.site = site
        self.reduce = self._stats_of if options.reduce == "stats" else _reducer(options)
        """What ``keep`` does instead of keeping the value (None: keep it, copied if at risk)."""
        self.fn = options.fn
        self.wants_grads = options.wants_grads
        self.input_grads = options.grad and options.capture == "both"
        """Whether gradients of the inputs are kept too (``grads[name]`` an ``InOut``)."""
        self.arity: dict[str, int] = {}
        """Positional inputs of each such site (the length of its ``grads[name].inputs``)."""
        self.finalize = resolve_stats if options.reduce == "stats" else None
        self.per_call = _PerCall()
        """This thread's per-call table: graphs run with intervention points while it is set."""

    @property
    def per_site(self) -> bool:
        """Whether a value needs a call where it is produced (not only a copy)."""
        return self.fn is not None or self.wants_grads or self.reduce is not None

    # -- where the value is produced ---------------------------------------------------------
    def output(self, name: str, value: Any, copy: bool) -> tuple[Any, Any]:
        """Steps 1-3 for a site's output: ``(value that flows on, value to keep)``."""
        flow = value
        if self.fn is not None:
            flow = self._intervene(name, value)
        if self.wants_grads:
            flow = self._watch(name, flow)
        return flow, self.keep(flow, copy)

    def inputs(self, args: tuple[Any, ...], copy: bool) -> tuple[Any, ...]:
        """Step 3 for a site's inputs (positional arguments)."""
        return tuple(self.keep(a, copy) for a in args)

    def keep(self, value: Any, copy: bool) -> Any:
        if self.reduce is not None:
            return self.reduce(value, copy)
        return clone_tree(value) if copy else value

    def _stats_of(self, value: Any, copy: bool) -> Any:
        if isinstance(value, torch.Tensor):  # the common case, without a closure
            return self._stats(value, copy)
        return map_tensors(lambda t: self._stats(t, copy), value)

    def _stats(self, t: torch.Tensor, copy: bool) -> PendingStats:
        """Statistics of ``t``: now for a large tensor; for a small one, at the end of the
        forward, together with the forward's other small tensors (a few launches for all)."""
        n = t.numel()
        if n > _SMALL or torch.compiler.is_compiling() or (
                n > _CPU_SMALL and n > batched_max() and host_reads_free(t)):  # CPU: see there
            return PendingStats(t, stats_vector(t))
        _check(t)  # here, at its site, as stats_vector would for a large one
        pending = PendingStats(t, None, t.detach().clone() if copy else t.detach())
        state = self.rec.state
        if state.active:
            state.frame.deferred.append(pending)
        return pending

    def finish(self, frame: Frame) -> None:
        """End of a forward: reduce the small tensors whose statistics were deferred. On a
        CPU the rows stay one float64 numpy table until read (this runs in every forward, just
        after the model has evicted fxprobe's code and data from the caches: each step counts)."""
        deferred, frame.deferred = frame.deferred, []
        by_device: dict[torch.device, list[PendingStats]] = {}
        for p in deferred:
            if p.tensor is not None:
                by_device.setdefault(p.tensor.device, []).append(p)
        for group in by_device.values():
            tensors: list[torch.Tensor] = [p.tensor for p in group]  # type: ignore[misc]
            if host_reads_free(tensors[0]):
                table = cpu_table(tensors)
                for i, p in enumerate(group):
                    p.table, p.index, p.tensor = table, i, None
                continue
            rows = checked_vectors(tensors)
            for p, row in zip(group, rows.unbind(0), strict=True):
                p.vector, p.tensor = row, None

    def _intervene(self, name: str, value: Any) -> Any:
        assert self.fn is not None
        site = self.site(name)
        new = self.fn(site, value)
        if new is None or new is value:
            return value
        _check_replacement("fn", name, value, new)
        state = self.rec.state
        if state.active:
            state.frame.replaced.add(name)
        return new

    def point(self, value: Any, names: tuple[str, ...], risky: bool, writes: bool,
              canonical: tuple[tuple[str, ...], ...] | None = None,
              given: tuple[str, ...] = ()) -> Any:
        """An intervention point (``capture.points``): the per-call step at a node whose
        sites are ``names``, with the canonical names ``canonical`` in this graph (None: a
        hooked call's, as the table lists its site); ``given``: every canonical name this
        graph gives. A name another graph gave the site, and only it, that this one gives no
        node still names it (the canonical pass recognises only part of some graphs: a
        generation prefill's ``logits``); one that names several sites (``attn.v``, with and
        without a cache) names here only what this graph gives it to: a graph break between
        two of them must not edit both. Each function of the calling thread's
        table for a name may replace the value (``fn(site, value)``, a replacement or None,
        as ``fn=``); what flows on is kept for the cache (copied where a later in-place op
        would overwrite it, ``risky``). ``writes``: the node wrote its first argument in
        place, which the code after it reads, so a replacement is written there too."""
        table = self.per_call.table
        if table is None:  # a graph with points runs only under a table; a thread without
            return value
        flow = value
        kept: list[str] | None = None
        for i, name in enumerate(names):
            hit = table.fns.get(name)
            keep = name in table.cache
            if canonical is not None and (hit is not None or keep):
                listed = table.sites[name].canonical
                own = canonical[i]
                if listed != own:
                    own = (*own, *(c for c in listed if c not in own and c not in given
                                   and len(table.owners.get(c, ())) == 1))
                if listed != own:  # named otherwise in this graph
                    fns, here = table.here(name, own)
                    hit = (hit[0], fns) if hit is not None and fns else None
                    keep = keep and here
            if keep:
                kept = [name] if kept is None else [*kept, name]
            if hit is not None:
                site, fns = hit
                for fn in fns:
                    new = fn(site, flow)
                    if new is not None and new is not flow:
                        _check_replacement("intervene", name, flow, new)
                        flow = new
                        table.replaced.add(name)
                        state = self.rec.state
                        if state.active:
                            state.frame.replaced.add(name)
        if kept:  # every name of the node reads what flows on, after all its edits: a
            # block's output (an op's and its module's) is what the next reads
            value_kept = detach_tree(clone_tree(flow) if risky else flow)
            for i, name in enumerate(names):
                if name in kept:
                    table.values[name] = value_kept
                    if canonical is not None:
                        table.aliases.update(dict.fromkeys(canonical[i], name))
        if writes and flow is not value:
            write_back(value, flow)
        return flow

    def _watch(self, name: str, value: Any) -> Any:
        """Hook the gradient of ``value``; return what flows on in its place."""
        if not (isinstance(value, torch.Tensor) and value.requires_grad):
            return value
        frame = self.rec.state.frame
        if value.grad_fn is None:
            # A leaf (a parameter, an input): a hook on it would outlive this forward and fire
            # in every later backward through it, the user's own included. An alias made here
            # carries this forward's uses, and the hook goes on its node.
            value = value.view_as(value)
        grad_fn = value.grad_fn
        # The producing node, not the tensor: a later in-place op (ReLU(inplace=True)) rebases
        # the tensor onto its own node, and a tensor hook would see the gradient there.
        index = value.output_nr

        def prehook(grad_outputs: tuple[torch.Tensor | None, ...]) -> Any:
            g = grad_outputs[index]
            if g is None:
                return None
            new = self._on_grad(frame, name, g)
            if new is None:
                return None
            out = list(grad_outputs)
            out[index] = new
            return tuple(out)

        grad_fn.register_prehook(prehook)
        return value

    def watch_input(self, name: str, index: int, value: Any) -> Any:
        """``capture="both", grad=True``: an alias of the ``index``-th positional input of
        ``name``'s call, for that call to read instead, whose gradient is what the call sends
        back into it (``grad_input`` of a full backward hook: this call's share only)."""
        if not (isinstance(value, torch.Tensor) and value.requires_grad):
            return value
        frame = self.rec.state.frame
        alias = value.view_as(value)

        def prehook(grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
            if grad_outputs[0] is not None:
                self._put_grad(frame, name, index, grad_outputs[0].detach())

        assert alias.grad_fn is not None  # a view of a tensor that requires grad
        alias.grad_fn.register_prehook(prehook)
        return alias

    def _put_grad(self, frame: Frame, name: str, index: int | None, g: torch.Tensor) -> None:
        """Keep ``g`` in ``grads[name]``: an ``InOut`` whose ``inputs[index]`` (output: None)
        it is."""
        grads: dict[str, Any] = frame.grads
        old = grads.get(name)
        if not isinstance(old, InOut):
            old = InOut((None,) * self.arity.get(name, 0), None)
        if index is None:
            grads[name] = old._replace(output=g)
        else:
            inputs = list(old.inputs) + [None] * (index + 1 - len(old.inputs))
            inputs[index] = g
            grads[name] = old._replace(inputs=tuple(inputs))

    def _on_grad(self, frame: Frame, name: str, g: torch.Tensor) -> torch.Tensor | None:
        if self.input_grads:
            self._put_grad(frame, name, None, g.detach())
        elif self.options.grad:
            frame.grads[name] = g.detach()
        grad_fn = self.options.grad_fn
        if grad_fn is None:
            return None
        new = grad_fn(self.site(name), g)
        if new is None:
            return None
        _check_replacement("grad_fn", name, g, new)
        return new  # type: ignore[no-any-return]

    # -- once per region and forward ---------------------------------------------------------
    def store(self, names: tuple[str, ...], values: tuple[Any, ...],
              aliases: dict[str, str] | None = None) -> None:
        """Put one region's kept values into this thread's frame (detached, offloaded);
        ``aliases``: the canonical names the graph that ran gave them, to their sites."""
        state = self.rec.state
        if not state.active:
            return
        if aliases:
            state.frame.aliases.update(aliases)
        if self.options.to is not None:
            values = self.rec.offload(state.frame, names, values)
        if torch.compiler.is_compiling() and _replayed(values) and cudagraphs_in_use():
            values = _copy_after_graph(values)
        if state.detach_now:
            values = tuple(
                v.detach() if isinstance(v, torch.Tensor) else detach_tree(v) for v in values)
        state.frame.parts.append((names, values))


# Returns its first argument or a replacement, and writes no argument (the in-place analysis);
# a replacement written back (``writes``) is the in-place op's own write, made again.
setattr(Pipeline.point, OUT_OF_PLACE, True)


CUDAGRAPH_DEVICES = frozenset({"cuda"})
"""Devices whose tensors CUDA graphs replay (``tests/test_compile.py`` adds the CPU while it
emulates a CUDA-graph replay there)."""


def _replayed(values: tuple[Any, ...]) -> bool:
    """Whether a kept value lives where a CUDA graph would replay it (metadata only)."""
    for leaf in tree_flatten(values)[0]:
        t = leaf.vector if isinstance(leaf, PendingStats) else leaf
        if isinstance(t, torch.Tensor) and t.device.type in CUDAGRAPH_DEVICES:
            return True
    return False


def cudagraphs_in_use() -> bool:
    """Whether the graph dynamo is tracing will run as CUDA graphs (``mode="reduce-overhead"``
    or ``"max-autotune"``, ``options={"triton.cudagraphs": True}``, ``backend="cudagraphs"``,
    or inductor's global setting). Dynamo runs this at trace time and bakes in the answer.
    Where it cannot tell (torch's internals moved), it says True: a copy too many is slower,
    a kept value that the next replay overwrites is wrong."""
    global _copy_after_graph
    _copy_after_graph = torch._dynamo.disable(_copied_after_graph)
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator
        from torch._inductor import config

        backend: Any = InstructionTranslator.current_tx().output.compiler_fn
        inductor = False
        for _ in range(8):  # the wrappers around the backend the user named
            if backend is None:
                break
            options = getattr(backend, "config", None)
            if isinstance(options, dict) and options.get("triton.cudagraphs"):
                return True
            name = getattr(backend, "compiler_name", None)
            if name == "cudagraphs":
                return True
            inductor = inductor or name == "inductor"
            backend = getattr(backend, "compiler_fn", None)
        return inductor and bool(config.triton.cudagraphs)
    except Exception:
        return True


# torch._dynamo.assume_constant_result spelled out: dynamo runs a function so marked at trace
# time and bakes in its result (importing dynamo here would add it to every `import fxprobe`).
cudagraphs_in_use._dynamo_marked_constant = True  # type: ignore[attr-defined]


def _copied_after_graph(values: tuple[Any, ...]) -> tuple[Any, ...]:
    """Copies of the kept values, made after the compiled graph ran: dynamo does not trace
    :data:`_copy_after_graph` (a graph break), which :func:`cudagraphs_in_use` makes when
    dynamo runs it, dynamo then being imported. A CUDA-graph replay writes every output of
    the graph into the same static memory, so a value kept from one forward (the last one
    read later, the ``keep=N`` history) would show the next forward's values; a copy inside
    the graph would be one more such output."""

    def copy(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor):
            return leaf.clone()
        if isinstance(leaf, PendingStats) and leaf.vector is not None:
            leaf.vector = leaf.vector.clone()
        return leaf

    leaves, spec = tree_flatten(values)
    return tuple(tree_unflatten([copy(v) for v in leaves], spec))


_copy_after_graph: Callable[[tuple[Any, ...]], tuple[Any, ...]] = _copied_after_graph
"""The copy ``store`` calls; dynamo-disabled by :func:`cudagraphs_in_use` at trace time."""


def write_back(value: Any, flow: Any) -> None:
    """A replaced value that an in-place op made (``x.relu_()``, ``nn.ReLU(inplace=True)``):
    the code after it reads the tensor the op wrote, often not the op's result, so the
    replacement is written into that tensor too (else it would reach only the result)."""
    if flow is value or not (isinstance(value, torch.Tensor) and isinstance(flow, torch.Tensor)):
        return
    if (flow.data_ptr() == value.data_ptr() and flow.shape == value.shape
            and flow.stride() == value.stride() and flow.dtype == value.dtype):
        return  # a view of the same elements (value.view_as(value)): nothing to write
    value.copy_(flow)


def _reducer(options: TapOptions) -> Callable[[Any, bool], Any] | None:
    """``reduce="sample"`` or a user's reduction: new memory, which no later op overwrites, so
    the copy flag does not matter."""
    if options.reduce == "sample":
        from .stats.sampling import sample_vector

        k, seed = options.sample_size, options.seed
        return lambda value, copy: map_tensors(lambda t: sample_vector(t, k, seed), value)
    if callable(options.reduce):
        user = options.reduce
        return lambda value, copy: map_tensors(user, value)
    return None


def _check_replacement(what: str, name: str, old: Any, new: Any) -> None:
    if isinstance(old, torch.Tensor):
        if not isinstance(new, torch.Tensor):
            raise InterventionError(
                f"{what} returned {type(new).__name__} for site {name!r}; return a tensor "
                f"shaped {tuple(old.shape)} ({old.dtype}), or None to keep the value"
            )
        if new.shape != old.shape or new.dtype != old.dtype or new.device != old.device:
            raise InterventionError(
                f"{what} returned a tensor of shape {tuple(new.shape)}, {new.dtype} on "
                f"{new.device} for site {name!r}, which produced {tuple(old.shape)}, "
                f"{old.dtype} on {old.device}; return a tensor like the original "
                "(e.g. value * mask or torch.zeros_like(value))"
            )
    elif type(new) is not type(old):
        raise InterventionError(
            f"{what} returned {type(new).__name__} for site {name!r}, which produced "
            f"{type(old).__name__}; return the same kind of value, or None"
        )
