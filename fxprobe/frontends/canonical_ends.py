"""The ends of the residual stream: ``embed``, ``pos_embed``, ``ln_final`` and ``logits``
around the blocks ``canonical`` recognised, and the stream around repeated blocks called as
one op each (``dynamo_blocks``), whose own graphs name what is inside each block."""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Mapping
from typing import Any

import sympy
from torch import fx, nn

from ..core.site import SITES
from .canonical_graph import VIEWS, GraphIndex, descendants, flat_nodes, norms_after
from .dynamo_blocks import block_call, names_stream


@dataclasses.dataclass
class _Stream:
    """A block called as one op: the stream it reads and (its only element) its call."""

    stream_in: fx.Node
    resid: list[fx.Node]


def ends(g: GraphIndex, blocks: Mapping[int, Any], pre: str, out: Any, last: bool,
          lst: str, last_ran: int | None) -> None:
    """``embed``, ``pos_embed``, ``ln_final`` and (for the last stack) ``logits``: around the
    first block and the block that ran last (in graph order, whatever their index), where
    those were recognised; ``lst``: the blocks' ``ModuleList``."""
    first = min(blocks.values(), key=lambda b: g.index[b.stream_in] if b.stream_in is not None
                else len(g.nodes))
    if first.stream_in is not None:
        anc = g.ancestors(first.stream_in, set(g.nodes), set())
        embeds = [n for n in anc if g.key(n) == "embedding"]
        tok = []
        for e in embeds:
            idx = e.args[0] if e.args else None
            if isinstance(idx, fx.Node):
                root = g.back(idx, VIEWS)[-1]
                if root.op == "placeholder" and not g.is_param(root):
                    tok.append(e)
        if len(tok) == 1:
            out.put(g.call_of(tok[0]), pre + "embed")
            positions = (g.shape(first.stream_in) or (0, 0))[-2]
            rest = []
            for e in embeds:
                rows = g.rows(e)
                enough = rows >= positions  # a row per position (unknown: symbolic)
                if e is not tok[0] and enough != sympy.false:
                    rest.append((rows, e))
            if rest:
                out.put(g.call_of(max(rest, key=lambda t: int(t[0]) if t[0].is_number else 0)[1]),
                        pre + "pos_embed")
    final_block = blocks.get(last_ran) if last_ran is not None else None
    end = final_block.resid[-1] if final_block is not None and final_block.resid else None
    if end is None:
        return
    norms = [n for n in norms_after(g, end) if not any(
        s.kind == "call_module" and (s.module_path + ".").startswith(lst + ".")
        for s in n.meta.get(SITES, ()))]  # not the next block's own norm
    final = min(norms, key=g.index.__getitem__) if norms else None
    out.put(final, pre + "ln_final")
    if not last:
        return
    start = final if final is not None else end
    shape = g.shape(end)
    outputs = [a for n in g.nodes if n.op == "output" for a in flat_nodes(n.args)]
    after = descendants(start)
    for o in outputs:
        s = g.shape(o)
        if o not in after or s is None or shape is None or len(s) != len(shape) or \
                s[:-1] != shape[:-1] or s[-1] == shape[-1]:
            continue
        if any(g.projects(n) for n in g.ancestors(o, after, set())):
            out.put(o, "logits")
            return


def around_shared(g: GraphIndex, out: Any, stream_only: bool = False) -> None:
    """The stream around blocks called as one op each (``dynamo_blocks``), whose graphs of
    their own name what is inside them: each block's ``resid_pre`` (what the call reads as its
    first argument, shaped as what it returns), ``embed``, ``pos_embed``, ``ln_final`` and
    ``logits``; for the blocks of one list, each called once. ``stream_only``: the blocks'
    ``resid_pre`` and ``resid_post`` alone, for a graph whose other blocks are traced in it
    (named by the kernels found there, ends included)."""
    calls = [n for n in g.nodes if n.target is block_call]
    paths = [g.path(n) for n in calls]
    if not calls or None in paths or len(set(paths)) != len(paths):
        return
    lists = {str(p).rpartition(".")[0] for p in paths}
    lst = lists.pop()
    holder = g.module(lst)
    if lists or not isinstance(holder, nn.ModuleList):
        return
    keys = list(holder._modules)
    blocks: dict[int, _Stream] = {}
    k = _element(calls)
    for n, p in zip(calls, paths, strict=True):
        stream = n.args[2] if len(n.args) > 2 else None
        returned = n if g.shape(n) is not None else None if k is None else _read_of(n, k)
        shape = None if returned is None else g.shape(returned)
        if returned is None or not isinstance(stream, fx.Node) or shape is None \
                or g.shape(stream) != shape:
            return
        blocks[keys.index(str(p).rpartition(".")[2])] = _Stream(stream, [returned])
    for i, blk in blocks.items():
        out.put(blk.stream_in, f"blocks.{i}.resid_pre")
        out.put(blk.resid[0], f"blocks.{i}.resid_post")  # what the block returns
    if stream_only:
        return
    names_stream(calls[0])
    last = max(blocks, key=lambda i: g.index[blocks[i].resid[0]])  # type: ignore[index]
    ends(g, blocks, "", out, last=True, lst=lst, last_ran=last)


def _element(calls: list[fx.Node]) -> int | None:
    """Which element of the tuple each block returns (Bloom's and Falcon's layers return
    ``(output, attention weights)``) the next block reads as its stream: one for all the
    calls, else (or with one block, where nothing tells) None."""
    found: set[Any] = set()
    for n, nxt in zip(calls, calls[1:], strict=False):
        s = nxt.args[2] if len(nxt.args) > 2 else None
        if not (isinstance(s, fx.Node) and s.op == "call_function"
                and s.target is operator.getitem and s.args[0] is n):
            return None
        found.add(s.args[1])
    return found.pop() if len(found) == 1 else None


def _read_of(call: fx.Node, k: int) -> fx.Node | None:
    """The one read of element ``k`` of what a block call returns as a tuple: the stream."""
    reads = [u for u in call.users if u.op == "call_function" and u.target is operator.getitem
             and u.args[1] == k]
    return reads[0] if len(reads) == 1 else None
