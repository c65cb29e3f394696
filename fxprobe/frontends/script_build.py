"""The TorchScript rewrite: a :class:`~frontends.script.ScriptGraph` -> a tapped ScriptModule.

:func:`rewrite` makes the inlined graph return ``(output, (values...))``::

    %x.5 = aten::conv2d(...)          %x.5 = aten::conv2d(...)
    %x.9 = aten::relu_(%x.5)    ->    %c = aten::clone(%x.5, None)   # relu_ overwrites %x.5
    return (%x.9)                     %x.9 = aten::relu_(%x.5)
                                      return ((%x.9, (%c, %x.9)))

Where that in-place op is the only one to overwrite the value and nothing else sees it, it runs
out of place instead (``aten::relu``), and no copy is made. A value defined inside a
``prim::If`` leaves it as an ``Optional`` output of the ``If`` (None on the branch not taken).
:func:`build_module` wraps the graph in a new ScriptModule whose ``model`` is the user's module
(shared, unchanged).
"""

from __future__ import annotations

import itertools
import linecache
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn

from ..capture.inplace import Hazards, Op, outplace
from ..core.errors import UnsupportedModelError
from ..core.ops import NO_TWIN
from ..core.site import Site
from .script import Graph, Node, ScriptGraph, Value, quiet_jit

_counter = itertools.count()


# -- in-place hazards ---------------------------------------------------------------------------

_schema_cache: dict[str, list[int]] = {}


def _written_positions(node: Node) -> list[int] | None:
    """Positions of the inputs an op writes (``Tensor(a!)``); None: unknown, assume all."""
    kind = node.kind()
    if kind in ("prim::CallMethod", "prim::CallFunction", "prim::PythonOp"):
        return None
    text = node.schema()
    if text == "(no schema)":
        return []
    found = _schema_cache.get(text)
    if found is None:
        args = torch._C.parse_schema(text).arguments
        found = [i for i, a in enumerate(args) if a.alias_info is not None
                 and a.alias_info.is_write]
        _schema_cache[text] = found
    return found


def _all_nodes(block: Any) -> Iterator[Node]:
    """Every node in the order it runs: an ``If`` or ``Loop`` after its blocks (its outputs
    exist once they ran), each block's return last (it reads what the block hands out)."""
    for n in block.nodes():
        for b in n.blocks():
            yield from _all_nodes(b)
        yield n
    yield block.returnNode()


class ScriptOps:
    """The in-place engine's adapter (:class:`~fxprobe.capture.inplace.Hazards`) of an inlined
    TorchScript graph; values are ``Value.unique()`` ids.

    TorchScript's own alias analysis (``AliasDb``) says which values may share memory, views
    and containers included; the writers are the ops whose schema marks an input ``(a!)``, and
    any call fxprobe could not inline. An aten in-place op outside loops may run out of place.
    """

    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self.db = graph.alias_db()
        self.values: dict[int, Value] = {}
        """Every value the graph makes, by id."""
        self._state: dict[int, bool] = {}
        self._set_attrs = [n.inputsAt(1) for n in graph.findAllNodes("prim::SetAttr")
                           if n.inputsAt(1).type().kind() != "NoneType"]
        """Values stored into module attributes: a later ``GetAttr`` may be any of them."""

    def ops(self) -> Iterator[Op]:
        g = self.graph
        inputs = list(g.inputs())
        self.values.update((v.unique(), v) for v in inputs)
        yield Op(g.param_node(), tuple(v.unique() for v in inputs))
        for n in _all_nodes(g.block()):
            if _dead(n):
                continue  # F.relu(x, inplace=False) inlined: relu_ sits in a branch never taken
            outs = list(n.outputs())
            self.values.update((v.unique(), v) for v in outs)
            inputs = list(n.inputs())
            pos = _written_positions(n)
            written = inputs if pos is None else [inputs[i] for i in pos if i < len(inputs)]
            kind = n.kind()
            twin = (kind.startswith("aten::") and kind.endswith("_") and not kind.endswith("__")
                    and kind[6:] not in NO_TWIN and not _in_loop(n))
            yield Op(n, tuple(v.unique() for v in outs), tuple(v.unique() for v in inputs),
                     writes=tuple(v.unique() for v in written), twin=twin)

    def may_share(self, value: Hashable, written: Hashable) -> bool:
        v, x = self.values[value], self.values[written]  # type: ignore[index]
        if self.is_state(x) and not self.is_state(v) and not any(
                self.db.may_contain_alias(v, s) for s in self._set_attrs):
            return False  # a module's state update cannot overwrite a computed tensor, unless
        return bool(self.db.may_contain_alias(v, x))  # it was stored in the module (SetAttr)

    def owned(self, value: Hashable) -> bool:
        v = self.values[value]  # type: ignore[index]
        return v.node().kind() != "prim::Param" and not self.is_state(v)

    def is_state(self, v: Value) -> bool:
        key = v.unique()
        found = self._state.get(key)
        if found is None:
            found = self._state[key] = _is_state(v)
        return found


