"""One vocabulary for every transformer: canonical names derived from a captured graph.

Beside its own name (``model.layers.3.add_1``), a site of a transformer answers to the name
its role has in every family (``blocks.3.resid_post``): the name goes into
``Site.canonical``, which name and glob selectors and ``tapped.taps[...]`` read. Nothing here
knows an architecture by name; each role is found from the structure of the graph and of the
module tree:

- **blocks**: an attention kernel (``F.scaled_dot_product_attention``, or a softmax whose
  probabilities multiply the values) inside a child of a ``ModuleList`` whose children are of
  one class; the child's index is ``L``. Several such lists are several stacks: the one whose
  blocks hold a cross-attention (keys and values from outside the block's stream) is
  ``decoder.``, the other ``encoder.``.
- **resid_pre**: the input of the block that one of the block's additions reads directly
  (the residual add: an add whose one operand is the incoming stream). The stream then runs
  through the residual adds in order; after each, it is the add's value, or the norm of it
  when the block normalizes the sum (post-LN, as BERT).
- **attn_out / mlp_out**: the other operand of each residual add: an attention's when an
  attention kernel is among its ancestors (a ``cross_attn_out`` when that kernel's keys do not
  come from the stream), the MLP's when none is. An operand that is itself the sum of an
  attention output and an MLP output is a parallel block (GPT-J, GPT-NeoX, Falcon): there is
  no ``resid_mid``.
- **resid_mid** (and **resid_mid_cross**): the stream between two residual adds;
  **resid_post**: the stream that leaves the block.
- **attn.q/k/v**: the kernel's arguments, walked back through views and head repeats (so the
  model's own key/value heads, after rotary); **attn.scores**: the softmax's input, or beside
  SDPA the ``attention_scores`` site computed from its arguments; **attn.pattern**: the softmax,
  or beside SDPA the ``attention_probs`` site; **attn.z**: the last value shaped per head
  between the kernel and the output projection (the first op after it that reads a weight).
- **mlp.post**: what the MLP's output projection (its last op reading a weight) reads;
  **mlp.pre**: what its activation reads: the projection output from which ``mlp.post`` is
  computed other than by a product with another projection output (the gate's up
  projection). Absent where tokens are routed to experts (MoE): no value holds one row per
  position.
- **embed / pos_embed**: the embedding lookups added into the first block's stream: the one
  indexed by a graph input is ``embed``; the largest other table, with at least as many rows
  as positions, ``pos_embed``.
- **ln_final**: a norm (a module whose parameters are all one-dimensional and whose output has
  its input's shape) that reads the last block's stream; **logits**: a value the graph returns,
  computed from that stream through an op reading a weight, one row per position.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence
from typing import Any

import sympy
import torch
from torch import fx, nn

from ..core.ops import VIEW_OPS
from ..core.site import CALL_ARGS, SITES, Site, node_site
from .dynamo_names import NamedGraph, dynamo_op_key, is_state


def attention_scores(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor | None = None,
                     attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                     is_causal: bool = False, scale: float | None = None,
                     enable_gqa: bool = False) -> torch.Tensor:
    """The attention scores inside ``F.scaled_dot_product_attention(query, key, ...)``.

    ``query @ key.T * scale + mask`` as the math path of SDPA computes it, before the softmax;
    positions the mask excludes are ``-inf`` (a boolean mask, ``is_causal``) or carry the
    float mask's value. Beside every SDPA call the dynamo frontend captured, a site
    ``<module path>.attention_scores`` holds them (computed only where selected); its
    canonical name is ``blocks.{L}.attn.scores``.

    Args:
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa: as for
            ``F.scaled_dot_product_attention`` (``value`` and ``dropout_p`` are not used).

    Returns:
        A tensor shaped ``(..., heads, query length, key length)``.
    """
    q_len, k_len = query.size(-2), key.size(-2)
    if scale is None:
        scale = 1.0 / math.sqrt(query.size(-1))
    if enable_gqa and key.dim() >= 3 and key.size(-3) != query.size(-3):
        key = key.repeat_interleave(query.size(-3) // key.size(-3), dim=-3)
    scores = torch.matmul(query, key.transpose(-2, -1)) * scale
    if is_causal:
        causal = torch.ones(q_len, k_len, dtype=torch.bool, device=query.device).tril()
        scores = scores.masked_fill(causal.logical_not(), float("-inf"))
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(attn_mask.logical_not(), float("-inf"))
        else:
            scores = scores + attn_mask
    return scores


VOCABULARY = (
    "embed", "pos_embed", "blocks.{L}.resid_pre", "blocks.{L}.attn.q", "blocks.{L}.attn.k",
    "blocks.{L}.attn.v", "blocks.{L}.attn.scores", "blocks.{L}.attn.pattern",
    "blocks.{L}.attn.z", "blocks.{L}.attn_out", "blocks.{L}.resid_mid",
    "blocks.{L}.cross_attn.q", "blocks.{L}.cross_attn.k", "blocks.{L}.cross_attn.v",
    "blocks.{L}.cross_attn.scores", "blocks.{L}.cross_attn.pattern", "blocks.{L}.cross_attn.z",
    "blocks.{L}.cross_attn_out", "blocks.{L}.resid_mid_cross", "blocks.{L}.mlp.pre",
    "blocks.{L}.mlp.post", "blocks.{L}.mlp_out", "blocks.{L}.resid_post", "ln_final", "logits",
)
"""Every canonical name, in the order a forward reaches them (``{L}``: the block's index)."""

# Ops that only change a value's shape, layout or dtype (the same numbers): walked through.
_VIEWS = frozenset(VIEW_OPS - {"dropout", "feature_alpha_dropout", "alpha_dropout",
                               "dropout1d", "dropout2d", "dropout3d", "split", "chunk",
                               "unbind", "tensor_split", "split_with_sizes"}) | {"clone"}
# ...and those that hand their input back in eval mode (dropout): between two values.
_PASS = _VIEWS | {"dropout", "feature_alpha_dropout", "alpha_dropout", "identity"}
_GATHERS = frozenset({"index_select", "gather", "take", "sort", "topk", "argsort", "index",
                      "nonzero", "index_add", "scatter", "scatter_add", "masked_select"})
_ADDS = frozenset({"add"})
_MATMULS = frozenset({"matmul", "bmm"})


class _Graph:
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
        return tuple(d.node.expr if isinstance(d, torch.SymInt) else sympy.Integer(d)
                     for d in v.shape)

    def is_param(self, n: fx.Node) -> bool:
        """A parameter or buffer of a module (a graph input dynamo took from a module)."""
        return n.op == "get_attr" or (n.op == "placeholder" and (
            bool(n.meta.get("fxprobe_state")) or is_state(n)))

    def tensors(self, n: fx.Node) -> list[fx.Node]:
        """The tensor-valued inputs of ``n`` that are not module state."""
        return [a for a in n.all_input_nodes if not self.is_param(a)
                and self.shape(a) is not None]

    @staticmethod
    def is_parameter(n: fx.Node) -> bool:
        """A module's parameter (not a buffer: position ids, masks, frequencies)."""
        source = getattr(n.meta.get("grapharg"), "source", None)
        name = getattr(source, "name", None)
        name = name() if callable(name) else name
        return n.op == "placeholder" and isinstance(name, str) and "._parameters[" in name

    def weight(self, n: fx.Node) -> fx.Node | None:
        """The parameter of two or more dimensions ``n`` reads (through views), if any."""
        for a in n.all_input_nodes:
            seen = 0
            while seen < 4 and not self.is_param(a) and self.key(a) in _VIEWS | {"getattr"} \
                    and a.all_input_nodes:
                a, seen = a.all_input_nodes[0], seen + 1
            if self.is_parameter(a):
                s = self.shape(a)
                if s is None or len(s) >= 2:
                    return a
        return None

    def projects(self, n: fx.Node) -> bool:
        """An op that reads a weight matrix (a linear layer, ``addmm``, ``x @ W.T``)."""
        return n.op != "placeholder" and self.key(n) not in {"embedding", "getattr"} | _VIEWS \
            and self.weight(n) is not None

    def back(self, n: fx.Node, ops: frozenset[str]) -> list[fx.Node]:
        """``n`` and the values it is a view of (through ``ops``), nearest first."""
        chain = [n]
        while self.key(chain[-1]) in ops:
            ins = self.tensors(chain[-1])
            if not ins or isinstance(chain[-1].args[0] if chain[-1].args else None, tuple):
                break
            first = chain[-1].args[0] if chain[-1].args else None
            nxt = first if isinstance(first, fx.Node) else ins[0]
            if self.key(chain[-1]) == "getitem" and _indexed_by_tensor(chain[-1]):
                break
            chain.append(nxt)
        return chain

    def ancestors(self, n: fx.Node, inside: set[fx.Node], stop: set[fx.Node]) -> set[fx.Node]:
        """The nodes of ``inside`` that ``n`` is computed from (``n`` too), not past ``stop``."""
        out: set[fx.Node] = set()
        todo = [n]
        while todo:
            x = todo.pop()
            if x in out or x not in inside or x in stop:
                continue
            out.add(x)
            todo.extend(x.all_input_nodes)
        return out


def _indexed_by_tensor(n: fx.Node) -> bool:
    idx = n.args[1] if len(n.args) > 1 else None
    items = idx if isinstance(idx, (tuple, list)) else (idx,)
    return any(isinstance(i, fx.Node) for i in items)


def _numel(shape: Sequence[Any]) -> Any:
    out: Any = sympy.Integer(1)
    for d in shape:
        out = out * d
    return out


@dataclasses.dataclass
class _Kernel:
    """One attention kernel call: its node and what it reads."""

    node: fx.Node
    q: fx.Node | None
    k: fx.Node | None
    v: fx.Node | None
    scores: fx.Node | None
    pattern: fx.Node | None


class _RoleNames:
    """Collects the canonical names of nodes (and the SDPA scores sites to add)."""

    def __init__(self) -> None:
        self.names: dict[fx.Node, list[str]] = {}

    def put(self, node: fx.Node | None, name: str) -> None:
        if node is not None:
            names = self.names.setdefault(node, [])
            if name not in names:
                names.append(name)


def annotate(graph: fx.Graph, named: NamedGraph, *, root: nn.Module, root_path: str
             ) -> NamedGraph:
    """Add canonical names to the sites of a graph dynamo captured (see the module docstring).

    Beside each SDPA call, an ``attention_scores`` site is added too. A graph without an
    attention kernel inside a repeated block comes back unchanged.

    Args:
        graph: the named graph (its nodes carry their sites).
        named: what ``name_graph`` returned for it.
        root: the module the dynamo region runs.
        root_path: its path in the model.
    """
    g = _Graph(graph, root, root_path)
    scores: dict[fx.Node, Site] = {}
    for node, probs in named.sdpa.items():
        head, sep, tail = probs.name.rpartition("attention_probs")
        scores[node] = Site(f"{head}attention_scores{tail}" if sep else probs.name + "_scores",
                            "dynamo", "call_function", attention_scores, probs.module_path)
    kernels = _kernels(g, named)
    out = _RoleNames()
    if kernels:
        _name_all(g, kernels, named, scores, out)
    if not out.names and not scores:
        return named
    replaced: dict[int, Site] = {}
    for node, names in out.names.items():
        for n in names:
            # Beside SDPA, the scores and the pattern are the sites computed from its arguments.
            target = node_site(node)
            if n.endswith(".scores") and node in scores:
                target = scores[node]
            elif n.endswith(".pattern") and node in named.sdpa:
                target = named.sdpa[node]
            if target is None:
                continue
            cur = replaced.get(id(target), target)
            if n not in cur.canonical:
                replaced[id(target)] = dataclasses.replace(cur, canonical=(*cur.canonical, n))
    if not replaced and not scores:
        return named

    def swap(s: Site) -> Site:
        return replaced.get(id(s), s)

    for node in graph.nodes:
        if SITES in node.meta:
            node.meta[SITES] = [swap(s) for s in node.meta[SITES]]
    new_scores = {n: swap(s) for n, s in scores.items()}
    order: list[Site] = []
    probs_ids = {id(s): n for n, s in named.sdpa.items()}
    for s in named.order:
        if id(s) in probs_ids:  # the scores come before the probabilities
            order.append(new_scores[probs_ids[id(s)]])
        order.append(swap(s))
    return dataclasses.replace(
        named, sites={n: swap(s) for n, s in named.sites.items()},
        sdpa={n: swap(s) for n, s in named.sdpa.items()}, order=order, scores=new_scores)


def _kernels(g: _Graph, named: NamedGraph) -> list[_Kernel]:
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
            found.append(_Kernel(n, q, k, v, n, n))
        elif key in ("softmax", "_softmax"):
            kernel = _eager_kernel(g, n)
            if kernel is not None:
                found.append(kernel)
    return found


def _eager_kernel(g: _Graph, softmax: fx.Node) -> _Kernel | None:
    """``softmax(q @ k.T ...) @ v``: the softmax's probabilities multiply the values."""
    todo, seen, pv = [softmax], set(), None
    while todo and pv is None:  # forward through dtype casts and dropout
        x = todo.pop()
        for u in x.users:
            if u in seen:
                continue
            seen.add(u)
            if g.key(u) in _MATMULS and u.args and u.args[0] is x:
                pv = u
                break
            if g.key(u) in _PASS:
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
        if g.key(x) in _MATMULS:
            qk = x
            break
        todo.extend(a for a in x.all_input_nodes if not g.is_param(a))
    if qk is None or len(qk.args) < 2:
        return None
    q, k = qk.args[0], qk.args[1]
    v = pv.args[1] if len(pv.args) > 1 else None
    return _Kernel(pv, q if isinstance(q, fx.Node) else None,
                   k if isinstance(k, fx.Node) else None,
                   v if isinstance(v, fx.Node) else None, scores, softmax)


def _heads(g: _Graph, n: fx.Node | None, transposed: bool = False) -> fx.Node | None:
    """What the kernel reads, walked back through views and head repeats to the earliest value
    laid out as (batch, heads, positions, head dim): the model's own heads, after rotary."""
    if n is None:
        return None
    ref = g.shape(n)
    if ref is None or len(ref) < 3:
        return n
    if transposed:  # k.T: (batch, heads, dim, positions)
        ref = (*ref[:-2], ref[-1], ref[-2])
    best = None
    for x in g.back(n, _VIEWS):
        s = g.shape(x)
        if s is not None and len(s) == len(ref) and s[0] == ref[0] and s[-2:] == ref[-2:]:
            best = x
    return best


def _blocks(g: _Graph, kernels: list[_Kernel]) -> dict[str, dict[int, str]]:
    """The repeated blocks that hold the kernels: {ModuleList path: {index: block path}}."""
    stacks: dict[str, dict[int, str]] = {}
    for k in kernels:
        path = g.path(k.node) or ""
        parts = path.split(".")
        for i in range(len(parts) - 1, 0, -1):
            parent, child = ".".join(parts[:i]), parts[i]
            if not child.isdigit():
                continue
            lst = g.module(parent)
            if isinstance(lst, (nn.ModuleList, nn.Sequential)) and len(lst) > 0 and len(
                    {type(m) for m in lst}) == 1:
                stacks.setdefault(parent, {})[int(child)] = f"{parent}.{child}"
                break
    return stacks


def _name_all(g: _Graph, kernels: list[_Kernel], named: NamedGraph,
              scores: dict[fx.Node, Site], out: _RoleNames) -> None:
    stacks = _blocks(g, kernels)
    if not stacks:
        return
    by_block: dict[str, list[_Kernel]] = {}
    for k in kernels:
        path = g.path(k.node) or ""
        for blocks in stacks.values():
            for b in blocks.values():
                if path == b or path.startswith(b + "."):
                    by_block.setdefault(b, []).append(k)
    members: dict[str, set[fx.Node]] = {}
    for n in g.nodes:
        p = g.path(n)
        if p is None:
            continue
        for blocks in stacks.values():
            for b in blocks.values():
                if p == b or p.startswith(b + "."):
                    members.setdefault(b, set()).add(n)
    results: dict[str, dict[int, _Block]] = {}
    for lst, blocks in stacks.items():
        results[lst] = {}
        for i, b in sorted(blocks.items()):
            blk = _block(g, members.get(b, set()), by_block.get(b, []))
            if blk is not None:
                results[lst][i] = blk
    crossing = [lst for lst, r in results.items() if any(b.cross for b in r.values())]
    ordered = sorted(results, key=lambda lst: min(
        (g.index[b.stream_in] for b in results[lst].values() if b.stream_in is not None),
        default=len(g.nodes)))
    prefix: dict[str, str] = {}
    if len(ordered) == 1:
        prefix[ordered[0]] = ""
    elif len(ordered) == 2 and len(crossing) == 1:
        for lst in ordered:
            prefix[lst] = "decoder." if lst in crossing else "encoder."
    else:
        for lst in ordered:
            prefix[lst] = lst + "."
    for lst in ordered:
        pre = prefix[lst]
        for i, blk in results[lst].items():
            blk.name(f"{pre}blocks.{i}.", out)
        if results[lst]:
            _ends(g, results[lst], pre, out, last=lst == ordered[-1])


@dataclasses.dataclass
class _Block:
    """The roles found in one block."""

    stream_in: fx.Node | None = None
    resid: list[fx.Node | None] = dataclasses.field(default_factory=list)
    """The stream after each residual add (the last: resid_post)."""
    roles: list[str] = dataclasses.field(default_factory=list)
    """Of each residual add: "attn", "cross_attn", "mlp" or "parallel"."""
    branch: list[dict[str, fx.Node | None]] = dataclasses.field(default_factory=list)
    kernels: dict[str, _Kernel] = dataclasses.field(default_factory=dict)
    z: dict[str, fx.Node | None] = dataclasses.field(default_factory=dict)
    mlp_pre: fx.Node | None = None
    mlp_post: fx.Node | None = None
    cross: bool = False

    def name(self, pre: str, out: _RoleNames) -> None:
        out.put(self.stream_in, pre + "resid_pre")
        for role, kernel in self.kernels.items():
            out.put(kernel.q, f"{pre}{role}.q")
            out.put(kernel.k, f"{pre}{role}.k")
            out.put(kernel.v, f"{pre}{role}.v")
            out.put(kernel.scores, f"{pre}{role}.scores")
            out.put(kernel.pattern, f"{pre}{role}.pattern")
            out.put(self.z.get(role), f"{pre}{role}.z")
        mids = {"attn": "resid_mid", "cross_attn": "resid_mid_cross"}
        for i, (role, branch) in enumerate(zip(self.roles, self.branch, strict=True)):
            for part, node in branch.items():
                out.put(node, f"{pre}{part}_out")
            if i == len(self.roles) - 1:
                out.put(self.resid[i], pre + "resid_post")
            elif role in mids:
                out.put(self.resid[i], pre + mids[role])
        out.put(self.mlp_pre, pre + "mlp.pre")
        out.put(self.mlp_post, pre + "mlp.post")


def _norm_of(g: _Graph, x: fx.Node) -> list[fx.Node]:
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
            args = n.meta.get(CALL_ARGS, {}).get(s.name)
            if args is None or x not in args[0][:1]:
                continue
            m = g.module(s.module_path)
            params = list(m.parameters()) if m is not None else []
            if params and all(p.dim() == 1 for p in params) and g.shape(n) == shape:
                found.append(n)
        if within != g.path(x):
            todo.extend((u, within) for u in n.users)
    return found


def _closure(g: _Graph, x: fx.Node, inside: set[fx.Node]) -> set[fx.Node]:
    """The stream ``x`` as the block reads it: ``x``, its views, and its norms."""
    out = {x}
    todo = [x]
    while todo:
        n = todo.pop()
        nxt = [u for u in n.users if g.key(u) in _VIEWS and not (
            g.key(u) == "getitem" and _indexed_by_tensor(u))]
        nxt += _norm_of(g, n)
        for u in nxt:
            if u not in out:
                out.add(u)
                todo.append(u)
    return out


def _block(g: _Graph, inside: set[fx.Node], kernels: list[_Kernel]) -> _Block | None:
    """The roles of one block, from its nodes and its attention kernels."""
    if not inside or not kernels:
        return None
    blk = _Block()
    order = sorted(inside, key=g.index.__getitem__)
    external = {a for n in order for a in n.all_input_nodes if a not in inside}
    adds = [n for n in order if g.key(n) in _ADDS]
    first = min((k.node for k in kernels), key=g.index.__getitem__)
    feeding = g.ancestors(first, inside, set())  # masks, biases, rotary: not residual adds
    start = None
    for a in adds:
        if a in feeding:
            continue
        for x in a.all_input_nodes:
            if x in external and not g.is_param(x) and g.shape(x) == g.shape(a):
                start = x
                break
        if start is not None:
            break
    if start is None:
        return None
    blk.stream_in = start
    shape = g.shape(start)
    stream = _closure(g, start, inside)
    stops = set(stream)
    used: set[fx.Node] = set()
    kernel_nodes = {k.node: k for k in kernels}
    resid: list[fx.Node] = []
    operands: list[fx.Node] = []
    while True:
        nxt = None
        for a in adds:
            if a in used or g.index[a] <= (g.index[resid[-1]] if resid else -1):
                continue
            ins = [x for x in a.all_input_nodes if x in stream]
            if ins and len(a.all_input_nodes) == 2 and g.shape(a) is not None and \
                    _numel(g.shape(a) or ()) == _numel(shape or ()):
                nxt = a
                operands.append(ins[0])
                break
        if nxt is None:
            break
        used.add(nxt)
        resid.append(nxt)
        stream = _closure(g, nxt, inside)
        stops |= stream
    if not resid:
        return None
    # The stream after each add, as the next add (or the code after the block) reads it.
    for i, r in enumerate(resid):
        if i + 1 < len(resid):
            blk.resid.append(_full(g, operands[i + 1], shape))
        else:
            leaving = [n for n in _closure(g, r, inside)
                       if any(u not in inside and u.op != "output" for u in n.users)
                       or n is r and not any(u in inside for u in n.users)]
            leaving = [n for n in leaving if g.shape(n) == shape] or leaving
            blk.resid.append(min(leaving, key=g.index.__getitem__) if leaving else None)
    for r, s in zip(resid, operands, strict=True):
        other = [x for x in r.all_input_nodes if x is not s]
        branch = other[0] if other else None
        role, parts = _classify(g, branch, inside, stops, kernel_nodes, stream_nodes=stops)
        blk.roles.append(role)
        blk.branch.append(parts)
        for part, node in parts.items():
            if part in ("attn", "cross_attn") and node is not None:
                ks = _kernels_in(g, node, inside, stops, kernel_nodes)
                if ks:
                    kernel = ks[-1]
                    blk.kernels[part] = _Kernel(
                        kernel.node, _heads(g, kernel.q),
                        _heads(g, kernel.k, transposed=kernel.scores is not kernel.node),
                        _heads(g, kernel.v), kernel.scores, kernel.pattern)
                    blk.z[part] = _z(g, kernel.node)
                    if part == "cross_attn":
                        blk.cross = True
            if part == "mlp" and node is not None:
                blk.mlp_pre, blk.mlp_post = _mlp(g, node, inside, stops, shape)
    return blk


def _full(g: _Graph, x: fx.Node, shape: tuple[Any, ...] | None) -> fx.Node:
    """``x`` walked back through views to a value shaped like the stream."""
    for n in g.back(x, _VIEWS):
        if g.shape(n) == shape:
            return n
    return x


def _kernels_in(g: _Graph, node: fx.Node, inside: set[fx.Node], stops: set[fx.Node],
                kernels: dict[fx.Node, _Kernel]) -> list[_Kernel]:
    anc = g.ancestors(node, inside, stops)
    return [kernels[n] for n in sorted(anc & kernels.keys(), key=g.index.__getitem__)]


def _classify(g: _Graph, branch: fx.Node | None, inside: set[fx.Node], stops: set[fx.Node],
              kernels: dict[fx.Node, _Kernel], stream_nodes: set[fx.Node]
              ) -> tuple[str, dict[str, fx.Node | None]]:
    """What a residual add adds: an attention's output, the MLP's, or both (parallel)."""
    if branch is None:
        return "other", {}
    found = _kernels_in(g, branch, inside, stops, kernels)
    if not found:
        return "mlp", {"mlp": branch}
    core = g.back(branch, _PASS)[-1]
    if g.key(core) in _ADDS and len(core.all_input_nodes) == 2:
        a, b = core.all_input_nodes
        ka = _kernels_in(g, a, inside, stops, kernels)
        kb = _kernels_in(g, b, inside, stops, kernels)
        if bool(ka) != bool(kb):
            attn, mlp = (a, b) if ka else (b, a)
            if any(g.projects(n) for n in g.ancestors(mlp, inside, stops)):
                return "parallel", {"attn": attn, "mlp": mlp}
    kernel = found[-1]
    k = kernel.k
    own = k is not None and (k in stream_nodes or any(
        a in stream_nodes for x in g.ancestors(k, inside, set()) for a in x.all_input_nodes))
    role = "attn" if own else "cross_attn"
    return role, {role: branch}


def _z(g: _Graph, kernel: fx.Node) -> fx.Node | None:
    """The last value with a head dimension between the kernel and the output projection."""
    rank = len(g.shape(kernel) or ())
    best: fx.Node | None = kernel
    x = kernel
    for _ in range(16):
        users = list(x.users)
        proj = [u for u in users if g.projects(u)]
        if proj:
            return best
        views = [u for u in users if g.key(u) in _VIEWS]
        if len(views) != 1:
            return None
        x = views[0]
        if len(g.shape(x) or ()) == rank:
            best = x
    return None


def _mlp(g: _Graph, out: fx.Node, inside: set[fx.Node], stops: set[fx.Node],
         shape: tuple[Any, ...] | None) -> tuple[fx.Node | None, fx.Node | None]:
    """(mlp.pre, mlp.post) of the MLP whose output is ``out``; Nones where tokens are routed."""
    region = g.ancestors(out, inside, stops)
    projs = [n for n in region if g.projects(n)]
    if not projs or shape is None:
        return None, None
    last = [p for p in projs if not any(q is not p and q in _descendants(p) for q in projs)]
    if len(last) != 1:
        return None, None
    proj = last[0]
    weight = g.weight(proj)
    if weight is not None and len(g.shape(weight) or ()) > 2:
        return None, None  # one weight per expert
    ins = [a for a in g.tensors(proj) if a in region]
    if not ins:
        return None, None
    post = g.back(ins[0], _VIEWS - {"to", "type", "type_as", "float"})[-1]
    positions = _numel(shape[:-1])
    post_shape = g.shape(post)
    if post_shape is None or _numel(post_shape[:-1]) != positions:
        return None, None
    before = g.ancestors(post, inside, stops)
    if any(g.key(n) in _GATHERS or (g.key(n) == "getitem" and _indexed_by_tensor(n))
           for n in before):
        return None, None  # tokens routed to experts
    outputs: set[fx.Node] = set()
    for p in projs:
        if p is proj:
            continue
        todo = [p]
        while todo:
            x = todo.pop()
            if x in outputs:
                continue
            outputs.add(x)
            todo.extend(u for u in x.users if u in region and (
                g.key(u) in _VIEWS | {"split", "chunk", "unbind"}))
    act = g.back(post, _PASS)[-1]
    if g.key(act) == "mul":
        a = [g.back(x, _PASS)[-1] for x in g.tensors(act)]
        linear = [x for x in a if x in outputs]
        if len(a) == 2 and len(linear) == 1:
            act = a[0] if a[1] is linear[0] else a[1]
    if act in outputs:
        return None, post  # no activation between the projections
    reads = [x for x in g.ancestors(act, inside, stops) if x in outputs and g.shape(x) is not None]
    if not reads:
        return None, post
    pre = max(reads, key=g.index.__getitem__)
    if _numel((g.shape(pre) or ())[:-1]) != positions:
        return None, post
    return pre, post


def _ends(g: _Graph, blocks: dict[int, _Block], pre: str, out: _RoleNames, last: bool) -> None:
    """``embed``, ``pos_embed``, ``ln_final`` and (for the last stack) ``logits``."""
    first = blocks[min(blocks)]
    if first.stream_in is not None:
        anc = g.ancestors(first.stream_in, set(g.nodes), set())
        embeds = [n for n in anc if g.key(n) == "embedding"]
        tok = []
        for e in embeds:
            idx = e.args[0] if e.args else None
            if isinstance(idx, fx.Node):
                root = g.back(idx, _VIEWS)[-1]
                if root.op == "placeholder" and not g.is_param(root):
                    tok.append(e)
        if len(tok) == 1:
            out.put(g.call_of(tok[0]), pre + "embed")
            positions = (g.shape(first.stream_in) or (0, 0))[-2]
            rest = []
            for e in embeds:
                w = e.args[1] if len(e.args) > 1 and isinstance(e.args[1], fx.Node) else None
                rows = (g.shape(w) or (sympy.Integer(0),))[0] if w is not None else sympy.Integer(0)
                enough = rows >= positions  # a row per position (unknown: symbolic)
                if e is not tok[0] and enough != sympy.false:
                    rest.append((rows, e))
            if rest:
                out.put(g.call_of(max(rest, key=lambda t: int(t[0]) if t[0].is_number else 0)[1]),
                        pre + "pos_embed")
    end = blocks[max(blocks)].resid[-1] if blocks[max(blocks)].resid else None
    if end is None:
        return
    norms = _norm_of(g, end)
    final = min(norms, key=g.index.__getitem__) if norms else None
    out.put(final, pre + "ln_final")
    if not last:
        return
    start = final if final is not None else end
    shape = g.shape(end)
    outputs = [a for n in g.nodes if n.op == "output" for a in _flat(n.args)]
    after = _descendants(start)
    for o in outputs:
        s = g.shape(o)
        if o not in after or s is None or shape is None or len(s) != len(shape) or \
                s[:-1] != shape[:-1] or s[-1] == shape[-1]:
            continue
        if any(g.projects(n) for n in g.ancestors(o, after, set())):
            out.put(o, "logits")
            return


def _flat(args: Any) -> Iterable[fx.Node]:
    if isinstance(args, fx.Node):
        yield args
    elif isinstance(args, (tuple, list)):
        for a in args:
            yield from _flat(a)
    elif isinstance(args, dict):
        for a in args.values():
            yield from _flat(a)


def _descendants(n: fx.Node) -> set[fx.Node]:
    out: set[fx.Node] = set()
    todo = [n]
    while todo:
        x = todo.pop()
        if x in out:
            continue
        out.add(x)
        todo.extend(x.users)
    return out


__all__ = ["VOCABULARY", "annotate", "attention_scores"]
