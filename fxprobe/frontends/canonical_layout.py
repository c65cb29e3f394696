"""Which dimension of a value is which: the layouts behind ``attn.q/k/v`` and ``attn.z``.

A canonical value has one layout on every family: q, k and v are (batch, heads, positions,
head dim), z is (batch, positions, heads, head dim). A shape alone cannot say so: Bloom's
kernel reads (batch * heads, positions, head dim), and where positions equal heads, GPT-2's
``q.view(B, T, H, d)`` has the shape of ``q.transpose(1, 2)``. So each dimension carries
labels (the atoms it holds, major first, each with its size) from the kernel's argument (or
result), through the views around it, op by op: a transpose moves labels, a reshape regroups
them (splitting an atom where a dimension cuts it: ``bh`` into ``bh.0``, ``bh.1``), an
index drops or adds one. A value is the canonical one only where its labels say so; a view
this module does not model ends the walk (the name is then absent, never guessed).
"""

from __future__ import annotations

from typing import Any

import sympy
from torch import fx

Atom = tuple[str, Any]
"""A label and its size (a sympy expression)."""

Dims = list[tuple[Atom, ...]]
"""Per dimension, the atoms it holds, major first."""

SAME = frozenset({"contiguous", "clone", "to", "type", "type_as", "float", "double", "half",
                  "bfloat16", "detach", "alias", "identity", "data", "requires_grad", "cpu",
                  "cuda", "dropout", "feature_alpha_dropout", "alpha_dropout"})
RESHAPES = frozenset({"view", "reshape", "view_as", "reshape_as", "flatten", "unflatten",
                      "ravel", "squeeze", "unsqueeze"})
SWAPS = frozenset({"transpose", "swapaxes", "swapdims"})

BATCH, HEADS, POS, DIM = ("b", "bh.0"), ("h", "h.0", "bh.1"), ("t",), ("d",)
"""The atoms each dimension of a canonical value may hold: batch, heads (the model's own:
before a grouped-query repeat splits them), positions, head dim."""


def labels(names: list[str], shape: tuple[Any, ...], batch: Any = None) -> Dims:
    """One atom per dimension (none for a dimension of size 1). ``bh`` (batch * heads) is
    ``h`` where the batch (the stream's first dimension) is 1, ``b`` where it is the batch."""
    out: Dims = []
    for n, s in zip(names, shape, strict=True):
        if n == "bh" and batch is not None:
            n = "h" if _is_one(batch) else "b" if sympy.simplify(s - batch) == 0 else n
        out.append(() if _is_one(s) else ((n, s),))
    return out


def _is_one(x: Any) -> bool:
    return bool(sympy.simplify(x - 1) == 0)


def regroup(dims: Dims, shape: tuple[Any, ...]) -> Dims | None:
    """The same elements, row-major, laid out as ``shape``; None where no regrouping fits."""
    atoms = [a for d in dims for a in d if not _is_one(a[1])]
    out: Dims = []
    i = 0
    for s in shape:
        group: list[Atom] = []
        rest = sympy.Integer(1) * s
        while not _is_one(rest):
            if i >= len(atoms):
                return None
            name, size = atoms[i]
            more = sympy.simplify(rest / size)
            if _is_one(more):
                group.append(atoms[i])
                i += 1
                rest = sympy.Integer(1)
            elif sympy.fraction(more)[1] == 1:  # the atom fits whole, the dimension goes on
                group.append(atoms[i])
                i += 1
                rest = more
            else:
                cut = sympy.simplify(size / rest)
                if not (cut.is_Integer or sympy.fraction(cut)[1] == 1):
                    return None
                group.append((name + ".0", rest))
                atoms[i] = (name + ".1", cut)
                rest = sympy.Integer(1)
        out.append(tuple(group))
    return out if i == len(atoms) else None


def _dims_arg(n: fx.Node, rank: int) -> list[int] | None:
    dims: Any = n.kwargs.get("dims") or ()
    args: list[Any] = list(n.args[1:]) or list(dims)
    if len(args) == 1 and isinstance(args[0], (tuple, list)):
        args = list(args[0])
    if not all(isinstance(a, int) for a in args):
        return None
    return [a % rank if rank else a for a in args]


def _index(n: fx.Node, rank_in: int) -> list[Any] | None:
    """``x[...]``'s items with the ellipsis spelt out: ints, full slices and Nones only."""
    idx = n.args[1] if len(n.args) > 1 else None
    items = list(idx) if isinstance(idx, tuple) else [idx]
    if not all(i is None or i is Ellipsis or isinstance(i, int) or (
            isinstance(i, slice) and i == slice(None)) for i in items):
        return None
    taken = sum(1 for i in items if i is not None and i is not Ellipsis)
    if Ellipsis in items:
        at = items.index(Ellipsis)
        items[at:at + 1] = [slice(None)] * (rank_in - taken)
    return items + [slice(None)] * (rank_in - sum(1 for i in items if i is not None))