def _in_loop(node: Node) -> bool:
    owner = node.owningBlock().owningNode()
    while owner is not None:
        if owner.kind() == "prim::Loop":
            return True
        owner = owner.owningBlock().owningNode()
    return False


def _outplace(g: Graph, w: Node) -> Value | None:
    """Replace the in-place op ``w`` (``aten::add_(x, y)``) by its out-of-place twin; its result.

    The twin's result is used where it is what ``w`` would have left in ``x``, the same dtype
    and shape; else ``w`` runs on a copy of ``x``, for eager's cast (``float16 += float32``)
    or eager's error (a float result into an integer ``x``, a broadcast larger than ``x``)::

        %r = aten::add(%x, %y, %a)
        %same = <dtype and size of %r == those of %x>
        %out = prim::If(%same)
          block0(): -> (%r)
          block1(): %c = aten::clone(%x, None); %w = aten::add_(%c, %y, %a) -> (%w)
    """
    inputs = list(w.inputs())
    with g.insert_point_guard(w):
        new = g.insertNode(g.create(w.kind()[:-1], inputs, 1))
        if new.schema() == "(no schema)":  # no out-of-place twin with this signature
            new.destroy()
            return None
        result = new.output()
        result.setType(torch._C.TensorType.get())
        same = g.insertGraph(_same_as_written().graph, [inputs[0], result])[0]
        choice = g.insertNode(g.create("prim::If", [same], 1))
        kept, redone = choice.addBlock(), choice.addBlock()
        kept.registerOutput(result)
        with g.insert_point_guard(redone.returnNode()):
            copy = _insert_clone(g, inputs[0])
            again = g.insertNode(g.create(w.kind(), [copy, *inputs[1:]], 1)).output()
            again.setType(w.output().type())
        redone.registerOutput(again)
    out = choice.output()
    out.setType(w.output().type())
    w.output().replaceAllUsesWith(out)
    w.destroy()
    return out


_SAME: list[Any] = []


def _same_as_written() -> Any:
    """A scripted ``(x, out) -> bool``: ``out`` has ``x``'s dtype and size."""
    if not _SAME:
        def same(x: torch.Tensor, out: torch.Tensor) -> bool:
            return out.dtype == x.dtype and out.size() == x.size()

        with quiet_jit():
            _SAME.append(torch.jit.script(same))
    return _SAME[0]


def _dead(node: Node) -> bool:
    """Whether ``node`` sits in a ``prim::If`` branch that a constant condition never takes."""
    while True:
        block = node.owningBlock()
        owner = block.owningNode()
        if owner is None:
            return False
        cond = owner.inputsAt(0).node() if owner.kind() == "prim::If" else None
        if cond is not None and cond.kind() == "prim::Constant" and node.outputsSize():
            taken = 0 if cond.output().toIValue() else 1
            key = node.outputsAt(0).unique()
            for i, b in enumerate(owner.blocks()):
                if i != taken and any(o.unique() == key for n in b.nodes() for o in n.outputs()):
                    return True
        node = owner


def _is_state(v: Value) -> bool:
    """Whether ``v`` is (a view of) module state: AliasDb puts module attributes and inputs in
    one set, but a running-statistics update (BatchNorm's ``num_batches_tracked.add_``) cannot
    overwrite a tensor computed from the inputs."""
    for _ in range(64):
        n = v.node()
        if n.kind() == "prim::GetAttr":
            return True
        if not n.kind().startswith("aten::") or n.inputsSize() == 0:
            return False
        v = n.inputsAt(0)
    return False


