"""The TorchScript frontend: a ScriptModule's IR -> one inlined graph with named sites.

:class:`ScriptGraph` inlines the module's ``forward`` into one graph, walking ``prim::CallMethod``
and ``prim::CallFunction`` itself so that it knows, for every value, which module call or op
produced it. Names follow the fx frontend (torchvision's scheme): a call of a ``torch.nn`` leaf
module by its path (``layer1.0.conv1``), an op by the enclosing module and the op
(``layer1.0.add``, ``flatten``), repeats suffixed (``relu_1``). Calls of the modules it inlines
(``layer1``, ``layer1.0``) are sites too, so that a type such as ``BasicBlock`` can be tapped.

Values inside ``prim::Loop`` bodies are not sites (one value per iteration cannot leave the
loop as one value). ``_script_build`` rewrites the graph and builds the tapped ScriptModule.
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

import torch

from ..core.irtypes import (
    is_block_type,
    is_leaf_function,
    is_leaf_type,
    op_name,
    python_type,
    spelled,
    type_name,
)
from ..core.names import join as _join
from ..core.ops import method_key, module_key
from ..core.site import Site

# torch._C's stubs lag its bindings (insertConstant, alias_db, ...): IR objects are typed loosely.
Graph = Any
Node = Any
Value = Any


@contextmanager
def quiet_jit() -> Iterator[None]:
    """TorchScript warns on every use that it is deprecated; fxprobe's own uses stay silent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        warnings.filterwarnings("ignore", category=FutureWarning)
        yield




def site_op_name(node: Node) -> str:
    """The op part of a site name, as fx spells it from the source (see :func:`spelled`)."""
    return spelled(node.kind().partition("::")[2], node.sourceRange(), innermost_last=False)


class _Ctx(NamedTuple):
    path: str
    """Path of the module whose code runs."""
    block: bool
    """Inside a torchvision.ops block: sites here are not listed by ``fxprobe.sites``."""
    leaf: bool
    """Inside a leaf (a torch.nn module or a torch function): no sites here."""
    loop: bool
    """Inside a ``prim::Loop`` body: a value there cannot leave the loop as one value."""


def _function_graph(call: Node) -> tuple[Graph, str]:
    """The inlined body of a ``prim::CallFunction`` and the function's qualified name."""
    g: Graph = torch._C.Graph()
    fconst = g.createClone(call.inputsAt(0).node(), lambda v: v)
    g.insertNode(fconst)
    mapping = {call.inputsAt(0).unique(): fconst.output()}
    for a in list(call.inputs())[1:]:
        i = g.addInput()
        i.setType(a.type())
        mapping[a.unique()] = i
    c = g.createClone(call, lambda v: mapping[v.unique()])
    g.insertNode(c)
    g.registerOutput(c.output())
    probe: Any = torch._C._create_function_from_graph("fxprobe_probe", g.copy())
    code = str(probe.code)
    found = re.search(r"__torch__\.([\w.]+)\(", code)
    name = type_name("__torch__." + found.group(1)) if found else "unknown"
    torch._C._jit_pass_inline(g)
    return g, name