def back(g: Any, n: fx.Node, out: Dims) -> Dims | None:
    """The labels of the value ``n`` reads (its first tensor input), from ``n``'s own."""
    key = g.key(n)
    src = n.args[0] if n.args and isinstance(n.args[0], fx.Node) else None
    shape = g.shape(src)
    if src is None or shape is None:
        return None
    if key in SAME:
        return list(out)
    if key in RESHAPES:
        return regroup(out, shape)
    if key in SWAPS or key == "permute" or key == "t":
        perm = _perm(n, len(out))
        if perm is None:
            return None
        inp: Dims = [()] * len(out)
        for i, p in enumerate(perm):
            inp[p] = out[i]
        return inp
    if key in ("expand", "expand_as", "broadcast_to"):
        lead = len(out) - len(shape)
        return [() if _is_one(s) else out[j + lead] for j, s in enumerate(shape)]
    if key == "getitem":
        items = _index(n, len(shape))
        if items is None:
            return None
        inp, j = [], 0
        for k, item in enumerate(items):
            if item is None:
                j += 1
            elif isinstance(item, int):
                inp.append(((f"_{k}", shape[len(inp)]),))
            else:
                inp.append(out[j])
                j += 1
        return inp if len(inp) == len(shape) else None
    return None


def forward(g: Any, n: fx.Node, inp: Dims) -> Dims | None:
    """The labels of ``n``'s value, from those of the value it reads."""
    key = g.key(n)
    shape = g.shape(n)
    if shape is None:
        return None
    if key in SAME:
        return list(inp)
    if key in RESHAPES:
        return regroup(inp, shape)
    if key in SWAPS or key == "permute" or key == "t":
        perm = _perm(n, len(inp))
        return None if perm is None else [inp[p] for p in perm]
    return None


def _perm(n: fx.Node, rank: int) -> list[int] | None:
    """The permutation a transpose or permute applies: output dim i is input dim perm[i]."""
    key = n.target if n.op == "call_method" else getattr(n.target, "__name__", "")
    dims = _dims_arg(n, rank) if key not in ("t",) else [1, 0]
    if dims is None:
        return None
    if key == "permute":
        return dims if sorted(dims) == list(range(rank)) else None
    if len(dims) != 2:
        return None
    perm = list(range(rank))
    perm[dims[0]], perm[dims[1]] = perm[dims[1]], perm[dims[0]]
    return perm


def matches(dims: Dims | None, order: tuple[tuple[str, ...], ...]) -> bool:
    """Each dimension holds one atom, of the kinds ``order`` lists (see ``BATCH``...), or
    none where its size is 1."""
    return dims is not None and len(dims) == len(order) and all(
        (len(d) == 1 and d[0][0] in kinds) or not d
        for d, kinds in zip(dims, order, strict=True))


def per_head(g: Any, n: fx.Node | None, transposed: bool = False, batch: Any = None
             ) -> fx.Node | None:
    """The earliest value the kernel argument ``n`` is a view of that is laid out as
    (batch, heads, positions, head dim): the model's own heads, after rotary. ``n`` is
    (batch, heads, positions, head dim), or (batch * heads, ...) as Bloom's ``bmm`` reads it;
    ``transposed``: the last two swapped (``k.T``); ``batch``: the stream's batch size."""
    shape = g.shape(n) if n is not None else None
    if n is None or shape is None or len(shape) not in (3, 4):
        return None
    names = ["b", "h", "t", "d"] if len(shape) == 4 else ["bh", "t", "d"]
    if transposed:
        names[-2:] = names[-1:-3:-1]
    dims: Dims | None = labels(names, shape, batch)
    best, prev = None, n
    for x in g.back(n, frozenset(SAME | RESHAPES | SWAPS | {"permute", "t", "expand",
                                                            "expand_as", "broadcast_to",
                                                            "getitem"})):
        if x is not n:
            dims = back(g, prev, dims) if dims is not None else None
        if dims is None:
            break
        if matches(dims, (BATCH, HEADS, POS, DIM)):
            best = x
        prev = x
    return best


def z_of(g: Any, kernel: fx.Node, batch: Any = None) -> fx.Node | None:
    """The last value between the kernel and the output projection (the first op after it that
    reads a weight) laid out as (batch, positions, heads, head dim)."""
    shape = g.shape(kernel)
    if shape is None or len(shape) not in (3, 4):
        return None
    dims: Dims | None = labels(["b", "h", "t", "d"] if len(shape) == 4 else ["bh", "t", "d"],
                               shape, batch)
    best: fx.Node | None = None
    x = kernel
    for _ in range(16):
        users = list(x.users)
        if any(g.projects(u) for u in users):
            return best
        views = [u for u in users if g.key(u) in SAME | RESHAPES | SWAPS | {"permute", "t"}]
        if len(views) != 1:
            return None
        x = views[0]
        dims = forward(g, x, dims) if dims is not None else None
        if matches(dims, (BATCH, POS, HEADS, DIM)):
            best = x
    return None
