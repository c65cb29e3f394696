"""The graph reading behind the canonical transformer names (``frontends/canonical.py``):
an index of a captured graph (users, shapes, what reads a weight) and the attention kernels
(SDPA calls, or a softmax that weighs the values)."""


from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

import sympy
import torch
from torch import fx, nn

from ..core.ops import VIEW_OPS, module_key
from ..core.site import CALL_ARGS, SITES, Site, node_site, reach, source_name
from .dynamo_names import NamedGraph, dynamo_op_key, is_state

# Ops that only change a value's shape, layout or dtype (the same numbers): walked through.
VIEWS = frozenset(VIEW_OPS - {"dropout", "feature_alpha_dropout", "alpha_dropout",
                               "dropout1d", "dropout2d", "dropout3d", "split", "chunk",
                               "unbind", "tensor_split", "split_with_sizes"}) | {"clone"}


SHARDS = frozenset({"getattr", "to_local", "redistribute", "full_tensor"})
"""Between a parameter and the op that reads it: an attribute, and a tensor-parallel layer's
view of its ``DTensor`` weight (this rank's shard, ``weight.to_local()``)."""


# ...and those that hand their input back in eval mode (dropout): between two values.
PASS = VIEWS | {"dropout", "feature_alpha_dropout", "alpha_dropout", "identity"}


GATHERS = frozenset({"index_select", "gather", "take", "sort", "topk", "argsort", "index",
                      "nonzero", "index_add", "scatter", "scatter_add", "masked_select"})


ADDS = frozenset({"add"})


ATTENTION_MODULE = "multihead_attention"
"""The key of a call of ``nn.MultiheadAttention`` that torch.fx keeps whole (``FxIndex``)."""


MATMULS = frozenset({"matmul", "bmm"})


SCORE_MATMULS = MATMULS | {"baddbmm"}
"""Ops that compute ``q @ k.T``: ``baddbmm(input, batch1, batch2)`` too (Bloom, GPT-2 with
``reorder_and_upcast_attn``), whose q and k are ``batch1`` and ``batch2``."""


