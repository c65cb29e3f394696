"""The rewrite: make a region's graph hand every captured value back with its output.

A tap is not a call. The selected nodes' values (copied first where the in-place analysis says a
later node overwrites them) become a tuple that the generated ``forward`` returns beside the
model's output; the tapped module stores that tuple once per forward. The generated code reaches
submodules through plain instance attributes, never ``nn.Module.__getattr__``.
"""

from __future__ import annotations

import itertools
import linecache
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import fx, nn
from torch.utils._pytree import tree_map

from ._inplace import Hazards
from ._trace import Region

Capture = Literal["output", "input", "both"]
CopyPolicy = Literal["auto", "always", "never"]

_counter = itertools.count()


def clone_tree(value: Any) -> Any:
    """A copy of every tensor in ``value`` (a tensor, or a nest of tuples, lists and dicts)."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    return tree_map(lambda v: v.clone() if isinstance(v, torch.Tensor) else v, value)


@dataclass
class Compiled:
    """A region's instrumented graph and the plain function that runs it."""

    path: str
    graph: fx.Graph
    names: tuple[str, ...]
    copied: frozenset[str]
    fn: Callable[..., Any]
    holder: nn.Module


def instrument(region: Region, selected: set[str], *, capture: Capture, copy: CopyPolicy,
               reducer: Callable[[Any], Any] | None = None,
               intervene: Callable[[str, Any], Any] | None = None,
               raw: bool = False) -> tuple[fx.Graph, tuple[str, ...], frozenset[str]]:
    """Copy the region's graph and make its output ``(model output, (captured values...))``.

    Args:
        region: the traced module.
        selected: names of the sites to capture.
        capture: what to keep of each site.
        copy: when to copy a value before a later in-place op can overwrite it.
        reducer: if given, called on each captured value right where it is produced (so no
            copy is ever needed); its result is kept instead of the value.
        intervene: if given, ``intervene(name, value)`` is called on each selected output and
            its result replaces the value for every downstream consumer.
        raw: also return the values that flow downstream (for gradient hooks), making the
            output ``(model output, captured, flowing)``.

    Returns:
        The new graph, the captured site names in order, and the names that are copied.
    """
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    out_node: fx.Node | None = None
    for node in region.graph.nodes:
        new = graph.node_copy(node, lambda n: env[n])
        env[node] = new
        if node.op == "output":
            out_node = new
    if out_node is None:
        raise RuntimeError("traced graph has no output node")
    hazards = Hazards(graph, region.module.get_submodule) if copy == "auto" else None
    names: list[str] = []
    values: list[Any] = []
    flowing: list[Any] = []
    copied: set[str] = set()
    for node in region.graph.nodes:
        name = region.names.get(node)
        if name is None or name not in selected or node.op == "output":
            continue
        new = env[node]
        value: Any = None
        if capture in ("input", "both"):
            args = []
            for a in new.args:
                if isinstance(a, fx.Node):
                    if reducer is not None:
                        with graph.inserting_before(new):
                            a = graph.call_function(reducer, (a,))
                    elif _needs_copy(copy, hazards, a, new, True):
                        with graph.inserting_before(new):
                            a = graph.call_function(clone_tree, (a,))
                        copied.add(name)
                args.append(a)
            value = tuple(args)
        flow: fx.Node = new
        if intervene is not None and node.op != "placeholder":
            with graph.inserting_after(new):
                flow = graph.call_function(intervene, (name, new))
            new.replace_all_uses_with(flow, delete_user_cb=_not(flow))
        if capture in ("output", "both"):
            out: fx.Node = flow
            if reducer is not None:
                with graph.inserting_after(flow):
                    out = graph.call_function(reducer, (flow,))
            elif _needs_copy(copy, hazards, new, new, False):
                with graph.inserting_after(flow):
                    out = graph.call_function(clone_tree, (flow,))
                copied.add(name)
            value = out if capture == "output" else (value, out)
        names.append(name)
        values.append(value)
        flowing.append(flow)
    result = (out_node.args[0], tuple(values), tuple(flowing)) if raw else (
        out_node.args[0], tuple(values))
    out_node.args = (result,)
    graph.lint()
    return graph, tuple(names), frozenset(copied)


def _not(node: fx.Node) -> Callable[[fx.Node], bool]:
    return lambda user: user is not node


def _needs_copy(policy: CopyPolicy, hazards: Hazards | None, value: fx.Node,
                consumer: fx.Node, is_input: bool) -> bool:
    if policy == "never" or value.op == "get_attr":
        return False
    if policy == "always" or hazards is None:
        return True
    if is_input:
        return hazards.input_at_risk(value, consumer)
    return hazards.output_at_risk(value)


def compile_region(region: Region, graph: fx.Graph, names: tuple[str, ...],
                   copied: frozenset[str]) -> Compiled:
    """Turn an instrumented graph into a plain function of ``(holder, *args, **kwargs)``.

    Submodule calls become calls of globals of the generated function: on a class that defines
    ``__getattr__`` (every ``nn.Module``), even a hit in the instance dict is a slow attribute
    load, while a global load is specialised by the interpreter.
    """
    holder = region.module
    originals: dict[fx.Node, Any] = {}
    modules: dict[str, nn.Module] = {}
    taken: dict[str, str] = {}
    for node in graph.nodes:
        if node.op != "call_module":
            continue
        target = str(node.target)
        alias = taken.get(target)
        if alias is None:
            alias = f"_fxp_{len(taken)}_" + re.sub(r"\W", "_", target)
            taken[target] = alias
            modules[alias] = holder.get_submodule(target)
        originals[node] = node.target
        node.target = alias
    try:
        code = graph.python_code(root_module="self")
    finally:
        for node, target in originals.items():
            node.target = target
    src = re.sub(r"\bself\.(_fxp_\d+_\w*)\(", r"\1(", code.src)
    filename = f"<fxprobe:{region.path or 'root'}:{next(_counter)}>"
    linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)
    scope: dict[str, Any] = dict(code.globals)
    scope.update(modules)
    exec(compile(src, filename, "exec"), scope)
    return Compiled(region.path, graph, names, copied, scope["forward"], holder)
