"""The torch.export frontend: an ExportedProgram's ATen graph -> named sites -> a tapped program.

Names follow the fx frontend, read from ``node.meta["nn_module_stack"]``: a module call by its
path (``layer1.0.conv1``, the one value it hands back), an op outside ``torch.nn`` leaf modules
by the enclosing module and the op (``layer1.0.add`` for ``aten.add_.Tensor``), repeats
suffixed. Functions select every ATen spelling: ``F.softmax`` matches ``aten.softmax.int``.

The tapped program is a new ExportedProgram whose graph returns the selected values as extra
user outputs, so that ``program.module()(x)`` returns ``(output, (values...))``::

    conv2d = aten.conv2d(x, w)            conv2d = aten.conv2d(x, w)
    relu_ = aten.relu_(conv2d)      ->    clone = aten.clone(conv2d)   # relu_ overwrites it
    return (relu_,)                       relu_ = aten.relu_(conv2d)
                                          return (relu_, clone, relu_)

Each output node of a tap carries its site in ``meta["custom"]["fxprobe_taps"]``, which
``torch.export.save`` keeps, so a loaded tapped program still knows its tap names.
"""

from __future__ import annotations

import copy
import dataclasses
import operator
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch import fx
from torch.utils import _pytree as pytree

from ..core.errors import ConfigError, UnsupportedModelError
from ..core.ops import method_key, module_key, op_key
from ..core.options import TapOptions
from ..core.select import as_selectors, select
from ..core.site import Site
from ..runtime.artifact import TappedArtifact
from .script import is_block_type, is_leaf_type, python_type, spelled

_TAG = "fxprobe_taps"


def _stack(node: fx.Node) -> list[tuple[str, str, str]]:
    """``(call key, module path, type name)`` from the outermost module to the innermost."""
    out = []
    for key, (path, tname) in (node.meta.get("nn_module_stack") or {}).items():
        if not isinstance(tname, str):
            tname = f"{tname.__module__}.{tname.__qualname__}"
        if path:
            out.append((key, path, tname))
    return out


def _op(node: fx.Node) -> tuple[str, str, str | None]:
    """(name part, target text, op key) of a call_function node."""
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        short = target._opname
        name = spelled(short, node.meta.get("stack_trace") or "", innermost_last=True)
        return name, str(target), method_key(short)
    name = getattr(target, "__name__", None) or type(target).__name__
    return name.strip("_") or name, str(getattr(target, "__name__", target)), op_key(target)


def _is_tensor(node: fx.Node) -> bool:
    return isinstance(node.meta.get("val"), torch.Tensor)


class ExportGraph:
    """The sites of an ExportedProgram's graph, each with the node whose value it is."""

    def __init__(self, ep: Any) -> None:
        self.ep = ep
        nodes = list(ep.graph.nodes)
        position = {n: i for i, n in enumerate(nodes)}
        user_inputs = set(ep.graph_signature.user_inputs)
        counts: dict[str, int] = {}
        call_counts: dict[str, int] = {}  # calls fx traces through: a name space apart

        def count(name: str, space: dict[str, int] | None = None) -> str:
            space = counts if space is None else space
            c = space.get(name, 0)
            space[name] = c + 1
            return f"{name}_{c}" if c else name

        # Module calls: the nodes of each call (key), in the order calls start.
        calls: dict[str, list[fx.Node]] = {}
        info: dict[str, tuple[str, str, int]] = {}
        in_block: dict[str, bool] = {}  # inside a torchvision.ops block: not listed
        for n in nodes:
            stack = _stack(n)
            for depth, (key, path, tname) in enumerate(stack):
                calls.setdefault(key, []).append(n)
                info.setdefault(key, (path, tname, depth))
                in_block.setdefault(key, any(is_block_type(t) for _, _, t in stack[:depth]))
        entries: list[tuple[int, int, Site, fx.Node]] = []
        call_names, listed = {}, {}
        for key in calls:  # dicts keep insertion order: the order calls start
            tname = info[key][1]
            leaf = is_leaf_type(tname)
            listed[key] = not in_block[key] and (leaf or is_block_type(tname))
            node_name = leaf or (is_block_type(tname) and not in_block[key])
            call_names[key] = count(info[key][0], counts if node_name else call_counts)
        for key, members in calls.items():
            inside = set(members)
            outs = [m for m in members if any(u not in inside for u in m.users)]
            if len(outs) != 1 or not _is_tensor(outs[0]):
                continue  # no single value comes out (a tuple, or nothing): not a site
            path, tname, depth = info[key]
            ptype = python_type(tname)
            site = Site(call_names[key], "export", "call_module", path, path, ptype,
                        module_key(ptype), inlined=not is_leaf_type(tname),
                        listed=listed[key], type_name=tname)
            entries.append((position[outs[0]], 1000 - depth, site, outs[0]))
        # Values from buffers (and constants) alone are no sites, as in the fx frontend:
        # torchvision's tracer sees constants there. True: a buffer is among the sources.
        sig = ep.graph_signature
        static: dict[fx.Node, bool] = {}
        for n in nodes:
            if n.op == "placeholder" and n.name in sig.inputs_to_buffers:
                static[n] = True
            elif n.op == "get_attr" or (
                    n.op == "placeholder" and n.name in sig.inputs_to_lifted_tensor_constants):
                static[n] = False
            elif n.op == "call_function" and n.all_input_nodes and all(
                    a in static for a in n.all_input_nodes):
                static[n] = any(static[a] for a in n.all_input_nodes)
        for n in nodes:
            if static.get(n, False):
                continue
            if n.op == "placeholder" and n.name in user_inputs:
                site = Site(count(n.name), "export", "placeholder", n.name, "")
                entries.append((position[n], 0, site, n))
            elif n.op == "call_function" and _is_tensor(n):
                stack = _stack(n)
                if any(is_leaf_type(t) for _, _, t in stack):
                    continue  # inside a torch.nn module: its call is the site
                path = stack[-1][1] if stack else ""
                short, target, okey = _op(n)
                site = Site(count(f"{path}.{short}" if path else short), "export",
                            "call_function", target, path, op_key=okey,
                            listed=not any(is_block_type(t) for _, _, t in stack))
                entries.append((position[n], 0, site, n))
        # Sites in the order their values exist; at one node, the op first, then the calls
        # that hand it back, innermost first.
        entries.sort(key=lambda e: (e[0], e[1]))
        self.sites = [e[2] for e in entries]
        self.nodes = [e[3] for e in entries]


