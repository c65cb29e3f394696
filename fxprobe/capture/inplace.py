"""In-place hazards: which captured values a later node of a graph overwrites, and what to do.

A captured tensor must show the value as it was produced. It is at risk when a node that runs
later writes, in place, into the same storage: into the tensor itself or into a view of it.
The rule is the heart of fxprobe's correctness and lives here only, for every frontend: copy
the value, or, where one in-place op is all that overwrites it and nothing else sees the
aliasing, run that op out of place (``relu_`` as ``relu``) and copy nothing.

The engine (:class:`Hazards`) reads a graph through a small adapter (:class:`Graph`) that
reports, for each node in the order they run, an :class:`Op`: the values it makes and reads,
those its result may share storage with (views), those it writes in place, and whether it may
run out of place. Anything an adapter cannot see into (custom modules, containers, unknown
functions) counts as a writer of everything it is given, whose result is storage the graph
does not own (it may return its own state); a torch function not known to return new memory
counts as a view of its tensor arguments: the engine errs toward a copy, never toward a stale
value. Storage the graph does not own (its inputs, parameters, buffers) is never
outplaced, only copied: the caller sees a write there after the call.

Adapters: :class:`FxOps` here (fx and dynamo graphs of Python ops); the TorchScript IR and
torch.export's ATen graphs have theirs in their frontends.
"""

from __future__ import annotations

import builtins
import inspect
import operator
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import fx, nn

from ..core.ops import (
    FRESH_OPS,
    INPLACE_DUNDERS,
    INPLACE_OPERATORS,
    NN_IDENTITY,
    PASS_THROUGH_FUNCTIONS,
    PURE_OPERATORS,
    VIEW_OPS,
    is_torch_callable,
)
from ..core.site import STATE

_NONE_RESULT = frozenset({operator.setitem, "__setitem__"})
"""In-place writes whose result is None, not what they wrote (``y[0] = 1``)."""

OUT_OF_PLACE = "_fxprobe_out_of_place"
"""Attribute set on the functions the rewrite puts in place of in-place ops: they write no
argument (their result may still alias the first)."""


@dataclass(frozen=True)
class Op:
    """One node of a graph as the engine sees it (values are whatever the adapter uses as keys:
    fx nodes, TorchScript value ids)."""

    node: Any
    """The adapter's node: what :meth:`Hazards.sole_writer` hands back to be run out of place."""
    makes: tuple[Hashable, ...] = ()
    """The values it defines."""
    reads: tuple[Hashable, ...] = ()
    """The values it reads, its first argument first."""
    aliases: tuple[Hashable, ...] = ()
    """The values its results may share storage with (views, in-place ops returning their input)."""
    writes: tuple[Hashable, ...] = ()
    """The values it writes in place (everything it reads, for code the adapter cannot see)."""
    twin: bool = False
    """It writes its first argument in place and may run out of place instead."""


class Graph(Protocol):
    """What the engine asks of a frontend's graph."""

    def ops(self) -> Iterable[Op]:
        """Every node, in the order they run."""

    def owned(self, value: Hashable) -> bool:
        """False for storage the graph does not own: an input, a parameter or buffer."""

    @property
    def may_share(self) -> Callable[[Hashable, Hashable], bool] | None:
        """``(value, written)``: the IR's own alias analysis, if it has one; None: the engine
        groups values by the ops' ``aliases``."""


class _Groups:
    """Union-find over values that may share storage."""

    def __init__(self) -> None:
        self.parent: dict[Hashable, Hashable] = {}

    def find(self, n: Hashable) -> Hashable:
        root = n
        while self.parent.get(root, root) != root:
            root = self.parent[root]
        while n != root:
            nxt = self.parent.get(n, n)
            self.parent[n] = root
            n = nxt
        return root

    def union(self, a: Hashable, b: Hashable) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[ra] = rb


def _tensor_args(node: fx.Node) -> list[fx.Node]:
    found: list[fx.Node] = []

    def visit(n: fx.Node) -> fx.Node:
        found.append(n)
        return n

    fx.node.map_arg((node.args, node.kwargs), visit)
    return found


def _first_arg(node: fx.Node) -> list[fx.Node]:
    if node.args and isinstance(node.args[0], fx.Node):
        return [node.args[0]]
    return []


def _binds_inplace(fn: Callable[..., Any], node: fx.Node) -> bool:
    if node.kwargs.get("inplace") is True:
        return True
    try:
        params = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return False
    if "inplace" in params:
        i = params.index("inplace")
        return i < len(node.args) and node.args[i] is True
    return False


_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)


