"""The torch.export frontend: an ExportedProgram's ATen graph -> named sites -> a tapped program.

Names follow the fx frontend, read from ``node.meta["nn_module_stack"]``: a module call by its
path (``layer1.0.conv1``, the one value it hands back), an op outside ``torch.nn`` leaf modules
by the enclosing module and the op (``layer1.0.add`` for ``aten.add_.Tensor``), repeats
suffixed. Functions select every ATen spelling: ``F.softmax`` matches ``aten.softmax.int``.

The tapped program is a new ExportedProgram whose graph returns the selected values as extra
user outputs, so that ``program.module()(x)`` returns ``(output, {site name: value})`` (programs
tapped before fxprobe named them there return ``(output, (values...))`` and stay readable)::

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
import sys
import warnings
from collections.abc import Hashable, Iterator, Sequence
from typing import Any

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.utils import _pytree as pytree

from ..capture.inplace import Hazards, Op, outplace
from ..capture.rewrite import copy_graph
from ..core.errors import UnsupportedModelError
from ..core.irtypes import is_block_type, is_leaf_type, python_type, spelled
from ..core.ops import NO_TWIN, method_key, module_key, op_key
from ..core.site import Site, attach, sites_of

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


def _copy_keeping_names(graph: fx.Graph) -> fx.Graph:
    """A copy of an exported graph whose nodes keep the names the program's signature uses.

    fx renames a node that would shadow a builtin: ``nn.Sequential``'s argument ``input``
    becomes ``input_1`` in a plain copy, and the signature (``input``) no longer names it.
    """
    new = copy_graph(graph)
    used = getattr(getattr(new, "_graph_namespace", None), "_used_names", None)
    for old, copied in zip(graph.nodes, new.nodes, strict=True):
        if copied.name != old.name:
            copied.name = old.name  # unique: they are in the program's graph
            if isinstance(used, set):  # so that no node made later takes it
                used.add(old.name)
    return new


def _loaded_type(name: str) -> type[torch.nn.Module] | None:
    """The module class a type name of ``nn_module_stack`` names: ``torch.*`` ones, and others
    whose Python module is imported already (the model's own, timm's ``LayerNorm``), so that a
    type selector matches subclasses as in eager; never imports. None where it is not at hand
    (a loaded program without its code): selectors then compare the name."""
    found = python_type(name)
    if found is not None:
        return found
    parts = name.split(".")
    for i in range(len(parts) - 1, 0, -1):  # the qualname may be dotted (Outer.Inner)
        obj: Any = sys.modules.get(".".join(parts[:i]))
        if obj is None:
            continue
        for part in parts[i:]:
            obj = getattr(obj, part, None)
        return obj if isinstance(obj, type) and issubclass(obj, torch.nn.Module) else None
    return None


def _is_tensor(node: fx.Node) -> bool:
    return isinstance(node.meta.get("val"), torch.Tensor)


class ExportGraph:
    """A copy of an ExportedProgram's graph whose nodes carry their sites (``node.meta``, as
    the fx frontend leaves them); the program is only read."""

    def __init__(self, ep: Any) -> None:
        self.ep = ep
        self.graph = _copy_keeping_names(ep.graph)
        nodes = list(self.graph.nodes)
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
            ptype = _loaded_type(tname)
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
        for _, _, site, node in entries:
            attach(node, site)

    @property
    def sites(self) -> list[Site]:
        """The sites, in the order their values exist."""
        return [s for n in self.graph.nodes for s in sites_of(n)]

    @property
    def nodes(self) -> dict[Site, fx.Node]:
        """Each site and the node (of :attr:`graph`) whose value it is, in site order."""
        return {s: n for n in self.graph.nodes for s in sites_of(n)}


class AtenOps:
    """The in-place engine's adapter (:class:`~fxprobe.capture.inplace.Hazards`) of an ATen
    graph: the ops' schemas say what they write (``Tensor(a!)``) and what their results alias;
    an in-place ATen op with an out-of-place overload (``aten.add_.Tensor`` ->
    ``aten.add.Tensor``) may run out of place; a higher-order op or a Python function may alias
    and write anything it is given."""

    may_share = None

    def __init__(self, graph: fx.Graph) -> None:
        self.graph = graph

    def ops(self) -> Iterator[Op]:
        for n in self.graph.nodes:
            makes = () if n.op == "output" else (n,)
            reads = tuple(n.all_input_nodes)
            if n.op != "call_function":
                yield Op(n, makes, reads)
                continue
            aliases: list[fx.Node] = []
            writes: list[fx.Node] = []
            if n.target is operator.getitem:
                aliases = _nodes_in(n.args[0])
            elif isinstance(n.target, torch._ops.OpOverload):
                schema = n.target._schema
                aliased = any(r.alias_info is not None for r in schema.returns)
                for i, a in enumerate(schema.arguments):
                    if a.alias_info is None:
                        continue
                    value = n.args[i] if i < len(n.args) else n.kwargs.get(a.name)
                    if a.alias_info.is_write:
                        writes += _nodes_in(value)
                    if aliased:
                        aliases += _nodes_in(value)
            else:
                aliases = writes = _nodes_in((n.args, n.kwargs))
            first = bool(n.args) and isinstance(n.args[0], fx.Node)
            yield Op(n, makes, reads, tuple(aliases), tuple(writes),
                     first and _twin(n) is not None)

    def owned(self, value: Hashable) -> bool:
        return not (isinstance(value, fx.Node) and value.op in ("placeholder", "get_attr"))


def _twin(node: fx.Node) -> Any:
    """The out-of-place overload of an in-place ATen op (``aten.add.Tensor``), else None."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return None
    name = target._opname
    if not name.endswith("_") or name.startswith("_") or name in NO_TWIN:
        return None
    packet = getattr(torch.ops.aten, name[:-1], None)
    if packet is None or target._overloadname not in packet.overloads():
        return None
    return getattr(packet, target._overloadname)