class GraphIndex:
    """The graph as the derivation reads it: each call node's key, shape and module path."""

    def __init__(self, graph: fx.Graph, root: nn.Module, root_path: str) -> None:
        self.root = root
        self.root_path = root_path
        self.nodes = list(graph.nodes)
        self.index = {n: i for i, n in enumerate(self.nodes)}
        self.sites: dict[fx.Node, Site] = {}
        for n in self.nodes:
            s = node_site(n)
            if s is not None:
                self.sites[n] = s
        self._modules: dict[str, nn.Module | None] = {}

    def key(self, n: fx.Node) -> str | None:
        if n.op not in ("call_function", "call_method", "call_module"):
            return None
        if n.target is getattr:
            return "getattr"
        return dynamo_op_key(n) or getattr(n.target, "__name__", None)

    def call_of(self, n: fx.Node) -> fx.Node:
        """The value of the call of the module whose code ran ``n`` (an embedding module
        that scales its lookup: its output), or ``n`` where that call has no one value."""
        path = self.path(n)
        for x in self.nodes[self.index[n]:]:
            if any(s.inlined and s.module_path == path for s in x.meta.get(SITES, ())):
                return x
        return n

    def path(self, n: fx.Node) -> str | None:
        s = self.sites.get(n)
        return s.module_path if s is not None else None

    def module(self, path: str) -> nn.Module | None:
        if path not in self._modules:
            rel = path[len(self.root_path):].lstrip(".") if self.root_path else path
            if self.root_path and not (path == self.root_path
                                       or path.startswith(self.root_path + ".")):
                self._modules[path] = None
            else:
                try:
                    self._modules[path] = self.root.get_submodule(rel)
                except AttributeError:
                    self._modules[path] = None
        return self._modules[path]

    @staticmethod
    def shape(n: Any) -> tuple[Any, ...] | None:
        if not isinstance(n, fx.Node):
            return None
        v = n.meta.get("example_value")
        if not isinstance(v, torch.Tensor):
            return None
        # A dynamic graph's sizes are read as the sizes it was captured with, as in a static
        # graph: a size dynamo specialized later in the trace (a length of 1) is a number in
        # some values and still its symbol in others.
        return tuple(_size(d) for d in v.shape)

    def is_param(self, n: fx.Node) -> bool:
        """A parameter or buffer of a module (a graph input dynamo took from a module)."""
        return n.op == "get_attr" or (n.op == "placeholder" and (
            bool(n.meta.get("fxprobe_state")) or is_state(n)))

    def given(self, n: fx.Node) -> bool:
        """A tensor the graph is given that is not module state (an argument of the forward,
        a KV cache's tensors), or a view of one."""
        root = self.back(n, VIEWS)[-1]
        return root.op == "placeholder" and not self.is_param(root) and self.shape(root) is not None

    def tensors(self, n: fx.Node) -> list[fx.Node]:
        """The tensor-valued inputs of ``n`` that are not module state."""
        return [a for a in n.all_input_nodes if not self.is_param(a)
                and self.shape(a) is not None]

    def is_parameter(self, n: fx.Node) -> bool:
        """A module's parameter (not a buffer: position ids, masks, frequencies)."""
        name = source_name(n) if n.op == "placeholder" else None
        return name is not None and "._parameters[" in name

    def weight(self, n: fx.Node) -> fx.Node | None:
        """The parameter of two or more dimensions ``n`` reads (through views), if any."""
        for a in n.all_input_nodes:
            seen = 0
            while seen < 4 and not self.is_param(a) and self.key(a) in VIEWS | SHARDS \
                    and a.all_input_nodes:
                a, seen = a.all_input_nodes[0], seen + 1
            if self.is_parameter(a):
                s = self.shape(a)
                if s is None or len(s) >= 2:
                    return a
        return None

    def projects(self, n: fx.Node) -> bool:
        """An op that reads a weight matrix (a linear layer, ``addmm``, ``x @ W.T``)."""
        return n.op != "placeholder" and self.key(n) not in {"embedding", "getattr"} | VIEWS \
            and self.weight(n) is not None

    def weight_shape(self, n: fx.Node) -> tuple[Any, ...] | None:
        """The shape of the weight ``n`` reads (see :meth:`weight`)."""
        w = self.weight(n)
        return self.shape(w) if w is not None else None

    def rows(self, lookup: fx.Node) -> Any:
        """The rows of the table an ``embedding`` node reads (0 where unknown)."""
        w = lookup.args[1] if len(lookup.args) > 1 and isinstance(lookup.args[1], fx.Node) \
            else None
        return (self.shape(w) or (sympy.Integer(0),))[0] if w is not None else sympy.Integer(0)

    def call_args(self, n: fx.Node, s: Site) -> Any:
        """``(positional argument nodes, first node)`` of the module call ``s`` that ``n``
        ends (``CALL_ARGS``), or None."""
        return n.meta.get(CALL_ARGS, {}).get(s.name)

    def back(self, n: fx.Node, ops: frozenset[str]) -> list[fx.Node]:
        """``n`` and the values it is a view of (through ``ops``), nearest first."""
        chain = [n]
        while self.key(chain[-1]) in ops:
            ins = self.tensors(chain[-1])
            if not ins or isinstance(chain[-1].args[0] if chain[-1].args else None, tuple):
                break
            first = chain[-1].args[0] if chain[-1].args else None
            nxt = first if isinstance(first, fx.Node) else ins[0]
            if self.key(chain[-1]) == "getitem" and indexed_by_tensor(chain[-1]):
                break
            chain.append(nxt)
        return chain

    def ancestors(self, n: fx.Node, inside: set[fx.Node], stop: set[fx.Node]) -> set[fx.Node]:
        """The nodes of ``inside`` that ``n`` is computed from (``n`` too), not past ``stop``."""
        return reach([n], lambda x: x.all_input_nodes,
                     where=lambda x: x in inside and x not in stop)


class FxIndex(GraphIndex):
    """A graph torch.fx traced (the fx frontend's, its shapes from one run on fake tensors):
    the module calls fx keeps whole read as the ops dynamo inlines them into. An
    ``nn.Embedding`` is an ``embedding`` of ``num_embeddings`` rows, a module holding a weight
    matrix projects, ``nn.MultiheadAttention`` is an attention kernel (``ATTENTION_MODULE``),
    and a module's arguments are its call's."""

    def called(self, n: fx.Node) -> nn.Module | None:
        return self.module(str(n.target)) if n.op == "call_module" else None

    def key(self, n: fx.Node) -> str | None:
        m = self.called(n)
        if m is None:
            return super().key(n)
        if isinstance(m, nn.Embedding):
            return "embedding"
        if isinstance(m, nn.MultiheadAttention):
            return ATTENTION_MODULE
        return module_key(type(m)) or f"module:{type(m).__name__}"

    def is_parameter(self, n: fx.Node) -> bool:
        if n.op != "get_attr":
            return False
        obj: Any = self.root
        for part in str(n.target).split("."):
            obj = getattr(obj, part, None)
        return isinstance(obj, nn.Parameter)

    @staticmethod
    def matrix(m: nn.Module) -> nn.Parameter | None:
        return next((p for p in m.parameters(recurse=False) if p.dim() >= 2), None)

    def projects(self, n: fx.Node) -> bool:
        m = self.called(n)
        if m is None:
            return super().projects(n)
        return not isinstance(m, nn.Embedding) and self.matrix(m) is not None

    def weight_shape(self, n: fx.Node) -> tuple[Any, ...] | None:
        m = self.called(n)
        if m is None:
            return super().weight_shape(n)
        w = self.matrix(m)
        return tuple(sympy.Integer(d) for d in w.shape) if w is not None else None

    def rows(self, lookup: fx.Node) -> Any:
        m = self.called(lookup)
        if isinstance(m, nn.Embedding):
            return sympy.Integer(m.num_embeddings)
        return super().rows(lookup)

    def call_args(self, n: fx.Node, s: Site) -> Any:
        if n.op == "call_module" and not s.inlined:
            return (n.args, n)
        return super().call_args(n, s)


