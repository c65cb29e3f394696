"""Tensor parallelism in a graph dynamo captured: which part of the full value each site holds.

A tensor-parallel model (transformers' ``tp_plan="auto"``, ``torch.distributed.tensor.parallel``
plans) computes on each rank a part of some values. The graph shows where the parts come from:
a ``DTensor`` (its ``example_value`` says its placements: ``Shard(d)``, ``Replicate()``, a
partial sum) and ``to_local()`` of one (this rank's part as a plain tensor). :func:`mark`
follows the parts through the ops that move them without mixing ranks (a linear layer whose
weight is split by output features; views, transposes, head splits and merges; elementwise
ops; attention over split heads; slices and concatenations along other dimensions; the
collectives that make a value whole) and puts a :class:`~fxprobe.core.shard.Sharding` on each
site whose value is a part::

    weight (DTensor, Shard(0)) -> to_local -> linear(x, w)  [dim -1] -> view [dim 2]
        -> transpose(1, 2) [dim 1: attn.q, 2 of 4 heads] -> sdpa [dim 1] -> ... -> linear(z, w
        Shard(1)) [partial sum] -> all_reduce -> wait -> copy_  [whole]

A site computed from a part by an op it cannot follow gets ``Sharding(understood=False)`` and
one warning naming its module: its value is this rank's, and fxprobe does not say more.

With ``gather=True``, :func:`gather` rewrites the graph so that each such site's value is the
full one and an edit of it flows on as this rank's part::

    before:  node -> next
    after:   node -> whole(node) [the sites] -> part(whole, node) -> next
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as tdist
from torch import fx, nn

from ..core.shard import Sharding
from ..core.site import SITES, Site, sites_of
from .dynamo_names import NamedGraph

try:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import Partial, Replicate, Shard
except ImportError:  # torch built without distributed
    DTensor = None  # type: ignore[assignment,misc]


class ShardingWarning(UserWarning):
    """A value computed from a tensor-parallel part by ops fxprobe cannot follow."""


@dataclasses.dataclass(frozen=True)
class _Part:
    """What a node's value is of the full one: split along ``dim``, a partial sum, or
    unknown (``dim`` None, not partial)."""

    dim: int | None
    partial: bool
    mesh: Any
    dtensor: bool = False

    @property
    def known(self) -> bool:
        return self.dim is not None or self.partial


UNKNOWN_OPS_NOTE = "ops fxprobe cannot follow"

ELEMENTWISE = frozenset({
    "add", "sub", "mul", "div", "truediv", "neg", "pow", "rsqrt", "sqrt", "exp", "log", "tanh",
    "sigmoid", "silu", "gelu", "relu", "relu_", "float", "to", "type", "type_as", "contiguous",
    "clone", "dropout", "abs", "sin", "cos", "erf", "softplus", "mish", "where", "clamp",
    "iadd", "imul", "add_", "mul_", "masked_fill", "detach", "half", "bfloat16", "identity",
})
VIEWS = frozenset({"view", "reshape", "flatten", "unflatten", "unsqueeze", "squeeze",
                   "view_as", "reshape_as"})
PERMUTES = frozenset({"transpose", "permute", "swapaxes", "movedim"})
WHOLE = frozenset({"all_reduce", "all_gather_into_tensor", "full_tensor"})


def _key(n: fx.Node) -> str:
    if n.op == "call_method":
        return str(n.target)
    return getattr(n.target, "__name__", str(n.target)).removeprefix("_")


def _value(n: Any) -> Any:
    return n.meta.get("example_value") if isinstance(n, fx.Node) else None


def _shape(n: Any) -> tuple[int, ...] | None:
    v = _value(n)
    return tuple(int(d) for d in v.shape) if isinstance(v, torch.Tensor) else None


def _of_dtensor(v: Any) -> _Part | None:
    """The part a DTensor value is (None: replicated)."""
    mesh = v.device_mesh
    if mesh.ndim != 1:
        return _Part(None, False, mesh, True)  # a 2-D mesh (TP with DP): not followed
    p = v.placements[0]
    if isinstance(p, Replicate):
        return None
    if isinstance(p, Shard):
        return _Part(p.dim % max(v.dim(), 1), False, mesh, True)
    if isinstance(p, Partial) or "Partial" in type(p).__name__:
        return _Part(None, True, mesh, True)
    return _Part(None, False, mesh, True)


def _reshaped(dim: int, src: tuple[int, ...], dst: tuple[int, ...],
              inferred: frozenset[int] = frozenset()) -> int | None:
    """The dimension of ``dst`` that carries the split of ``src``'s ``dim`` (contiguous chunks
    stay contiguous only when it is the outermost of the dims merged or split), or None.
    ``inferred``: the dims of ``dst`` the code left to torch (``view(b, s, -1, d)``): the one
    whose size is per rank, where a size of 1 leaves the shapes ambiguous."""
    if src == dst:
        return dim
    i = j = 0
    while i < len(src) and j < len(dst):
        gi, gj, a, b = [i], [j], src[i], dst[j]
        while a != b:
            if a < b:
                i += 1
                gi.append(i)
                a *= src[i]
            else:
                j += 1
                gj.append(j)
                b *= dst[j]
        if dim in gi:
            picked = [k for k in gj if k in inferred]
            if len(picked) == 1 and (len(gi) == 1 or gi[0] == dim or src[gi[0]] == 1):
                return picked[0]
            outer_src = next((k for k in gi if src[k] != 1), None)
            outer_dst = next((k for k in gj if dst[k] != 1), None)
            return outer_dst if outer_src == dim else None
        i, j = i + 1, j + 1
    return None


def _inferred(n: fx.Node, ndim: int) -> frozenset[int]:
    """The output dims a ``view``/``reshape`` leaves to torch (given as -1)."""
    if _key(n) not in {"view", "reshape"}:
        return frozenset()
    args = list(n.args[1:])
    if len(args) == 1 and isinstance(args[0], (list, tuple)):
        args = list(args[0])
    return frozenset(i for i, a in enumerate(args) if a == -1 and len(args) == ndim)


def _index_map(n: fx.Node, ndim: int) -> dict[int, int] | None:
    """For ``x[index]``: input dim -> output dim of the dims a full slice keeps."""
    index = n.args[1]
    items = list(index) if isinstance(index, tuple) else [index]
    if any(isinstance(i, fx.Node) for i in items):
        return None
    if Ellipsis in items:
        at = items.index(Ellipsis)
        real = sum(1 for i in items if i is not None and i is not Ellipsis)
        items = items[:at] + [slice(None)] * (ndim - real) + items[at + 1:]
    items += [slice(None)] * (ndim - sum(1 for i in items if i is not None))
    out: dict[int, int] = {}
    src = dst = 0
    for i in items:
        if i is None:
            dst += 1
        elif isinstance(i, int):
            src += 1
        elif isinstance(i, slice):
            if i == slice(None):
                out[src] = dst
            src, dst = src + 1, dst + 1
        else:
            return None
    return out


def _follow(n: fx.Node, parts: dict[fx.Node, _Part | None]) -> _Part | None:
    """The part ``n``'s value is, from its inputs' (at least one of which is a part)."""
    ins = [a for a in n.all_input_nodes if parts.get(a) is not None]
    first = parts[ins[0]]
    assert first is not None
    mesh, key = first.mesh, _key(n)
    unknown = _Part(None, False, mesh)
    if any(not parts[a].known for a in ins):  # type: ignore[union-attr]
        return unknown
    shape = _shape(n)
    if key in WHOLE or key == "wait_tensor" and not first.partial and first.dim is None:
        return None
    if key == "wait_tensor":
        return first
    if key == "to_local":
        return dataclasses.replace(first, dtensor=False)
    if key == "copy_":  # the part written is the source's
        return parts.get(n.args[1]) if isinstance(n.args[1], fx.Node) else None
    if shape is None:
        return unknown
    ndim = len(shape)
    if key == "linear":
        x, w = n.args[0], n.args[1]
        px = parts.get(x) if isinstance(x, fx.Node) else None
        pw = parts.get(w) if isinstance(w, fx.Node) else None
        if pw is not None and pw.dim == 0 and px is None:
            return _Part(ndim - 1, False, mesh)
        ws = _shape(w)
        xs = _shape(x)
        if (pw is not None and ws is not None and pw.dim == len(ws) - 1 and px is not None
                and xs is not None and px.dim == len(xs) - 1):
            return _Part(None, True, mesh)
        return unknown
    if first.partial:
        # A partial sum stays one through ops linear in it alone.
        return first if key in {"contiguous", "clone", "to", "float", "view", "reshape"} \
            or key in PERMUTES else unknown
    if key in ELEMENTWISE or key in {"softmax", "log_softmax"}:
        dims = set()
        for a in ins:
            sa = _shape(a)
            d = parts[a].dim  # type: ignore[union-attr]
            if sa is None or d is None:
                return unknown
            dims.add(d + ndim - len(sa))  # right-aligned broadcasting
        dim = dims.pop() if len(dims) == 1 else None
        if dim is None:
            return unknown
        if key in {"softmax", "log_softmax"}:
            sd = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim")
            if not isinstance(sd, int) or sd % ndim == dim:
                return unknown
        return _Part(dim, False, mesh)
    x = n.args[0] if n.args else None
    px = parts.get(x) if isinstance(x, fx.Node) else None
    xs = _shape(x)
    if len(ins) == 1 and px is not None and px.dim is not None and xs is not None:
        moved = _moved(n, key, px.dim, xs, shape)  # the one part moved by a view, a permute..
        if moved is not None:
            return unknown if moved < 0 else _Part(moved, False, mesh)
    if key in {"scaled_dot_product_attention", "attention_probs", "attention_scores"}:
        kv = [parts.get(a) for a in n.args[1:3] if isinstance(a, fx.Node)]
        if px is not None and px.dim is not None and px.dim < len(xs or ()) - 2 and all(
                p is not None and p.dim == px.dim for p in kv):
            return _Part(px.dim, False, mesh)
        return unknown
    if key == "cat" and isinstance(x, (list, tuple)):
        d = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim", 0)
        found = {p.dim for a in x if isinstance(a, fx.Node) and (p := parts.get(a)) is not None}
        # The other tensors are empty (a cache of no positions yet).
        empty = all(parts.get(a) is not None or (_shape(a) or (1,)) == (0,)
                    for a in x if isinstance(a, fx.Node))
        if len(found) == 1 and empty and isinstance(d, int) and d % ndim not in found:
            return _Part(found.pop(), False, mesh)
        return unknown
    return unknown


def _moved(n: fx.Node, key: str, dim: int, xs: tuple[int, ...], shape: tuple[int, ...]
           ) -> int | None:
    """Where a view, permute or slice of ``n`` puts its input's split ``dim``: a dim, -1
    where it cannot be followed, None for another op."""
    if key in VIEWS:
        d = _reshaped(dim, xs, shape, _inferred(n, len(shape)))
        return -1 if d is None else d
    if key in PERMUTES:
        order = list(range(len(xs)))
        rest: list[Any] = list(n.args[1:])
        if key in {"transpose", "swapaxes"} and len(rest) == 2:
            a, b = (int(r) % len(xs) for r in rest)
            order[a], order[b] = order[b], order[a]
        elif key == "permute":
            dims = rest[0] if len(rest) == 1 and isinstance(rest[0], (list, tuple)) else rest
            order = [int(r) % len(xs) for r in dims]
        else:
            return -1
        return order.index(dim)
    if key == "getitem":
        m = _index_map(n, len(xs))
        return m[dim] if m and dim in m else -1
    return None


def mark(graph: fx.Graph, named: NamedGraph, gather: bool = False) -> NamedGraph:
    """Put a :class:`Sharding` on each site whose value is a part of a tensor-parallel value
    (``Site.sharding``; ``gathered`` where ``gather`` and the part is known); a graph without
    one comes back unchanged. One warning names the modules whose sites' parts it cannot
    follow."""
    if DTensor is None or not tdist.is_available() or not tdist.is_initialized():
        return named
    parts: dict[fx.Node, _Part | None] = {}
    current: dict[fx.Node, _Part | None] = {}  # after in-place writes (copy_ of a reduction)
    for n in graph.nodes:
        v = _value(n)
        if isinstance(v, DTensor):
            parts[n] = _of_dtensor(v)
        elif n.op in ("call_function", "call_method") and any(
                current.get(a) is not None for a in n.all_input_nodes):
            view = {a: current.get(a) for a in n.all_input_nodes}
            parts[n] = _follow(n, view)
        else:
            parts[n] = None
        current[n] = parts[n]
        key = _key(n)
        if (key.endswith("_") or key.startswith("i") and key in ELEMENTWISE) and n.args \
                and isinstance(n.args[0], fx.Node):  # written in place: read as written
            current[n.args[0]] = parts[n]
    # Beside SDPA, the pattern and scores are computed from its arguments: its heads' part.
    extra = {id(s): parts.get(node) for node, s in [*named.sdpa.items(),
                                                     *named.scores.items()]}
    if not any(p is not None for p in parts.values()):
        return named
    replaced: dict[int, Site] = {}
    lost: dict[str, list[str]] = {}

    def shard(s: Site, p: _Part | None) -> Site:
        if p is None:
            return s
        if id(s) not in replaced:
            mesh = p.mesh
            group = mesh.get_group() if mesh.ndim == 1 else None
            ranks = mesh.size()
            rank = mesh.get_local_rank() if mesh.ndim == 1 else tdist.get_rank()
            if not p.known:
                lost.setdefault(s.module_path or "the model", []).append(s.name)
            replaced[id(s)] = dataclasses.replace(s, sharding=Sharding(
                p.dim, ranks, rank, repr(mesh), partial=p.partial, understood=p.known,
                gathered=gather and p.known and not p.dtensor, dtensor=p.dtensor, group=group))
        return replaced[id(s)]

    for n in graph.nodes:
        if SITES in n.meta:
            n.meta[SITES] = [shard(s, parts.get(n)) for s in n.meta[SITES]]
    for s in [*named.sdpa.values(), *named.scores.values()]:
        shard(s, extra.get(id(s)))
    if lost:
        said = "; ".join(f"{m} ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''})"
                         for m, names in lost.items())
        warnings.warn(
            f"tensor parallelism: the sites of {said} are computed from this rank's part of a "
            f"sharded value through {UNKNOWN_OPS_NOTE}: each is this rank's local value, whose "
            "relation to the full value fxprobe cannot tell (site.sharding.understood is "
            "False), and gather=True cannot gather it", ShardingWarning, stacklevel=2)

    return named.with_sites(replaced)


def gather(graph: fx.Graph, names: Iterable[str]) -> None:
    """Make the sites in ``names`` that hold a known part hold the full value (gathered from
    every rank), and what the graph computes after them read this rank's part of it (of an
    edited value, when ``fn=`` or a per-call edit replaced it), in place."""
    wanted = set(names)
    for node in list(graph.nodes):
        sites = [s for s in sites_of(node) if s.name in wanted and s.sharding is not None
                 and s.sharding.gathered]
        if not sites or node.op in ("output", "placeholder"):
            continue
        spec = sites[0].sharding
        assert spec is not None
        at = _At(spec)  # the graph's code cannot spell a Sharding: a bound method holds it
        with graph.inserting_after(node):
            full = graph.call_function(at.whole, (node,))
        with graph.inserting_after(full):
            local = graph.call_function(at.part, (full, node))
        node.replace_all_uses_with(
            local, delete_user_cb=lambda u, ours=(full, local): u not in ours)
        moved = {s.name for s in sites}
        node.meta[SITES] = [s for s in sites_of(node) if s.name not in moved]
        full.meta[SITES] = sites
        for key in ("nn_module_stack", "stack_trace", "example_value"):
            if key in node.meta:
                local.meta[key] = node.meta[key]
                if key != "example_value":
                    full.meta[key] = node.meta[key]
    graph.lint()


class _At:
    """The gather and re-split of one site's value, as graph calls."""

    def __init__(self, spec: Sharding) -> None:
        self.spec = spec

    def whole(self, value: Any) -> Any:
        return whole(value, self.spec)

    def part(self, full: Any, value: Any) -> Any:
        return part(full, value, self.spec)