class ExportHazards:
    """Which nodes' values a later node writes in place, from the ATen schemas' alias info."""

    def __init__(self, graph: fx.Graph) -> None:
        self.nodes = list(graph.nodes)
        self.order = {n: i for i, n in enumerate(self.nodes)}
        parent: dict[fx.Node, fx.Node] = {}

        def find(n: fx.Node) -> fx.Node:
            while parent.get(n, n) is not n:
                n = parent[n]
            return n

        def union(a: fx.Node, b: fx.Node) -> None:
            ra, rb = find(a), find(b)
            if ra is not rb:
                parent[ra] = rb

        writes: list[tuple[int, fx.Node]] = []
        for n in graph.nodes:
            if n.op != "call_function":
                continue
            pos = self.order[n]
            if n.target is operator.getitem:
                union(n, n.args[0])  # type: ignore[arg-type]
            elif isinstance(n.target, torch._ops.OpOverload):
                schema = n.target._schema
                aliased = any(r.alias_info is not None for r in schema.returns)
                for i, a in enumerate(schema.arguments):
                    value = n.args[i] if i < len(n.args) else n.kwargs.get(a.name)
                    for v in _nodes_in(value):
                        if a.alias_info is not None and a.alias_info.is_write:
                            writes.append((pos, v))
                        if a.alias_info is not None and aliased:
                            union(n, v)
            else:  # a higher-order op or a Python function: may alias and write anything
                for v in _nodes_in((n.args, n.kwargs)):
                    union(n, v)
                    writes.append((pos, v))
        self.find = find
        self.writes: dict[fx.Node, list[int]] = {}
        for pos, v in writes:
            self.writes.setdefault(find(v), []).append(pos)

    def at_risk(self, node: fx.Node) -> bool:
        mine = self.order[node]
        return any(p > mine for p in self.writes.get(self.find(node), ()))

    def outplaceable(self, node: fx.Node) -> fx.Node | None:
        """The one in-place ATen op that overwrites ``node``'s value, if running it out of
        place changes nothing else: it writes the value itself, has an out-of-place twin, and
        nothing reads the value after it or holds a view of it; else None."""
        mine = self.order[node]
        later = [p for p in self.writes.get(self.find(node), ()) if p > mine]
        if len(later) != 1 or node.op == "placeholder":
            return None
        w = self.nodes[later[0]]
        target = w.target
        if (not isinstance(target, torch._ops.OpOverload) or not w.args or w.args[0] is not node
                or not target._opname.endswith("_") or target._opname.startswith("_")):
            return None
        twin = getattr(torch.ops.aten, target._opname[:-1], None)
        if twin is None or target._overloadname not in twin.overloads():
            return None
        for u in node.users:
            if u is not w and (self.order[u] > later[0] or self.find(u) is self.find(node)):
                return None  # read after the write, or a view that would see it
        return w