# -- the rewrite --------------------------------------------------------------------------------

def _is_tensor(v: Value) -> bool:
    return v.type().kind() == "TensorType"


def _insert_after(g: Graph, v: Value,
                  make: Callable[[], Value]) -> Value:
    """Insert ``make()``'s nodes right after ``v`` is defined, in its block."""
    d = v.node()
    if d.kind() == "prim::Param":
        point = next(iter(g.nodes()), None) or g.return_node()
    else:
        block = d.owningBlock()
        nodes = list(block.nodes())
        key = v.unique()
        at = next(i for i, n in enumerate(nodes)
                  if any(o.unique() == key for o in n.outputs()))
        point = nodes[at + 1] if at + 1 < len(nodes) else block.returnNode()
    with g.insert_point_guard(point):
        return make()


def _lift(g: Graph, v: Value) -> Value:
    """Bring ``v`` out of the ``prim::If`` blocks around it, as Optional (None if not run)."""
    while True:
        block = v.node().owningBlock()
        owner = block.owningNode()
        if owner is None:
            return v
        if owner.kind() != "prim::If":
            raise UnsupportedModelError(
                f"fxprobe cannot bring a value out of a {owner.kind()} block")
        block.registerOutput(v)
        width = len(list(block.outputs()))
        for other in owner.blocks():
            if len(list(other.outputs())) < width:
                with g.insert_point_guard(other.returnNode()):
                    other.registerOutput(g.insertConstant(None))
        t = v.type()
        out = owner.addOutput()
        out.setType(t if t.kind() == "OptionalType" else torch._C.OptionalType(t))
        v = out


def _insert_clone(g: Graph, v: Value) -> Value:
    out = g.insertNode(g.create("aten::clone", [v, g.insertConstant(None)])).output()
    out.setType(v.type())
    return out


@dataclass
class Rewritten:
    """The graph returning ``(output, (values...))``, and what it captures."""

    graph: Graph
    names: tuple[str, ...]
    copied: frozenset[str]
    outplaced: frozenset[str]
    """Sites kept safe by running the one in-place op that would overwrite them out of place."""


def rewrite(sg: ScriptGraph, selected: Sequence[Site], *, copy: str) -> Rewritten:
    """Make ``sg.graph`` (in place) return the values of the ``selected`` sites."""
    g = sg.graph
    by_id: dict[int, Value] = {sg.values[s].unique(): sg.values[s] for s in selected}
    ids = {s: sg.values[s].unique() for s in selected}  # a replaced Value cannot be asked
    outplaced: set[str] = set()
    if copy == "auto":

        def run(w: Node) -> dict[Hashable, Hashable] | None:
            old = w.outputsAt(0).unique()
            new = _outplace(g, w)
            if new is None:
                return None
            by_id[new.unique()] = new
            return {old: new.unique()}

        moved, saved = outplace(lambda: Hazards(ScriptOps(g)), ids, run)
        ids = {s: int(u) for s, u in moved.items()}  # type: ignore[call-overload]
        outplaced = {s.name for s in saved}
    hazards = Hazards(ScriptOps(g)) if copy == "auto" else None
    risky = {s: hazards.at_risk(ids[s]) for s in selected} if hazards else {}
    done: dict[tuple[int, str], Value] = {}
    outs, names, copied = [], [], set()
    for site in selected:
        v = by_id[ids[site]]
        how = "raw"
        if _is_tensor(v) and (copy == "always" or risky.get(site, False)):
            how = "clone"
        key = (v.unique(), how)
        new = done.get(key)
        if new is None:
            if how == "clone":
                new = _insert_after(g, v, partial(_insert_clone, g, v))
            else:
                new = v
            done[key] = new = _lift(g, new)
        if how == "clone":
            copied.add(site.name)
        outs.append(new)
        names.append(site.name)
    ret = g.return_node()
    results = list(ret.inputs())
    if len(results) != 1:
        raise UnsupportedModelError("fxprobe taps TorchScript graphs with one return value")
    with g.insert_point_guard(ret):
        inner = g.insertNode(g.create("prim::TupleConstruct", outs))
        inner.output().setType(torch._C.TupleType([o.type() for o in outs]))
        outer = g.insertNode(g.create("prim::TupleConstruct", [results[0], inner.output()]))
        outer.output().setType(torch._C.TupleType([results[0].type(), inner.output().type()]))
    ret.replaceInput(0, outer.output())
    g.lint()
    return Rewritten(g, tuple(names), frozenset(copied), frozenset(outplaced))


