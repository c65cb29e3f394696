"""In-place hazards: which captured values a later node of the graph overwrites.

A captured tensor must show the value as it was produced. It is at risk when a node that runs
later writes, in place, into the same storage: into the tensor itself or into a view of it.
This pass groups nodes whose values may share storage (views, in-place ops that return their
input, modules that may hand their input back) and lists, for each group, where it is written.
Anything the pass cannot see into (custom modules, unknown functions) counts as a writer, so
it errs toward a copy, never toward a stale value.
"""

from __future__ import annotations

import builtins
import inspect
import operator
from collections.abc import Callable
from typing import Any

import torch
from torch import fx, nn

from ..core.ops import INPLACE_OPERATORS, NN_IDENTITY, PURE_OPERATORS, VIEW_OPS, is_torch_callable
from ..core.site import STATE

OUT_OF_PLACE = "_fxprobe_out_of_place"
"""Attribute set on the functions the rewrite puts in place of in-place ops: they write no
argument (their result may still alias the first)."""


class _Groups:
    """Union-find over nodes that may share storage."""

    def __init__(self) -> None:
        self.parent: dict[fx.Node, fx.Node] = {}

    def find(self, n: fx.Node) -> fx.Node:
        root = n
        while self.parent.get(root, root) is not root:
            root = self.parent[root]
        while n is not root:
            nxt = self.parent.get(n, n)
            self.parent[n] = root
            n = nxt
        return root

    def union(self, a: fx.Node, b: fx.Node) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra is not rb:
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


def effects(node: fx.Node, modules: Callable[[str], nn.Module]
             ) -> tuple[list[fx.Node], list[fx.Node]]:
    """(nodes the result may alias, nodes written in place) for one node."""
    if node.op == "call_module":
        m = modules(str(node.target))
        if type(m).__module__.startswith(("torch.nn", "torch.ao.nn")):
            writes = _first_arg(node) if getattr(m, "inplace", False) is True else []
            aliases = _first_arg(node) if writes or isinstance(m, NN_IDENTITY) else []
            return aliases, writes
        everything = _tensor_args(node)  # code fxprobe cannot see: may alias and write anything
        return everything, everything
    if node.op == "call_method":
        name = str(node.target)
        mutates = (name.endswith("_") and not name.startswith("_")) or name in (
            "__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__",
            "__imod__", "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__",
            "__irshift__",
        )
        writes = _first_arg(node) if mutates else []
        aliases = _first_arg(node) if mutates or name.rstrip("_") in VIEW_OPS else []
        return aliases, writes
    if node.op == "call_function" and callable(node.target):
        fn = node.target
        out = node.kwargs.get("out")
        extra = [out] if isinstance(out, fx.Node) else []
        if fn in INPLACE_OPERATORS:
            return _first_arg(node), _first_arg(node) + extra
        if getattr(fn, OUT_OF_PLACE, False):  # fxprobe's rewrite of an in-place op
            return _first_arg(node), extra
        if fn in PURE_OPERATORS:
            return (_first_arg(node) if fn is operator.getitem else []), extra
        if (fn is builtins.getattr and len(node.args) > 1
                and node.args[1] in _VIEW_ATTRIBUTES) or fn in _ALIAS_FUNCTIONS:
            return _first_arg(node), extra  # x.T, x.data, ...: the same storage
        if getattr(builtins, getattr(fn, "__name__", ""), None) is fn:
            return [], extra
        if is_torch_callable(fn):
            name = getattr(fn, "__name__", "")
            mutates = (name.endswith("_") and not name.startswith("_")) or _binds_inplace(fn, node)
            writes = _first_arg(node) + extra if mutates else extra
            aliases = _first_arg(node) if mutates or name.rstrip("_") in VIEW_OPS else []
            return aliases + extra, writes
        everything = _tensor_args(node)
        return everything, everything
    return [], []


_VIEW_ATTRIBUTES = frozenset({"T", "mT", "H", "mH", "data", "real", "imag"})
"""Tensor attributes that are views of the tensor (``x.T.relu_()`` writes ``x``)."""

_ALIAS_FUNCTIONS = frozenset(
    f for f in (getattr(torch._C._autograd, "_get_data_attr", None),) if f is not None)
"""What dynamo records ``x.data`` as: the same storage too."""


class Hazards:
    """Answers: is a value captured at node N overwritten by a node that runs after it?"""

    def __init__(self, graph: fx.Graph, modules: Callable[[str], nn.Module],
                 escapes: bool = False) -> None:
        """``escapes``: what the graph returns goes to code fxprobe cannot see (a traced
        module called from untraced code, a graph between dynamo graph breaks), which may
        write into it, and into what it gave the graph: the output counts as a writer of
        every value it returns and of every input (but a parameter or buffer, ``STATE``)."""
        self.order = {n: i for i, n in enumerate(graph.nodes)}
        self.groups = _Groups()
        self.writes: dict[fx.Node, list[int]] = {}
        self.writers: dict[fx.Node, list[fx.Node]] = {}
        pending: list[tuple[fx.Node, fx.Node]] = []
        inputs = [n for n in graph.nodes if n.op == "placeholder" and not n.meta.get(STATE)]
        for n in graph.nodes:
            aliases, writes = effects(n, modules)
            if escapes and n.op == "output":  # and the graph's inputs: that code holds them
                writes = _tensor_args(n) + inputs
            for a in aliases:
                self.groups.union(n, a)
            pending.extend((n, w) for w in writes)
        for writer, w in pending:
            root = self.groups.find(w)
            self.writes.setdefault(root, []).append(self.order[writer])
            self.writers.setdefault(root, []).append(writer)

    def members(self, node: fx.Node) -> list[fx.Node]:
        """Every node whose value may share storage with ``node``'s."""
        root = self.groups.find(node)
        return [n for n in self.order if self.groups.find(n) is root]

    def sole_writer(self, node: fx.Node) -> fx.Node | None:
        """The in-place op that overwrites ``node``'s value, when it is the only thing that sees
        the aliasing: it is the first write into the group after ``node`` and writes ``node``
        itself, and no reader of the group runs after it but through its result (every member
        made before it, ``node`` included, is read after it by nothing else; later writes are
        into what it returns: ``out += identity`` then ``ReLU(inplace=True)``). Running that op
        out of place then changes no value but the captured one.
        Never for storage the graph does not own: a write into a graph input or a module's
        parameter or buffer is seen by the caller after the call (a state the model updates)."""
        root = self.groups.find(node)
        start = self.order[node]
        later = [w for w in self.writers.get(root, []) if self.order[w] > start]
        if not later:
            return None
        w = min(later, key=self.order.__getitem__)
        pos = self.order[w]
        if not (w.args and w.args[0] is node):
            return None
        members = self.members(node)
        if any(m.op in ("placeholder", "get_attr") for m in members):
            return None
        if any(self.order[u] > pos for m in members if self.order[m] < pos
               for u in m.users if u is not w):
            return None
        return w

    def written_after(self, node: fx.Node, pos: int, *, inclusive: bool = False) -> bool:
        """Whether storage that ``node``'s value may share is written at or after ``pos``."""
        for p in self.writes.get(self.groups.find(node), ()):
            if p > pos or (inclusive and p == pos):
                return True
        return False

    def output_at_risk(self, node: fx.Node) -> bool:
        return self.written_after(node, self.order[node])

    def input_at_risk(self, arg: fx.Node, consumer: fx.Node) -> bool:
        return self.written_after(arg, self.order[consumer], inclusive=True)