def _nodes_in(value: Any) -> list[fx.Node]:
    found: list[fx.Node] = []
    fx.node.map_arg(value, lambda n: found.append(n) or n)  # type: ignore[func-returns-value]
    return found


def _row(site: Site) -> list[str]:
    return [site.name, site.kind, str(site.target), site.module_path, site.type_name or "",
            str(int(site.inlined)), str(int(site.listed))]


def _outplace_all(graph: fx.Graph, values: dict[int, fx.Node], names: dict[int, str]
                  ) -> set[str]:
    """Run out of place each in-place op that alone overwrites a tapped value (in place in
    ``values``); the names of the sites it saved from a copy. Repeated: ``out += x;
    relu_(out)`` frees ``out`` once relu_ runs out of place."""
    done: set[str] = set()
    for _ in range(len(values) + 1):
        hazards = ExportHazards(graph)
        todo: dict[fx.Node, list[int]] = {}
        for i, v in values.items():
            w = hazards.outplaceable(v)
            if w is not None:
                todo.setdefault(w, []).append(i)
        if not todo:
            break
        for w, users in todo.items():
            target = w.target
            assert isinstance(target, torch._ops.OpOverload)
            twin = getattr(getattr(torch.ops.aten, target._opname[:-1]), target._overloadname)
            with graph.inserting_before(w):
                new = graph.call_function(twin, w.args, w.kwargs)
            new.meta = dict(w.meta)
            w.replace_all_uses_with(new)
            graph.erase_node(w)
            done.update(names[i] for i in users)
            for i, v in list(values.items()):
                if v is w:
                    values[i] = new
    return done


def rewrite(eg: ExportGraph, selected: Sequence[int], copy_policy: str
            ) -> tuple[Any, tuple[str, ...], frozenset[str], frozenset[str]]:
    """A new ExportedProgram returning the selected values after the program's outputs."""
    from torch.export import ExportedProgram
    from torch.export.graph_signature import (
        ExportGraphSignature,
        OutputKind,
        OutputSpec,
        TensorArgument,
    )

    ep = eg.ep
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    old_out = graph.graph_copy(ep.graph, env)
    # Every decision below is made on the copy; the user's graph is only read. The outputs sit
    # in an output node meanwhile, so that an in-place op run out of place below is replaced
    # there too (b = x * 2; b.add_(x); return b) and the hazards see what is returned.
    held = graph.output(old_out)
    values = {i: env[eg.nodes[i]] for i in selected}
    outplaced: set[str] = set()
    if copy_policy == "auto":
        outplaced = _outplace_all(graph, values, {i: eg.sites[i].name for i in selected})
    hazards = ExportHazards(graph) if copy_policy == "auto" else None
    aten = torch.ops.aten
    taps: list[fx.Node] = []
    names: list[str] = []
    copied: set[str] = set()
    made: dict[tuple[fx.Node, bool], fx.Node] = {}
    for i in selected:
        site, src = eg.sites[i], values[i]
        clone = copy_policy == "always" or (hazards is not None and hazards.at_risk(src))
        new = made.get((src, clone))
        if new is None:
            if clone or src.op == "placeholder":  # a placeholder cannot carry a tag: alias it
                with graph.inserting_after(src):
                    new = graph.call_function(aten.clone.default if clone else aten.alias.default,
                                              (src,))
                new.meta = {k: v for k, v in src.meta.items()
                            if k in ("val", "tensor_meta", "nn_module_stack", "stack_trace")}
            else:
                new = src
            new.meta = dict(new.meta)  # the copy's meta dict is shared with the user's graph
            new.meta["custom"] = {**new.meta.get("custom", {}), _TAG: []}
            made[(src, clone)] = new
        new.meta["custom"][_TAG].append(_row(site))
        if clone:
            copied.add(site.name)
        taps.append(new)
        names.append(site.name)
    old_out = held.args[0]
    graph.erase_node(held)
    out_node = next(n for n in ep.graph.nodes if n.op == "output")
    outputs: list[Any] = list(old_out) if isinstance(old_out, (tuple, list)) else [old_out]
    graph.output(tuple(outputs + taps)).meta = dict(out_node.meta)
    graph.lint()
    gm = fx.GraphModule(ep.graph_module, graph)
    specs = [  # an output run out of place above is a new node: its spec names that one
        dataclasses.replace(spec, arg=TensorArgument(name=o.name))
        if isinstance(spec.arg, TensorArgument) and isinstance(o, fx.Node)
        and o.name != spec.arg.name else spec
        for spec, o in zip(ep.graph_signature.output_specs, outputs, strict=True)] + [
        OutputSpec(OutputKind.USER_OUTPUT, TensorArgument(name=t.name), None) for t in taps]
    signature = ExportGraphSignature(list(ep.graph_signature.input_specs), specs)
    with warnings.catch_warnings():  # torch's own TreeSpec pickling warns on deepcopy
        warnings.simplefilter("ignore", FutureWarning)
        calls = copy.deepcopy(ep.module_call_graph)
    old_spec = calls[0].signature.out_spec
    calls[0].signature.out_spec = pytree.treespec_tuple(
        [old_spec, pytree.tree_structure(tuple(range(len(taps))))])
    program = ExportedProgram(
        root=gm, graph=gm.graph, graph_signature=signature, state_dict=ep.state_dict,
        range_constraints=copy.deepcopy(ep.range_constraints), module_call_graph=calls,
        example_inputs=ep.example_inputs, constants=ep.constants, verifiers=ep.verifiers)
    return program, tuple(names), frozenset(copied), frozenset(outplaced)