def indexed_by_tensor(n: fx.Node) -> bool:
    idx = n.args[1] if len(n.args) > 1 else None
    items = idx if isinstance(idx, (tuple, list)) else (idx,)
    return any(isinstance(i, fx.Node) for i in items)


def _size(d: Any) -> Any:
    if isinstance(d, torch.SymInt):
        hint = d.node.hint
        return d.node.expr if hint is None else sympy.Integer(int(hint))
    return sympy.Integer(d)


def numel_of(shape: Sequence[Any]) -> Any:
    out: Any = sympy.Integer(1)
    for d in shape:
        out = out * d
    return out


@dataclasses.dataclass
class Kernel:
    """One attention kernel call: its node and what it reads."""

    node: fx.Node
    q: fx.Node | None
    k: fx.Node | None
    v: fx.Node | None
    scores: fx.Node | None
    pattern: fx.Node | None
    qk: fx.Node | None = None
    """The op that computed ``q @ k.T`` (eager attention; None beside SDPA)."""
    opaque: bool = False
    """A module call (``nn.MultiheadAttention`` under torch.fx): q, k and v are what it is
    called with, and nothing it computes inside is a value of the graph."""


def find_kernels(g: GraphIndex, named: NamedGraph) -> list[Kernel]:
    """Every attention kernel of the graph, in graph order."""
    found = []
    for n in g.nodes:
        key = g.key(n)
        if key == "scaled_dot_product_attention":
            args = list(n.args) + [None] * 3
            q = args[0] if args[0] is not None else n.kwargs.get("query")
            k = args[1] if args[1] is not None else n.kwargs.get("key")
            v = args[2] if args[2] is not None else n.kwargs.get("value")
            q, k, v = (x if isinstance(x, fx.Node) else None for x in (q, k, v))
            found.append(Kernel(n, q, k, v, n, n))
        elif key in ("softmax", "_softmax"):
            kernel = eager_kernel(g, n)
            if kernel is not None:
                found.append(kernel)
        elif key == ATTENTION_MODULE:
            q, k, v = (x if isinstance(x, fx.Node) else None for x in (
                n.args[i] if len(n.args) > i else n.kwargs.get(w)
                for i, w in enumerate(("query", "key", "value"))))
            found.append(Kernel(n, q, k, v, None, None, opaque=True))
    return found


def eager_kernel(g: GraphIndex, softmax: fx.Node) -> Kernel | None:
    """``softmax(q @ k.T ...) @ v``: the softmax's probabilities multiply the values."""
    todo, seen, pv = [softmax], set(), None
    while todo and pv is None:  # forward through dtype casts and dropout
        x = todo.pop()
        for u in x.users:
            if u in seen:
                continue
            seen.add(u)
            if g.key(u) in MATMULS and u.args and u.args[0] is x:
                pv = u
                break
            if g.key(u) in PASS:
                todo.append(u)
    if pv is None or not softmax.args or not isinstance(softmax.args[0], fx.Node):
        return None
    scores = softmax.args[0]
    qk = None
    todo, seen = [scores], set()
    while todo:  # back through scaling, masks, biases, soft-capping to q @ k.T
        x = todo.pop(0)
        if x in seen or len(seen) > 64:
            continue
        seen.add(x)
        if g.key(x) in SCORE_MATMULS:
            qk = x
            break
        todo.extend(a for a in x.all_input_nodes if not g.is_param(a))
    if qk is None:
        return None
    if g.key(qk) == "baddbmm":
        args = list(qk.args) + [None] * 3
        q = args[1] if args[1] is not None else qk.kwargs.get("batch1")
        k = args[2] if args[2] is not None else qk.kwargs.get("batch2")
    elif len(qk.args) < 2:
        return None
    else:
        q, k = qk.args[0], qk.args[1]
    v = pv.args[1] if len(pv.args) > 1 else None
    return Kernel(pv, q if isinstance(q, fx.Node) else None,
                   k if isinstance(k, fx.Node) else None,
                   v if isinstance(v, fx.Node) else None, scores, softmax, qk)