def _run_out_of_place(graph: fx.Graph, w: fx.Node) -> dict[Hashable, Hashable] | None:
    """Replace the in-place op ``w`` by its out-of-place twin; ``{w: the new node}``."""
    twin = _twin(w)
    if twin is None or not _same_as_written(w, twin):
        return None
    with graph.inserting_before(w):
        new = graph.call_function(twin, w.args, w.kwargs)
    new.meta = dict(w.meta)
    w.replace_all_uses_with(new)
    graph.erase_node(w)
    return {w: new}


def _same_as_written(w: fx.Node, twin: Any) -> bool:
    """Whether the twin's result provably has the dtype and shape that ``w`` leaves in its first
    argument (run on the nodes' fake values): else eager casts (``float16 += float32``) or
    raises, and ``w`` stays in place."""
    x = w.args[0].meta.get("val") if isinstance(w.args[0], fx.Node) else None
    mode = getattr(x, "fake_mode", None)
    if not isinstance(x, torch.Tensor) or mode is None:
        return False
    args, kwargs = fx.node.map_arg((w.args, w.kwargs), lambda n: n.meta.get("val"))
    try:
        with mode:
            out = twin(*args, **kwargs)
        return (out.dtype == x.dtype and len(out.shape) == len(x.shape) and all(
            statically_known_true(a == b) for a, b in zip(out.shape, x.shape, strict=True)))
    except Exception:  # any doubt (an op the fake values cannot run): no out-of-place twin
        return False


def _nodes_in(value: Any) -> list[fx.Node]:
    found: list[fx.Node] = []
    fx.node.map_arg(value, lambda n: found.append(n) or n)  # type: ignore[func-returns-value]
    return found


def rewrite(eg: ExportGraph, selected: Sequence[Site], copy_policy: str
            ) -> tuple[Any, tuple[str, ...], frozenset[str], frozenset[str]]:
    """A new ExportedProgram returning the ``selected`` sites' values after its outputs."""
    from torch.export import ExportedProgram
    from torch.export.graph_signature import (
        ExportGraphSignature,
        OutputKind,
        OutputSpec,
        TensorArgument,
    )

    ep = eg.ep
    # Every decision below is made on a copy; the user's graph is only read.
    graph = _copy_keeping_names(eg.graph)
    wanted = {s.name for s in selected}
    values: dict[Site, Any] = {s: n for n in graph.nodes for s in sites_of(n) if s.name in wanted}
    outplaced: set[str] = set()
    if copy_policy == "auto":
        values, saved = outplace(lambda: Hazards(AtenOps(graph)), values,
                                 lambda w: _run_out_of_place(graph, w))
        outplaced = {s.name for s in saved}
    hazards = Hazards(AtenOps(graph)) if copy_policy == "auto" else None
    aten = torch.ops.aten
    taps: list[fx.Node] = []
    names: list[str] = []
    copied: set[str] = set()
    made: dict[tuple[fx.Node, bool], fx.Node] = {}
    for site in selected:
        src = values[site]
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
        new.meta["custom"][_TAG].append(site.to_row())
        if clone:
            copied.add(site.name)
        taps.append(new)
        names.append(site.name)
    out_node = next(n for n in reversed(graph.nodes) if n.op == "output")
    old_out = out_node.args[0]  # read now: the rewrites above may have replaced what it returns
    outputs: list[Any] = list(old_out) if isinstance(old_out, (tuple, list)) else [old_out]
    out_node.args = (tuple(outputs + taps),)
    graph.lint()
    gm = fx.GraphModule(ep.graph_module, graph)
    # An output that an op run out of place made is returned under the new node's name.
    specs = [dataclasses.replace(spec, arg=TensorArgument(name=node.name))
             if isinstance(spec.arg, TensorArgument) and isinstance(node, fx.Node)
             and spec.arg.name != node.name else spec
             for spec, node in zip(ep.graph_signature.output_specs, outputs, strict=True)] + [
        OutputSpec(OutputKind.USER_OUTPUT, TensorArgument(name=t.name), None) for t in taps]
    signature = ExportGraphSignature(list(ep.graph_signature.input_specs), specs)
    with warnings.catch_warnings():  # torch's own TreeSpec pickling warns on deepcopy
        warnings.simplefilter("ignore", FutureWarning)
        calls = copy.deepcopy(ep.module_call_graph)
    old_spec = calls[0].signature.out_spec
    # A dict keyed by site name: the names travel in the output structure, which
    # torch.export.save keeps, so a reader without fxprobe finds them (``ep.module()(x)[1]``,
    # ``ep.call_spec.out_spec``); node.meta["custom"] carries the rest of each site.
    calls[0].signature.out_spec = pytree.treespec_tuple(
        [old_spec, pytree.tree_structure(dict.fromkeys(names, 0))])
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
    if taps_spec.type not in (tuple, dict):
        return None
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
        sites.append(Site.from_row(t.meta["custom"][_TAG][k], "export"))
    if taps_spec.type is dict and list(taps_spec.context) != [s.name for s in sites]:
        return None  # keys that are not the tagged sites' names: not fxprobe's structure
    return sites


def export_graph(ep: Any) -> ExportGraph:
    """The sites of ``ep`` (refused when it has no output structure to extend)."""
    if ep.call_spec.out_spec is None:
        raise UnsupportedModelError("this ExportedProgram has no output structure (out_spec)")
    return ExportGraph(ep)


def export_sites(ep: Any) -> list[Site]:
    saved = saved_taps(ep)
    return saved if saved is not None else export_graph(ep).sites