def saved_taps(ep: Any) -> list[Site] | None:
    """The sites of a program fxprobe tapped (maybe saved and loaded), else None."""
    spec = ep.call_spec.out_spec
    if spec is None or spec.type is not tuple or spec.num_children != 2:
        return None
    taps_spec = spec.child(1) if hasattr(spec, "child") else spec.children_specs[1]
    n = taps_spec.num_leaves
    out = next(node for node in ep.graph.nodes if node.op == "output")
    tail = list(out.args[0])[-n:] if n else []
    if not tail or any(not isinstance(t, fx.Node) or _TAG not in (t.meta.get("custom") or {})
                       for t in tail):
        return None
    seen: dict[fx.Node, int] = {}
    sites = []
    for t in tail:
        k = seen.get(t, 0)
        seen[t] = k + 1
        name, kind, target, path, tname, inlined, listed = t.meta["custom"][_TAG][k]
        ptype = python_type(tname) if tname else None
        key = method_key(target.split(".")[1]) if target.startswith("aten.") else (
            module_key(ptype))
        sites.append(Site(name, "export", kind, target, path, ptype, key,
                          inlined=inlined == "1", listed=listed == "1",
                          type_name=tname or None))
    return sites


class TappedExport(TappedArtifact):
    """A tapped torch.export program (``fxprobe.tap(exported_program)``).

    ``exported()`` is the tapped ``ExportedProgram``: save it with ``torch.export.save``; its
    ``module()`` returns ``(output, (values...))``.
    """

    def __init__(self, program: Any, sites: Sequence[Site], options: TapOptions,
                 copied: frozenset[str] = frozenset(),
                 outplaced: frozenset[str] = frozenset()) -> None:
        self._program = program
        module = program.module()
        super().__init__(module, [s.name for s in sites], sites, options, copied,
                         outplaced)

    def exported(self) -> Any:
        """The tapped ``ExportedProgram`` (``torch.export.save(tapped.exported(), "t.pt2")``)."""
        return self._program

    @property
    def graph_module(self) -> fx.GraphModule:
        """The tapped program's graph module (lifted parameters are placeholders)."""
        gm: fx.GraphModule = self._program.graph_module
        return gm


def tap_export(ep: Any, ops: Any, options: TapOptions) -> TappedExport:
    saved = saved_taps(ep)
    if saved is not None:
        if ops is not None:
            raise ConfigError(
                "this ExportedProgram was already tapped by fxprobe; pass ops=None to read its "
                "taps, or tap the original program again")
        return TappedExport(ep, saved, options)
    if options.copy not in ("auto", "always", "never"):
        raise ConfigError(f"copy={options.copy!r} is not accepted")
    eg = _graph(ep)
    chosen = select(eg.sites, as_selectors(ops), context="the exported program")
    index = {id(s): i for i, s in enumerate(eg.sites)}
    program, names, copied, outplaced = rewrite(eg, [index[id(s)] for s in chosen], options.copy)
    by_name = {s.name: s for s in eg.sites}
    tapped = TappedExport(program, [by_name[n] for n in names], options, copied, outplaced)
    tapped.source = ep
    return tapped


def _graph(ep: Any) -> ExportGraph:
    if ep.call_spec.out_spec is None:
        raise UnsupportedModelError("this ExportedProgram has no output structure (out_spec)")
    return ExportGraph(ep)


def export_sites(ep: Any) -> list[Site]:
    saved = saved_taps(ep)
    return saved if saved is not None else _graph(ep).sites