def _known_leaf(m: nn.Module) -> bool:
    """A ``torch.nn`` module whose effects fxprobe knows (``nn.ReLU``, ``nn.MultiheadAttention``):
    not a container (``nn.Sequential`` holding ``ReLU(inplace=True)`` writes its input), none
    of its modules in place or hooked (a hook may return or write anything)."""
    return (type(m).__module__.startswith(("torch.nn", "torch.ao.nn"))
            and not isinstance(m, _CONTAINERS)
            and not any((s is not m and getattr(s, "inplace", False) is True)
                        or s._forward_hooks or s._forward_pre_hooks for s in m.modules()))


def opaque(node: fx.Node, modules: Callable[[str], nn.Module]) -> bool:
    """Whether ``node`` runs code fxprobe cannot see into (a user module, a container, a
    module with hooks, a function not of torch): it may write anything it is given, and return
    storage the graph does not own (a module's buffer)."""
    if node.op == "call_module":
        return not _known_leaf(modules(str(node.target)))
    if node.op != "call_function" or not callable(node.target):
        return False
    fn = node.target
    return not (fn in INPLACE_OPERATORS or getattr(fn, OUT_OF_PLACE, False) or _pass_through(fn)
                or fn in PURE_OPERATORS or fn is builtins.getattr or fn in _ALIAS_FUNCTIONS
                or getattr(builtins, getattr(fn, "__name__", ""), None) is fn
                or is_torch_callable(fn))


def _state_writes(fn: Callable[..., Any], node: fx.Node) -> list[fx.Node]:
    """The arguments a torch function writes besides an ``out=``: ``F.embedding(max_norm=)``
    renormalises its weight, ``F.batch_norm(training=True)`` updates the running statistics."""
    rule = _STATE_WRITERS.get(getattr(fn, "__name__", ""))
    if rule is None:
        return []
    flag, written = rule
    try:
        bound = inspect.signature(fn).bind(*node.args, **node.kwargs).arguments
    except (TypeError, ValueError):
        return _tensor_args(node)
    if bound.get(flag) is None or bound.get(flag) is False:
        return []
    return [a for w in written if isinstance(a := bound.get(w), fx.Node)]


def _pass_through(fn: Any) -> bool:
    """A library function that returns its first argument or new memory and writes nothing."""
    name = f"{getattr(fn, '__module__', '')}.{getattr(fn, '__name__', '')}"
    return name in PASS_THROUGH_FUNCTIONS


_STATE_WRITERS = {"embedding": ("max_norm", ("weight",)),
                  "batch_norm": ("training", ("running_mean", "running_var")),
                  "instance_norm": ("use_input_stats", ("running_mean", "running_var"))}


def effects(node: fx.Node, modules: Callable[[str], nn.Module]
             ) -> tuple[list[fx.Node], list[fx.Node]]:
    """(nodes the result may alias, nodes written in place) for one node.

    Conservative where it does not know: code it cannot see (:func:`opaque`) aliases and
    writes everything it is given; a torch function or method not known to return new memory
    (``FRESH_OPS``) aliases its tensor arguments."""
    if opaque(node, modules):
        everything = _tensor_args(node)
        return everything, everything
    if node.op == "call_module":
        m = modules(str(node.target))
        writes = _first_arg(node) if getattr(m, "inplace", False) is True else []
        aliases = _first_arg(node) if writes or isinstance(m, NN_IDENTITY) else []
        return aliases, writes
    if node.op == "call_method":
        name = str(node.target)
        mutates = (name.endswith("_") and not name.startswith("_")) or name in INPLACE_DUNDERS
        writes = _first_arg(node) if mutates else []
        if mutates or name.rstrip("_") in VIEW_OPS:
            return _first_arg(node), writes
        return ([] if name in FRESH_OPS else _tensor_args(node)), writes
    if node.op == "call_function" and callable(node.target):
        fn = node.target
        out = node.kwargs.get("out")
        extra = [out] if isinstance(out, fx.Node) else []
        if fn in INPLACE_OPERATORS:
            return _first_arg(node), _first_arg(node) + extra
        if getattr(fn, OUT_OF_PLACE, False):  # fxprobe's rewrite of an in-place op
            return _first_arg(node), extra
        if fn in PURE_OPERATORS:  # ``+x`` is ``torch.positive``: x itself
            return (_first_arg(node) if fn in (operator.getitem, operator.pos) else []), extra
        if (fn is builtins.getattr and len(node.args) > 1
                and node.args[1] in _VIEW_ATTRIBUTES) or fn in _ALIAS_FUNCTIONS:
            return _first_arg(node), extra  # x.T, x.data, ...: the same storage
        if getattr(builtins, getattr(fn, "__name__", ""), None) is fn:
            return [], extra
        if _pass_through(fn):
            return _first_arg(node), extra
        name = getattr(fn, "__name__", "")
        mutates = (name.endswith("_") and not name.startswith("_")) or _binds_inplace(fn, node)
        writes = (_first_arg(node) if mutates else []) + extra + _state_writes(fn, node)
        if mutates or name.rstrip("_") in VIEW_OPS:
            return _first_arg(node) + extra, writes
        return ([] if name in FRESH_OPS else _tensor_args(node)) + extra, writes
    return [], []