def whole(value: Any, spec: Sharding) -> Any:
    """The full value of which ``value`` is this rank's part."""
    if not isinstance(value, torch.Tensor):
        return value
    if spec.partial:
        total = value.detach().clone() if not value.requires_grad else value.clone()
        tdist.all_reduce(total, group=spec.group)
        return total
    dim = spec.dim
    assert dim is not None
    local = value.contiguous()
    size = torch.tensor([local.shape[dim]], dtype=torch.long)
    sizes = [torch.zeros_like(size) for _ in range(spec.ranks)]
    tdist.all_gather(sizes, size, group=spec.group)
    most = int(max(s.item() for s in sizes))
    if local.shape[dim] < most:  # the last ranks may hold shorter parts
        pad = list(local.shape)
        pad[dim] = most - local.shape[dim]
        local = torch.cat([local, local.new_zeros(pad)], dim)
    chunks = [torch.empty_like(local) for _ in range(spec.ranks)]
    tdist.all_gather(chunks, local, group=spec.group)
    return torch.cat([c.narrow(dim, 0, int(s.item()))
                      for c, s in zip(chunks, sizes, strict=True)], dim)


def part(full: Any, value: Any, spec: Sharding) -> Any:
    """This rank's part of ``full`` (the value the graph computed: ``value``), as the model
    holds it: a chunk along the split dimension; for a partial sum, this rank's summand with
    any edit of the sum added on rank 0 (the sum over the ranks is then the edited value)."""
    if not isinstance(full, torch.Tensor) or not isinstance(value, torch.Tensor):
        return value
    if spec.partial:
        total = whole(value, spec)  # every rank takes part: the collective is not skipped
        return full - total + value if spec.rank == 0 else value
    assert spec.dim is not None
    start, stop = spec.span(full.shape[spec.dim])
    return full.narrow(spec.dim, start, stop - start).contiguous()