class ScriptGraph:
    """A ScriptModule's ``forward`` inlined into one graph, with the value of every site.

    The module is only read: the graph is a copy, and callee graphs are cloned from.
    """

    def __init__(self, module: Any) -> None:
        self.module = module
        self.modules: dict[str, Any] = dict(module.named_modules())
        self.graph: Graph = module.forward.graph.copy()
        self.paths: dict[int, str] = {}
        self.values: dict[Site, Value] = {}
        """Every site, in the order the forward makes them, and the IR value that is its value
        (IR values cannot carry metadata as fx nodes do: this is the one record of it)."""
        self._counts: dict[str, int] = {}
        self._call_counts: dict[str, int] = {}  # calls fx traces through: a name space apart
        self._moved: dict[int, tuple[int, Value]] = {}
        self._static: dict[int, bool] = {}
        """Values from constants and buffers alone: True when a buffer is among them."""
        inputs = list(self.graph.inputs())
        self.paths[inputs[0].unique()] = ""
        for v in inputs[1:]:
            base = v.debugName().split(".")[0]
            self._add(Site(self._count(base), "script", "placeholder", base, ""), v)
        root = _Ctx("", False, False, False)
        for node in list(self.graph.nodes()):
            self._visit(node, root)
        self.graph.lint()

    @property
    def sites(self) -> list[Site]:
        """The sites, in the order the forward makes their values."""
        return list(self.values)

    def _count(self, name: str, counts: dict[str, int] | None = None) -> str:
        counts = self._counts if counts is None else counts
        count = counts.get(name, 0)
        counts[name] = count + 1
        return f"{name}_{count}" if count else name

    def _add(self, site: Site, value: Value, ctx: _Ctx | None = None) -> None:
        if ctx is not None and ctx.block:  # inside a block torchvision keeps whole
            site = dataclasses.replace(site, listed=False)
        self.values[site] = value

    def _type_of(self, path: str) -> str:
        return type_name(self.modules[path]._c._type().qualified_name())

    def _visit(self, node: Node, ctx: _Ctx) -> None:
        kind = node.kind()
        quiet = ctx.leaf or ctx.loop
        if kind == "prim::GetAttr":
            owner = self.paths.get(node.input().unique())
            if owner is None:
                return
            attr = node.s("name")
            full = _join(owner, attr)
            if full in self.modules and node.output().type().kind() == "ClassType":
                self.paths[node.output().unique()] = full
            elif attr in dict(self.modules[owner].named_parameters(recurse=False)):
                if not quiet:
                    name = self._count(f"{ctx.path}.{attr}" if ctx.path else attr)
                    self._add(Site(name, "script", "get_attr", full, ctx.path), node.output(),
                              ctx)
            elif node.output().type().kind() == "TensorType":  # a buffer
                self._static[node.output().unique()] = True
        elif kind == "prim::CallMethod":
            self._call_method(node, ctx)
        elif kind == "prim::CallFunction":
            graph, qualname = _function_graph(node)
            torch_fn = is_leaf_function(qualname)
            site_name = None
            if torch_fn and not quiet:
                site_name = self._count(_join(ctx.path, qualname.rpartition(".")[2]))
            outs = self._inline(node, graph, ctx._replace(leaf=ctx.leaf or torch_fn), 1)
            if site_name is not None and len(outs) == 1:
                short = qualname.rpartition(".")[2]
                self._add(Site(site_name, "script", "call_function", qualname, ctx.path,
                               op_key=method_key(short)), outs[0], ctx)
        elif kind == "prim::Loop":
            for block in node.blocks():
                for n in list(block.nodes()):
                    self._visit(n, ctx._replace(loop=True))
        else:
            for block in node.blocks():
                for n in list(block.nodes()):
                    self._visit(n, ctx)
            buffered = self._from_buffers(node)
            if kind.startswith("aten::") and not quiet and node.outputsSize() == 1:
                out = node.output()
                # Computed from buffers (and constants) alone: torchvision's tracer sees a
                # constant there, and the fx frontend makes no site of it either.
                if out.type().kind() != "NoneType" and not buffered:
                    name = self._count(_join(ctx.path, site_op_name(node)))
                    self._add(Site(name, "script", "call_function", kind, ctx.path,
                                   op_key=op_name(kind)), out, ctx)

    def _from_buffers(self, node: Node) -> bool:
        """Whether every input of ``node`` is a constant or computed from buffers alone, and
        one is a buffer: then so are its outputs (recorded in ``_static``)."""
        if node.kind() == "prim::Constant":
            for o in node.outputs():
                self._static[o.unique()] = False
            return False
        if node.inputsSize() == 0 or any(node.blocks()):
            return False
        known = [self._static.get(v.unique()) for v in node.inputs()]
        if any(k is None for k in known):
            return False
        buffered = any(known)
        for o in node.outputs():
            self._static[o.unique()] = buffered
        return buffered

    def _call_method(self, node: Node, ctx: _Ctx) -> None:
        path = self.paths.get(node.inputsAt(0).unique())
        method = node.s("name")
        if path is None or path not in self.modules:
            return  # an interface or an object fxprobe cannot see into: runs as written
        callee = self.modules[path]._c._get_method(method).graph
        # An overloaded forward (nn.LSTM) is compiled as forward__0, forward__1...
        is_call = path != ctx.path and (method == "forward" or method.startswith("forward__"))
        site_name, inner, tname, listed = None, ctx, None, True
        if is_call:
            tname = self._type_of(path)
            leaf = ctx.leaf or is_leaf_type(tname)
            block = not leaf and is_block_type(tname)
            inner = _Ctx(path, ctx.block or block, leaf, ctx.loop)
            # A leaf call is a node; a call traced through is listed only for a block.
            listed = not ctx.block and (leaf or block)
            if not (ctx.leaf or ctx.loop):
                site_name = self._count(path, None if leaf or listed else self._call_counts)
        outs = self._inline(node, callee, inner, 0)
        if site_name is not None and len(outs) == 1:
            ptype = python_type(tname or "")
            self._add(Site(site_name, "script", "call_module", path, path, ptype,
                           module_key(ptype), inlined=not inner.leaf, listed=listed,
                           type_name=tname), outs[0])

    def _inline(self, call: Node, callee: Graph, ctx: _Ctx,
                skip: int) -> list[Value]:
        """Clone ``callee`` in place of ``call``; visit the clones; return the call's results."""
        g = self.graph
        mapping = {ci.unique(): a for ci, a in zip(callee.inputs(), list(call.inputs())[skip:],
                                                   strict=True)}
        new_nodes = []
        with g.insert_point_guard(call):
            for n in callee.nodes():
                c = g.insertNode(g.createClone(n, lambda v: mapping[v.unique()]))
                for o, co in zip(n.outputs(), c.outputs(), strict=True):
                    co.copyMetadata(o)
                    mapping[o.unique()] = co
                new_nodes.append(c)
        outs = [mapping[v.unique()] for v in callee.return_node().inputs()]
        for o, r in zip(call.outputs(), outs, strict=True):
            o.replaceAllUsesWith(r)
            self._moved[o.unique()] = (r.unique(), r)
        ids = [r.unique() for r in outs]
        call.destroy()
        for c in new_nodes:
            self._visit(c, ctx)
        # A result may itself have been a call inlined since: follow it to its value now.
        return [self._resolve(u, r) for u, r in zip(ids, outs, strict=True)]

    def _resolve(self, u: int, v: Value) -> Value:
        while u in self._moved:
            u, v = self._moved[u]
        return v


