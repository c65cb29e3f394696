"""One vocabulary for every transformer: canonical names derived from a captured graph.

Beside its own name (``model.layers.3.add_1``), a site of a transformer answers to the name
its role has in every family (``blocks.3.resid_post``): the name goes into
``Site.canonical``, which name and glob selectors and ``tapped.taps[...]`` read. Nothing here
knows an architecture by name; each role is found from the structure of the graph and of the
module tree:

- **blocks**: an attention kernel (``F.scaled_dot_product_attention``, or a softmax whose
  probabilities multiply the values; the scores by ``matmul``, ``bmm`` or ``baddbmm``, from q
  and k computed in the block itself, or beside an attention of the block's own from keys
  the graph is given: a decoder step's cached cross-attention keys; in a torch.fx graph also
  a call of ``nn.MultiheadAttention``, whose insides have no names) inside a child of a
  ``ModuleList`` or ``Sequential`` whose children are distinct modules of one class; the
  child's position is ``L``. A block run more than once in a
  graph (a shared layer) has no names. Several such lists are several stacks: the one whose
  blocks hold a cross-attention (keys and values from outside the block's stream) is
  ``decoder.``, the other ``encoder.``; one list alone is ``decoder.`` where it cross-attends
  (the encoder's output given: ``generate()``).
- **resid_pre**: the input of the block that one of the block's additions reads directly
  (the residual add: an add whose one operand is the incoming stream). The stream then runs
  through the residual adds in order; after each, it is the add's value, or the norm of it
  when the block normalizes the sum (post-LN, as BERT).
- **attn_out / mlp_out**: the other operand of each residual add: an attention's when an
  attention kernel is among its ancestors (a ``cross_attn_out`` when that kernel's keys come
  neither from the stream nor from any block of the same list), the MLP's when none is. An
  operand that is itself the sum of an attention output and an MLP output is a parallel block
  (GPT-J, GPT-NeoX, Falcon): there is no ``resid_mid``.
- **resid_mid** (and **resid_mid_cross**): the stream between two residual adds, where the
  second add's branch reads it (``x + attn(x) + mlp(x)`` as two adds is parallel: none);
  **resid_post**: the stream that leaves the block.
- **attn.q/k/v**: the kernel's arguments, walked back through views and head repeats (so the
  model's own key/value heads, after rotary; a static KV cache's buffer as the kernel reads
  it, after this step's writes into it; a decoder step's cached cross-attention keys, a
  graph input, on a site of its own: ``canonical_sites``); **attn.scores**: the softmax's
  input, or beside SDPA the ``attention_scores`` site computed from its arguments;
  **attn.pattern**: the softmax, or beside SDPA the ``attention_probs`` site; **attn.z**: the
  last value shaped per head between the kernel and the output projection (the first op
  after it that reads a weight).
- **mlp.post**: what the MLP's output projection (its last op reading a weight) reads;
  **mlp.pre**: what its activation reads: the projection output from which ``mlp.post`` is
  computed other than by a product with another projection output (the gate's up
  projection). Absent where tokens are routed to experts (MoE): no value holds one row per
  position.
- **embed / pos_embed**: the embedding lookups added into the first block's stream: the one
  indexed by a graph input is ``embed``; the largest other table, with at least as many rows
  as positions, ``pos_embed``.
- **ln_final**: a norm (a module whose parameters are all one-dimensional and whose output has
  its input's shape), outside the blocks, that reads the stream of the block that ran last;
  **logits**: a value the graph returns, computed from that stream through an op reading a
  weight, one row per position.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

from torch import fx, nn

from ..core.site import KERNEL, SITES, Site
from .attention import attention_scores
from .canonical_data import computed_from, data_inputs, data_of, not_residual
from .canonical_ends import around_shared, ends
from .canonical_graph import (
    ADDS,
    PASS,
    FxIndex,
    GraphIndex,
    Kernel,
    closure,
    find_kernels,
    full_of,
    kernels_in,
    mlp_points,
    numel_of,
)
from .canonical_layout import per_head, z_of
from .canonical_sites import RoleNames, give
from .dynamo_names import NamedGraph, StableNamer

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


def annotate(graph: fx.Graph, named: NamedGraph, *, root: nn.Module, root_path: str,
             traced: bool = False, namer: StableNamer | None = None, repeat: int = 0
             ) -> NamedGraph:
    """Add canonical names to the sites of a graph dynamo captured, or of one torch.fx traced
    whole (``traced``; ``runtime.shapes.with_canonical``), see the module docstring.

    Beside each SDPA call, an ``attention_scores`` site is added too. A graph without an
    attention kernel inside a repeated block comes back unchanged.

    Args:
        graph: the named graph (its nodes carry their sites).
        named: what ``name_graph`` returned for it.
        root: the module the dynamo region runs.
        root_path: its path in the model.
        traced: the graph is one torch.fx traced (read by ``FxIndex``; each node's
            ``meta["example_value"]`` from a run on fake tensors): no probabilities or scores
            sites beside SDPA, so its ``attn.pattern``/``attn.scores`` are absent.
        namer: the region's namer, for a site of keys or values the graph is given (a
            decoder step's cached cross-attention keys: ``canonical_sites.give``).
        repeat: the graph's run for one module instance in a forward, as ``name_graph``'s.
    """
    g = (FxIndex if traced else GraphIndex)(graph, root, root_path)
    scores: dict[fx.Node, Site] = {}
    for node, probs in named.sdpa.items():
        head, sep, tail = probs.name.rpartition("attention_probs")
        scores[node] = Site(f"{head}attention_scores{tail}" if sep else probs.name + "_scores",
                            "dynamo", "call_function", attention_scores, probs.module_path)
    kernels = find_kernels(g, named)
    fused = {k.node for k in kernels if k.node is k.pattern}  # SDPA calls
    for kernel in kernels:  # what reads the keys and values (``core.site.unedited``)
        for reader in (kernel.node, kernel.qk):
            if reader is not None:
                reader.meta[KERNEL] = True
    out = RoleNames()
    if kernels:
        _name_all(g, kernels, named, scores, out)
        # Blocks called as one op each beside blocks traced in the graph (a cache call whose
        # sliding-window layers are traced in place): the stream around the ops too.
        around_shared(g, out, stream_only=True)
    else:  # blocks called as one op each (dynamo_blocks): the stream around them
        around_shared(g, out)
    if not out.names and not scores:
        return named
    return give(graph, g, named, scores, out, fused, namer, repeat)


def _blocks(g: GraphIndex, kernels: list[Kernel]) -> dict[str, dict[int, str]]:
    """The repeated blocks that hold the kernels: {ModuleList path: {index: block path}}."""
    stacks: dict[str, dict[int, str]] = {}
    for k in kernels:
        path = g.path(k.node) or ""
        parts = path.split(".")
        for i in range(len(parts) - 1, 0, -1):
            parent, child = ".".join(parts[:i]), parts[i]
            lst = g.module(parent)
            if isinstance(lst, (nn.ModuleList, nn.Sequential)) and len(lst) > 0 and len(
                    {type(m) for m in lst}) == 1 and len({id(m) for m in lst}) == len(lst):
                # (one module listed twice runs more than once: no index per call); a block's
                # index is its position (torchvision names a Sequential's: encoder_layer_3)
                keys = list(lst._modules)
                if child in keys:
                    stacks.setdefault(parent, {})[keys.index(child)] = f"{parent}.{child}"
                    break
    return stacks


def _name_all(g: GraphIndex, kernels: list[Kernel], named: NamedGraph,
              scores: dict[fx.Node, Site], out: RoleNames) -> None:
    stacks = _blocks(g, kernels)
    if not stacks:
        return
    members: dict[str, set[fx.Node]] = {}
    for n in g.nodes:
        p = g.path(n)
        if p is None:
            continue
        for blocks in stacks.values():
            for b in blocks.values():
                if p == b or p.startswith(b + "."):
                    members.setdefault(b, set()).add(n)
    by_block: dict[str, list[Kernel]] = {}
    cached: dict[str, list[Kernel]] = {}
    for k in kernels:
        path = g.path(k.node) or ""
        for blocks in stacks.values():
            for b in blocks.values():
                inside = members.get(b, set())
                if not (path == b or path.startswith(b + ".")) or not all(
                        x is None or x in inside for x in (k.q, k.qk)):
                    continue
                # q and k computed in this block, not read from another block's internals;
                # or keys the graph is given beside an attention of the block's own (a
                # decoder step's cross-attention reads the encoder's keys from the cache)
                if k.k is None or k.k in inside:
                    by_block.setdefault(b, []).append(k)
                elif g.given(k.k):
                    cached.setdefault(b, []).append(k)
    for b, ks in cached.items():
        if b in by_block:
            by_block[b] = sorted([*by_block[b], *ks], key=lambda k: g.index[k.node])
    calls = Counter(s.module_path for n in g.nodes for s in n.meta.get(SITES, ())
                    if s.kind == "call_module")
    results: dict[str, dict[int, _Block]] = {}
    last_ran: dict[str, int | None] = {}
    for lst, blocks in stacks.items():
        results[lst] = {}
        list_nodes = set().union(*(members.get(b, set()) for b in blocks.values()))
        for i, b in sorted(blocks.items()):
            if calls[b] > 1:  # one block run several times: its calls would share names
                continue
            blk = _block(g, members.get(b, set()), by_block.get(b, []), list_nodes)
            if blk is not None:
                results[lst][i] = blk
        ran = [(max(g.index[n] for n in members[b]), i) for i, b in blocks.items()
               if members.get(b)]
        last_ran[lst] = max(ran)[1] if ran else None
    crossing = [lst for lst, r in results.items() if any(b.cross for b in r.values())]
    ordered = sorted(results, key=lambda lst: min(
        (g.index[b.stream_in] for b in results[lst].values() if b.stream_in is not None),
        default=len(g.nodes)))
    prefix: dict[str, str] = {}
    if len(ordered) == 1:  # a decoder run alone (its encoder's output given): ``decoder.``
        prefix[ordered[0]] = "decoder." if crossing else ""
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
            ends(g, results[lst], pre, out, last=lst == ordered[-1], lst=lst,
                  last_ran=last_ran[lst])


@dataclasses.dataclass
class _Block:
    """The roles found in one block."""

    stream_in: fx.Node | None = None
    resid: list[fx.Node | None] = dataclasses.field(default_factory=list)
    """The stream after each residual add (the last: resid_post)."""
    roles: list[str] = dataclasses.field(default_factory=list)
    """Of each residual add: "attn", "cross_attn", "mlp" or "parallel"."""
    branch: list[dict[str, fx.Node | None]] = dataclasses.field(default_factory=list)
    kernels: dict[str, Kernel] = dataclasses.field(default_factory=dict)
    z: dict[str, fx.Node | None] = dataclasses.field(default_factory=dict)
    mlp_pre: fx.Node | None = None
    mlp_post: fx.Node | None = None
    cross: bool = False
    no_mid: set[int] = dataclasses.field(default_factory=set)
    """The adds whose value no later branch reads (parallel branches): not a resid_mid."""

    def name(self, pre: str, out: RoleNames) -> None:
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
            elif role in mids and i not in self.no_mid:
                out.put(self.resid[i], pre + mids[role])
        out.put(self.mlp_pre, pre + "mlp.pre")
        out.put(self.mlp_post, pre + "mlp.post")


def _block(g: GraphIndex, inside: set[fx.Node], kernels: list[Kernel],
           list_nodes: set[fx.Node]) -> _Block | None:
    """The roles of one block, from its nodes and its attention kernels (``list_nodes``: the
    nodes of every block of its list)."""
    if not inside or not kernels:
        return None
    blk = _Block()
    order = sorted(inside, key=g.index.__getitem__)
    external = {a for n in order for a in n.all_input_nodes if a not in inside}
    adds = [n for n in order if g.key(n) in ADDS]
    first = min((k.node for k in kernels), key=g.index.__getitem__)
    feeding = not_residual(g, first, inside)
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
    stream = closure(g, start, inside)
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
                    numel_of(g.shape(a) or ()) == numel_of(shape or ()):
                nxt = a
                operands.append(ins[0])
                break
        if nxt is None:
            break
        used.add(nxt)
        resid.append(nxt)
        stream = closure(g, nxt, inside)
        stops |= stream
    if not resid:
        return None
    batch = shape[0] if shape else None
    # The stream after each add, as the next add (or the code after the block) reads it.
    for i, r in enumerate(resid):
        if i + 1 < len(resid):
            blk.resid.append(full_of(g, operands[i + 1], shape))
        else:
            leaving = [n for n in closure(g, r, inside)
                       if any(u not in inside and u.op != "output" for u in n.users)
                       or n is r and not any(u in inside for u in n.users)]
            leaving = [n for n in leaving if g.shape(n) == shape] or leaving
            blk.resid.append(min(leaving, key=g.index.__getitem__) if leaving else None)
    for i, (r, s) in enumerate(zip(resid, operands, strict=True)):
        other = [x for x in r.all_input_nodes if x is not s]
        branch = other[0] if other else None
        role, parts = _classify(g, branch, inside, stops, kernel_nodes, stream_nodes=stops,
                                foreign=list_nodes - inside)
        if i > 0 and (branch is None or not closure(g, resid[i - 1], inside) & g.ancestors(
                branch, inside, set())):
            # ``(x + attn(x)) + mlp(x)``: the branch reads the block's input, not the stream
            # after the previous add (a parallel block written as two adds): no resid_mid
            blk.no_mid.add(i - 1)
        blk.roles.append(role)
        blk.branch.append(parts)
        for part, node in parts.items():
            if part in ("attn", "cross_attn") and node is not None:
                ks = kernels_in(g, node, inside, stops, kernel_nodes)
                if ks and ks[-1].opaque:  # a module call: nothing inside it is a value
                    blk.kernels[part] = Kernel(ks[-1].node, None, None, None, None, None)
                elif ks:
                    kernel = ks[-1]
                    blk.kernels[part] = Kernel(
                        kernel.node, per_head(g, kernel.q, batch=batch),
                        per_head(g, kernel.k, transposed=kernel.scores is not kernel.node,
                                 batch=batch),
                        per_head(g, kernel.v, batch=batch), kernel.scores, kernel.pattern)
                    blk.z[part] = z_of(g, kernel.node, batch)
                    if part == "cross_attn":
                        blk.cross = True
            if part == "mlp" and node is not None:
                blk.mlp_pre, blk.mlp_post = mlp_points(g, node, inside, stops, shape)
    return blk


def _classify(g: GraphIndex, branch: fx.Node | None, inside: set[fx.Node], stops: set[fx.Node],
              kernels: dict[fx.Node, Kernel], stream_nodes: set[fx.Node],
              foreign: set[fx.Node]) -> tuple[str, dict[str, fx.Node | None]]:
    """What a residual add adds: an attention's output, the MLP's, or both (parallel).
    ``foreign``: the nodes of the other blocks of the list (a key computed from them is
    neither the block's own stream nor an encoder's output: not named)."""
    if branch is None:
        return "other", {}
    found = kernels_in(g, branch, inside, stops, kernels)
    if not found:
        return "mlp", {"mlp": branch}
    core = g.back(branch, PASS)[-1]
    if g.key(core) in ADDS and len(core.all_input_nodes) == 2:
        a, b = core.all_input_nodes
        ka = kernels_in(g, a, inside, stops, kernels)
        kb = kernels_in(g, b, inside, stops, kernels)
        if bool(ka) != bool(kb):
            attn, mlp = (a, b) if ka else (b, a)
            if any(g.projects(n) for n in g.ancestors(mlp, inside, stops)):
                return "parallel", {"attn": attn, "mlp": mlp}
    kernel = found[-1]
    k = kernel.k
    # What the keys are computed from, not their sizes (``k.view(x.size(0), ...)`` in fx's
    # graph reads the stream's size: cross-attention keys are no less the encoder's).
    data = computed_from(k, inside) if k is not None else set()
    own = k is not None and (k in stream_nodes or any(
        a in stream_nodes for x in data for a in data_inputs(x)))
    if not own and (k is None or data_of(k) & foreign):
        return "other", {}
    role = "attn" if own else "cross_attn"
    return role, {role: branch}


__all__ = ["VOCABULARY", "annotate", "attention_scores"]