# -- the new ScriptModule -------------------------------------------------------------------------

_TYPING = "from typing import Any, Dict, List, Optional, Tuple, Union\nfrom torch import Tensor\n"


def _signature(module: Any) -> tuple[str, str]:
    """``(x: Tensor, y: Optional[Tensor]=None)`` and ``x, y`` for the forward's arguments."""
    params, call = [], []
    for arg in module.forward.schema.arguments[1:]:
        ann = arg.type.annotation_str
        if "__torch__" in ann:
            raise UnsupportedModelError(
                f"forward argument {arg.name!r} has the TorchScript class type {ann}, which "
                "fxprobe cannot spell in a new forward; pass tensors or builtin types")
        text = f"{arg.name}: {ann}"
        if arg.default_value is not None or arg.has_default_value():
            text += f" = {arg.default_value!r}"
        if arg.kwarg_only and "*" not in params:
            params.append("*")
        params.append(text)
        call.append(arg.name)
    return ", ".join(params), ", ".join(call)


def build_module(module: torch.jit.ScriptModule, rewritten: Rewritten,
                 sites: Sequence[Site], reduce: str) -> torch.jit.ScriptModule:
    """A new ScriptModule: ``model`` (the user's, shared) and a forward returning the taps.

    Attributes a loader can read: ``fxprobe_names`` (site names, in the order of the taps
    tuple), ``fxprobe_sites`` (name, kind, target, module path, type name, inlined and listed
    "0"/"1" of each) and
    ``fxprobe_reduce`` (``""``, or ``"stats"``: fxprobe reduces the values it reads back).
    """
    n = next(_counter)
    fn = torch._C._create_function_from_graph(f"__torch__.fxprobe.tapped_{n}.forward",
                                              rewritten.graph)
    params, call = _signature(module)
    sep = ", " if call else ""
    src = (f"def forward(self, {params}):\n"
           f"    return fxprobe_forward(self.model{sep}{call})\n") if params else (
        "def forward(self):\n    return fxprobe_forward(self.model)\n")
    filename = f"<fxprobe:script:{n}>"
    linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)
    scope: dict[str, Any] = {"fxprobe_forward": fn}
    exec(_TYPING, scope)
    exec(compile(src, filename, "exec"), scope)

    def __init__(self: Any, model: nn.Module, names: list[str],
                 rows: list[list[str]], reduce: str) -> None:
        nn.Module.__init__(self)
        self.model = model
        self.fxprobe_names = names
        self.fxprobe_sites = rows
        self.fxprobe_reduce = reduce

    cls = type("TappedScriptModule", (nn.Module,), {
        "__init__": __init__, "forward": scope["forward"], "__module__": "fxprobe",
        "__annotations__": {"fxprobe_names": list[str], "fxprobe_sites": list[list[str]],
                            "fxprobe_reduce": str},
    })
    by_name = {s.name: s for s in sites}
    rows = [by_name[name].to_row() for name in rewritten.names]
    # A fresh Python wrapper of the same C++ module (shared state): a frozen module's own
    # wrapper lacks the concrete type that scripting a module around it needs.
    inner = torch.jit._recursive.wrap_cpp_module(module._c)
    with quiet_jit():
        return torch.jit.script(cls(inner, list(rewritten.names), rows, reduce))


def saved_sites(module: torch.jit.ScriptModule) -> list[Site]:
    """The sites a tapped ScriptModule (made by fxprobe, maybe saved and loaded) records."""
    return [Site.from_row(row, "script") for row in module.fxprobe_sites]


def is_tapped(module: Any) -> bool:
    """True for a ScriptModule that fxprobe built (its forward already returns the taps)."""
    return isinstance(module, torch.jit.ScriptModule) and hasattr(module, "fxprobe_names")