_VIEW_ATTRIBUTES = frozenset({"T", "mT", "H", "mH", "data", "real", "imag"})
"""Tensor attributes that are views of the tensor (``x.T.relu_()`` writes ``x``)."""

_ALIAS_FUNCTIONS = frozenset(
    f for f in (getattr(torch._C._autograd, "_get_data_attr", None),) if f is not None)
"""What dynamo records ``x.data`` as: the same storage too."""




class FxOps:
    """The adapter of fx and dynamo graphs (Python ops; see :func:`effects`).

    ``escapes``: what the graph returns goes to code fxprobe cannot see (a traced module called
    from untraced code, a graph between dynamo graph breaks), which may write into it, and into
    what it gave the graph: the output counts as a writer of every value it returns and of
    every input (but a parameter or buffer, ``STATE``).
    """

    may_share = None

    def __init__(self, graph: fx.Graph, modules: Callable[[str], nn.Module],
                 escapes: bool = False) -> None:
        self.graph = graph
        self.modules = modules
        self.escapes = escapes

    def ops(self) -> Iterable[Op]:
        inputs = [n for n in self.graph.nodes if n.op == "placeholder" and not n.meta.get(STATE)]
        for n in self.graph.nodes:
            aliases, writes = effects(n, self.modules)
            if self.escapes and n.op == "output":  # and the graph's inputs: that code holds them
                writes = _tensor_args(n) + inputs
            first = bool(n.args) and isinstance(n.args[0], fx.Node)
            yield Op(n, () if n.op == "output" else (n,), tuple(_tensor_args(n)),
                     tuple(aliases), tuple(writes), bool(writes) and first and n.op != "output")

    def owned(self, value: Hashable) -> bool:
        """Not an input, a parameter or buffer, nor what opaque code returned (its state)."""
        return not (isinstance(value, fx.Node) and (value.op in ("placeholder", "get_attr")
                                                     or opaque(value, self.modules)))


class Hazards:
    """Answers: is a captured value overwritten by a node that runs after it, and may that
    node run out of place instead of the value being copied?

    Built from a :class:`Graph` adapter; ``Hazards(graph, modules, escapes)`` reads an fx
    graph through :class:`FxOps`.
    """

    def __init__(self, graph: Graph | fx.Graph,
                 modules: Callable[[str], nn.Module] | None = None,
                 escapes: bool = False) -> None:
        if isinstance(graph, fx.Graph):
            assert modules is not None, "an fx graph needs its modules"
            ir: Graph = FxOps(graph, modules, escapes)
        else:
            ir = graph
        self.graph = ir
        self.ops = list(ir.ops())
        self.order: dict[Any, int] = {}
        """An adapter's node -> its position."""
        self.made: dict[Hashable, int] = {}
        self.readers: dict[Hashable, list[int]] = {}
        self.groups = _Groups()
        self._writes: list[tuple[int, Hashable]] = []
        for pos, op in enumerate(self.ops):
            self.order[op.node] = pos
            for v in op.makes:
                self.made.setdefault(v, pos)
                for a in op.aliases:
                    self.groups.union(v, a)
            for v in op.reads:
                self.readers.setdefault(v, []).append(pos)
            self._writes.extend((pos, w) for w in op.writes)
        self._may_share = ir.may_share
        self._by_group: dict[Hashable, list[int]] = {}
        if self._may_share is None:
            for pos, w in self._writes:
                self._by_group.setdefault(self.groups.find(w), []).append(pos)

    def writes(self, value: Hashable) -> list[int]:
        """Positions of the ops that write storage ``value`` may share."""
        if self._may_share is None:
            return self._by_group.get(self.groups.find(value), [])
        share = self._may_share
        return [p for p, w in self._writes if w == value or share(value, w)]

    def members(self, value: Hashable) -> list[Any]:
        """Every value that may share storage with ``value`` (``value`` included)."""
        if self._may_share is None:
            root = self.groups.find(value)
            return [v for v in self.made if self.groups.find(v) == root]
        share = self._may_share
        return [v for v in self.made if v == value or share(value, v)]

    def written_after(self, value: Hashable, pos: int, *, inclusive: bool = False) -> bool:
        """Whether storage that ``value`` may share is written at or after ``pos``."""
        return any(p > pos or (inclusive and p == pos) for p in self.writes(value))

    def at_risk(self, value: Hashable) -> bool:
        """Whether a node after the one that makes ``value`` writes into it: copy it (or run
        that node out of place, :meth:`sole_writer`)."""
        return self.written_after(value, self.made.get(value, -1))

    output_at_risk = at_risk

    def input_at_risk(self, value: Hashable, consumer: Any) -> bool:
        """Whether ``value``, read by the node ``consumer``, is written there or later."""
        return self.written_after(value, self.order[consumer], inclusive=True)

    def sole_writer(self, value: Hashable) -> Any:
        """The in-place op that overwrites ``value``, when running it out of place changes no
        value but the captured one; else None. It is the first op after ``value`` that writes
        storage ``value`` may share, it writes ``value`` itself (its first argument) and nothing
        else, and it has an out-of-place twin; no view of ``value`` is made before it, nothing
        reads ``value`` after it, nor the values ``value`` was made from. Never for storage the
        graph does not own: a write into a graph input or a module's parameter or buffer is seen
        by the caller after the call (a state the model updates)."""
        mine = self.made.get(value)
        if mine is None:
            return None
        later = [p for p in self.writes(value) if p > mine]
        if not later:
            return None
        # The first write; later ones may only write what it returns (``out += identity``
        # then ``ReLU(inplace=True)``): any into a value made before it reads that value after
        # it, which the readers' check below refuses.
        pos = min(later)
        op = self.ops[pos]
        if not (op.twin and op.reads and op.reads[0] == value and set(op.writes) == {value}):
            return None
        members = self.members(value)
        if not all(self.graph.owned(m) for m in members):
            return None
        for m in members:
            at = self.made.get(m, -1)
            if m != value and at < pos and at > mine:
                return None  # a view made before the write would see it
            if at < pos and any(r > pos for r in self.readers.get(m, ())):
                return None  # read after the write: it would see the value unwritten
        return op.node