def flat_nodes(args: Any) -> Iterable[fx.Node]:
    if isinstance(args, fx.Node):
        yield args
    elif isinstance(args, (tuple, list)):
        for a in args:
            yield from flat_nodes(a)
    elif isinstance(args, dict):
        for a in args.values():
            yield from flat_nodes(a)


def descendants(n: fx.Node) -> set[fx.Node]:
    return reach([n], lambda x: x.users)


def norms_after(g: GraphIndex, x: fx.Node) -> list[fx.Node]:
    """The values of norm calls that read ``x``: modules whose parameters are all vectors and
    whose output has their input's shape (LayerNorm, RMSNorm, T5's, Gemma's)."""
    found = []
    shape = g.shape(x)
    todo = [(u, g.path(u) or "") for u in x.users]
    seen: set[fx.Node] = set()
    while todo:  # the call's value is a later node of the call (an inlined module's)
        n, within = todo.pop()
        if n in seen or not within or not (g.path(n) or "").startswith(within):
            continue
        seen.add(n)
        for s in n.meta.get(SITES, ()):
            if s.kind != "call_module":
                continue
            args = g.call_args(n, s)
            if args is None or x not in args[0][:1]:
                continue
            m = g.module(s.module_path)
            params = list(m.parameters()) if m is not None else []
            if params and all(p.dim() == 1 for p in params) and g.shape(n) == shape:
                found.append(n)
        if within != g.path(x):
            todo.extend((u, within) for u in n.users)
    return found


def closure(g: GraphIndex, x: fx.Node, inside: set[fx.Node]) -> set[fx.Node]:
    """The stream ``x`` as the block reads it: ``x``, its views, and its norms."""
    return reach([x], lambda n: [*(u for u in n.users if g.key(u) in VIEWS and not (
        g.key(u) == "getitem" and indexed_by_tensor(u))), *norms_after(g, n)])


def full_of(g: GraphIndex, x: fx.Node, shape: tuple[Any, ...] | None) -> fx.Node:
    """``x`` walked back through views to a value shaped like the stream."""
    for n in g.back(x, VIEWS):
        if g.shape(n) == shape:
            return n
    return x


def kernels_in(g: GraphIndex, node: fx.Node, inside: set[fx.Node], stops: set[fx.Node],
                kernels: dict[fx.Node, Kernel]) -> list[Kernel]:
    anc = g.ancestors(node, inside, stops)
    return [kernels[n] for n in sorted(anc & kernels.keys(), key=g.index.__getitem__)]


def mlp_points(g: GraphIndex, out: fx.Node, inside: set[fx.Node], stops: set[fx.Node],
         shape: tuple[Any, ...] | None) -> tuple[fx.Node | None, fx.Node | None]:
    """(mlp.pre, mlp.post) of the MLP whose output is ``out``; Nones where tokens are routed."""
    region = g.ancestors(out, inside, stops)
    projs = [n for n in region if g.projects(n)]
    if not projs or shape is None:
        return None, None
    last = [p for p in projs if not any(q is not p and q in descendants(p) for q in projs)]
    if len(last) != 1:
        return None, None
    proj = last[0]
    if len(g.weight_shape(proj) or ()) > 2:
        return None, None  # one weight per expert
    ins = [a for a in g.tensors(proj) if a in region]
    if not ins:
        return None, None
    post = g.back(ins[0], VIEWS - {"to", "type", "type_as", "float"})[-1]
    positions = numel_of(shape[:-1])
    post_shape = g.shape(post)
    if post_shape is None or numel_of(post_shape[:-1]) != positions:
        return None, None
    before = g.ancestors(post, inside, stops)
    if any(g.key(n) in GATHERS or (g.key(n) == "getitem" and indexed_by_tensor(n))
           for n in before):
        return None, None  # tokens routed to experts
    outputs: set[fx.Node] = set()
    for p in projs:
        if p is not proj:
            reach([p], lambda x: (u for u in x.users if u in region and (
                g.key(u) in VIEWS | {"split", "chunk", "unbind"})), into=outputs)
    act = g.back(post, PASS)[-1]
    if g.key(act) == "mul":
        a = [g.back(x, PASS)[-1] for x in g.tensors(act)]
        linear = [x for x in a if x in outputs]
        if len(a) == 2 and len(linear) == 1:
            act = a[0] if a[1] is linear[0] else a[1]
    if act in outputs:
        return None, post  # no activation between the projections
    reads = [x for x in g.ancestors(act, inside, stops) if x in outputs and g.shape(x) is not None]
    if not reads:
        return None, post
    pre = max(reads, key=g.index.__getitem__)
    if numel_of((g.shape(pre) or ())[:-1]) != positions:
        return None, post
    return pre, post