__all__ = ["ShardingWarning", "gather", "mark"]


def check_tracer(model: nn.Module, tracer: str) -> None:
    """Warn where a tensor-parallel model (``DTensor`` parameters) is tapped by a tracer that
    does not follow its parts: its values would be each rank's parts with no record saying so."""
    if tracer == "dynamo" or DTensor is None:
        return
    try:  # FSDP2 shards parameters as DTensors too, and unshards them for the forward
        from torch.distributed.fsdp import FSDPModule
        fsdp = tuple(path for path, m in model.named_modules() if isinstance(m, FSDPModule))
    except ImportError:
        fsdp = ()
    split = [name for name, p in model.named_parameters() if isinstance(p, DTensor)
             and not any(path == "" or name.startswith(path + ".") for path in fsdp)]
    if not split:
        return
    owner = split[0].rpartition(".")[0] or type(model).__name__
    how = ("fx traces what it can first, and what fx traces is not followed"
           if tracer in ("auto", "fx+dynamo") else f"tracer={tracer!r} does not follow them")
    warnings.warn(
        f"{type(model).__name__} is split by tensor parallelism ({len(split)} DTensor "
        f"parameters, the first in {owner}): fxprobe says which part of a value each rank "
        f"holds (site.sharding) and gathers it (gather=True) under tracer='dynamo'; {how}, "
        "so values may be this rank's parts with no record saying so: pass tracer='dynamo'",
        ShardingWarning, stacklevel=3)