def outplace(analyse: Callable[[], Hazards], values: Mapping[Any, Hashable],
             run_out_of_place: Callable[[Any], Mapping[Hashable, Hashable] | None]
             ) -> tuple[dict[Any, Hashable], set[Any]]:
    """Run out of place each in-place op that alone overwrites a captured value.

    Args:
        analyse: the engine on the graph as it is now (called again after each change).
        values: the captured values, by a key of the caller's (a site, a name).
        run_out_of_place: rewrites one op (:meth:`Hazards.sole_writer`) into its out-of-place
            twin; returns the values it replaced (old -> new), or None where it cannot.

    Returns:
        The captured values after the rewrites, and the keys whose value needs no copy for it.
        Repeated until nothing changes: ``out += x; relu_(out)`` frees ``out`` once relu_
        runs out of place.
    """
    current = dict(values)
    saved: set[Any] = set()
    for _ in range(len(current) + 1):
        hazards = analyse()
        todo: dict[int, tuple[Any, list[Any]]] = {}
        for key, v in current.items():
            w = hazards.sole_writer(v)
            if w is not None:
                todo.setdefault(hazards.order[w], (w, []))[1].append(key)
        changed = False
        for w, keys in todo.values():
            moved = run_out_of_place(w)
            if moved is None:
                continue
            changed = True
            saved.update(keys)
            current = {k: moved.get(v, v) for k, v in current.items()}
        if not changed:
            break
    return current, saved


def settled(value: fx.Node, nodes: Iterable[fx.Node], replaced: bool = False) -> fx.Node:
    """The node whose value is ``value`` as a module call hands it on: the last of ``nodes``
    (the call's nodes after ``value``, in graph order) that writes ``value`` itself in place
    and returns it (``y.copy_(z)``, ``y.add_(b)``, the write-back of an in-place collective:
    ``dist.all_reduce(y)`` in a tensor-parallel layer), or ``value`` where none does.

    A module call's site sits on that node: on ``value`` it would show the tensor before the
    call finished writing it (a partial sum where a row-parallel layer reduces in place).
    ``replaced``: only writes that replace the value whole (``copy_``), not those that
    update it (``y += a`` makes another value, Falcon's attention + MLP sum). Writes through
    a view: :func:`capture.settle.settle`.
    """
    last, same = value, {value}
    for n in nodes:
        first = n.args[0] if n.args else None
        if replaced and not (n.op == "call_method" and n.target == "copy_"
                             or getattr(n.target, "__name__", "") == "copy_"):
            continue
        if first in same and _writes_itself(n):
            same.add(n)
            last = n
    return last


def _writes_itself(n: fx.Node) -> bool:
    """An in-place op on its first argument whose result is that argument."""
    if n.op == "call_method":
        name = str(n.target)
        return ((name.endswith("_") and not name.startswith("_")) or name in INPLACE_DUNDERS
                ) and name not in _NONE_RESULT
    if n.op == "call_function" and callable(n.target):
        name = getattr(n.target, "__name__", "")
        return n.target not in _NONE_RESULT and (
            n.target in INPLACE_OPERATORS or (name.endswith("_") and not name.startswith("_")))
    return False
