"""What a value of a captured graph is computed from, and what its readers read after the
writes into it in place (``frontends/canonical.py``): the keys of a cross-attention come from
outside the block's stream, a static KV cache's buffer is this step's keys once written, a
row-parallel projection's output is its sum once reduced in place."""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

from ..capture.inplace import settled
from ..core.site import reach
from .canonical_graph import GraphIndex


def data_of(x: fx.Node, inside: set[fx.Node] | None = None) -> set[fx.Node]:
    """What ``x`` is computed from (``x`` too; within ``inside`` where given), not through the
    sizes it reads: a key shaped by ``k.view(x.size(0), ...)`` is not computed from ``x``."""
    return reach([x], data_inputs, where=None if inside is None else inside.__contains__)


def data_inputs(n: fx.Node) -> list[fx.Node]:
    """The inputs of ``n`` but the sizes it reads, and what is written into ``n`` in place (a
    static KV cache: ``keys = zeros(...)``, ``keys.index_copy_(2, positions, k)``)."""
    written = [a for u in n.users if writes_into(u, n) for a in u.all_input_nodes if a is not n]
    return [a for a in (*n.all_input_nodes, *written)
            if not _is_size(a.meta.get("example_value"))]


def written(u: fx.Node) -> fx.Node | None:
    """What ``u`` writes in place, its first argument (``n.index_copy_(...)``,
    ``n[:, :, positions] = k``), else None."""
    name = getattr(u.target, "__name__", u.target) if u.op == "call_function" else u.target
    first = u.args[0] if u.args else None
    if (u.op in ("call_method", "call_function") and isinstance(first, fx.Node)
            and isinstance(name, str) and (name == "setitem" or (
                name.endswith("_") and not name.startswith("_")))):
        return first
    return None


def writes_into(u: fx.Node, n: fx.Node) -> bool:
    """Whether ``u`` writes ``n`` in place (:func:`written`)."""
    return written(u) is n


def _is_size(v: Any) -> bool:
    if isinstance(v, (tuple, list)):
        return bool(v) and all(isinstance(d, (int, torch.SymInt)) for d in v)
    return isinstance(v, (int, torch.SymInt))


def computed_from(k: fx.Node, inside: set[fx.Node]) -> set[fx.Node]:
    """:func:`data_of` ``k`` within ``inside`` and the buffers its nodes write in place (a
    static KV cache's, graph inputs: this step's keys are written into them)."""
    buffers = {w for n in inside if (w := written(n)) is not None}
    return data_of(k, inside | buffers)


def not_residual(g: GraphIndex, first: fx.Node, inside: set[fx.Node]) -> set[fx.Node]:
    """The nodes of a block that no residual add can be: what its first attention kernel
    ``first`` is computed from (masks, biases, rotary; its sizes too), with what is written in
    place into what it reads (a static KV cache's positions, ``arange(n) + length``, written
    with this step's keys into the buffer), and the writes into graph inputs (state kept
    across calls: ``length.add_(n)``)."""
    found = g.ancestors(first, inside, set())
    read = found | {a for n in found for a in n.all_input_nodes}
    for u in [u for r in read for u in r.users if u in inside and writes_into(u, r)]:
        found |= g.ancestors(u, inside, set())
    return found | {n for n in inside if (w := written(n)) is not None and w.op == "placeholder"}


def after_writes(g: GraphIndex, x: fx.Node) -> fx.Node:
    """``x`` as read after the writes into it in place that follow it (a static KV cache's
    buffer: ``keys.index_copy_(2, positions, k)``): the last such write, which the readers
    after it are made to read (the same tensor, which the write returns), else ``x``."""
    writes = [u for u in x.users if writes_into(u, x)]
    if not writes:
        return x
    last = max(writes, key=g.index.__getitem__)
    for u in list(x.users):
        if g.index.get(u, -1) > g.index[last]:
            u.replace_input_with(x, last)
    return last


def reduced(g: GraphIndex, node: fx.Node) -> fx.Node:
    """``node``'s value as its readers read it: after the copies into it that follow it when
    nothing reads it before them but what computes the copy (a row-parallel projection's
    partial sum, reduced in place: ``all_reduce(y)``, ``y.copy_(reduced)``), else ``node``
    (an update such as ``y += a`` makes another value: Falcon's MLP output + attention)."""
    written = settled(node, g.nodes[g.index[node] + 1:], replaced=True)
    if written is node:
        return node
    feeding, todo = set(), [written]
    while todo:
        x = todo.pop()
        for a in x.all_input_nodes:
            if a not in feeding and g.index.get(a, -1) > g.index[node]:
                feeding.add(a)
                todo.append(a)
    early = [u for u in node.users if g.index.get(u, -1) < g.index[written]]
    return written if all(u in feeding or u is written for u in early) else node
