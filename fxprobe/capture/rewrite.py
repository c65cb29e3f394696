"""The rewrite: make a region's graph hand every captured value back with its output.

A tap is not a call. The selected nodes' values (copied first where the in-place analysis says a
later node overwrites them) become a tuple that the generated ``forward`` returns beside the
model's output; the tapped module stores that tuple once per forward. The generated code reaches
submodules through plain instance attributes, never ``nn.Module.__getattr__``.
"""

from __future__ import annotations

import copy as _copy
import inspect
import itertools
import linecache
import operator
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

from ..core.ops import AUGMENTED_OPERATORS, NO_TWIN
from ..core.options import Capture, CopyPolicy
from ..core.site import CALL_ARGS, KERNEL_KV, Site, sites_of, unedited
from .inplace import OUT_OF_PLACE, Hazards, effects, outplace
from .pipeline import Pipeline, clone_tree, write_back

_counter = itertools.count()


def copy_graph(graph: fx.Graph) -> fx.Graph:
    """A copy of ``graph`` whose nodes keep their ``meta`` (and so their sites)."""
    new = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in graph.nodes:
        env[node] = new.node_copy(node, lambda n: env[n])
    for node, copied in env.items():  # after all: a call's first node may come after its value
        calls = node.meta.get(CALL_ARGS)  # (a module that returns its input, written in place)
        if calls:  # the nodes it names are the copy's, not the original's
            copied.meta[CALL_ARGS] = {
                name: (tuple(env[a] if isinstance(a, fx.Node) else a for a in args), env[first])
                for name, (args, first) in calls.items()}
    return new


@dataclass
class Compiled:
    """A region's instrumented graph and the plain function that runs it."""

    path: str
    graph: fx.Graph
    names: tuple[str, ...]
    copied: frozenset[str]
    outplaced: frozenset[str]
    fn: Callable[..., Any]
    holder: nn.Module


def _as_written(x: Any, out: Any, inplace: Callable[[Any], Any]) -> Any:
    """``out``, the out-of-place result, where it is what the in-place op would have left in
    ``x``: the same dtype and shape. Else the in-place op runs on a copy of ``x``: eager's cast
    into ``x``'s dtype (``float16 += float32``), or eager's error (a float result cannot be
    cast into an integer ``x``; a broadcast larger than ``x``)."""
    if (isinstance(out, torch.Tensor) and isinstance(x, torch.Tensor)
            and (out.dtype != x.dtype or out.shape != x.shape)):
        return inplace(x.clone())
    return out


def _method_out_of_place(x: Any, name: str, *args: Any, **kwargs: Any) -> Any:
    """``x.<name>_(...)`` as ``x.<name>(...)``, with the in-place op's dtype and shape."""
    return _as_written(x, getattr(x, name)(*args, **kwargs),
                       lambda c: getattr(c, name + "_")(*args, **kwargs))


setattr(_method_out_of_place, OUT_OF_PLACE, True)

_AUGMENTED_BY_NAME = {op.__name__: (op, twin) for op, twin in AUGMENTED_OPERATORS.items()}


def _operator_out_of_place(x: Any, name: str, y: Any) -> Any:
    """``x op= y`` (``operator.<name>``, ``iadd``) as ``x op y``, with the in-place op's dtype
    and shape; on numbers, the same value."""
    op, twin = _AUGMENTED_BY_NAME[name]
    return _as_written(x, twin(x, y), lambda c: op(c, y))


setattr(_operator_out_of_place, OUT_OF_PLACE, True)


def _module_out_of_place(module: nn.Module) -> Callable[..., Any]:
    twin = _copy.copy(module)  # shares the module's tensors and hook tables
    object.__setattr__(twin, "inplace", False)

    def call(*args: Any, **kwargs: Any) -> Any:
        return twin(*args, **kwargs)

    call.__name__ = f"{type(module).__name__.lower()}_out_of_place"
    call.__qualname__ = call.__name__
    setattr(call, OUT_OF_PLACE, True)
    return call


def run_out_of_place(op: fx.Node, modules: Callable[[str], nn.Module]) -> bool:
    """Rewrite the in-place op ``op`` into its out-of-place twin; False when it has none.

    ``ReLU(inplace=True)`` calls a copy of the module with ``inplace=False``;
    ``F.relu(x, inplace=True)`` gets ``inplace=False``; ``torch.relu_(x)`` becomes
    ``torch.relu(x)``; ``x.add_(y)`` becomes ``x.add(y)`` and ``x += y`` (``operator.iadd``)
    ``x + y``, each checked to leave what the in-place op would (:func:`_as_written`).
    """
    if op.op == "call_module":
        m = modules(str(op.target))
        if getattr(m, "inplace", None) is True and type(m).__module__.startswith(
                ("torch.nn", "torch.ao.nn")):
            op.op, op.target = "call_function", _module_out_of_place(m)
            return True
        return False
    if op.op == "call_method":
        name = str(op.target)
        if (name.endswith("_") and not name.startswith("_") and name not in NO_TWIN
                and callable(getattr(torch.Tensor, name[:-1], None))):
            op.op, op.target = "call_function", _method_out_of_place
            op.args = (op.args[0], name[:-1], *op.args[1:])
            return True
        return False
    if op.op != "call_function" or not callable(op.target):
        return False
    fn = op.target
    if fn in AUGMENTED_OPERATORS and len(op.args) == 2 and not op.kwargs:
        op.target = _operator_out_of_place
        op.args = (op.args[0], fn.__name__, op.args[1])
        return True
    if op.kwargs.get("inplace") is True:
        op.kwargs = {**op.kwargs, "inplace": False}
        return True
    try:
        params = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        params = []
    if "inplace" in params and params.index("inplace") < len(op.args):
        i = params.index("inplace")
        if op.args[i] is True:
            op.args = (*op.args[:i], False, *op.args[i + 1:])
            return True
    name = getattr(fn, "__name__", "")
    home = sys.modules.get(getattr(fn, "__module__", None) or "")
    twin = getattr(home, name[:-1], None) if name.endswith("_") and home else None
    if twin is not None and callable(twin) and not name.startswith("_") and name not in NO_TWIN:
        op.target = _function_out_of_place(fn, twin)
        return True
    return False


def _function_out_of_place(inplace: Callable[..., Any], twin: Callable[..., Any]
                           ) -> Callable[..., Any]:
    """``torch.relu_(x)`` as ``torch.relu(x)``, with the in-place op's dtype and shape."""

    def call(x: Any, *args: Any, **kwargs: Any) -> Any:
        return _as_written(x, twin(x, *args, **kwargs), lambda c: inplace(c, *args, **kwargs))

    call.__name__ = call.__qualname__ = f"{twin.__name__}_out_of_place"
    setattr(call, OUT_OF_PLACE, True)
    return call


def insert_taps(graph: fx.Graph, modules: Callable[[str], nn.Module], selected: set[str], *,
                capture: Capture, copy: CopyPolicy, pipeline: Pipeline,
                escapes: bool = False) -> tuple[tuple[str, ...], frozenset[str], frozenset[str]]:
    """Make ``graph`` (a copy) return ``(model output, (kept values...))``, in place.

    For each selected site on a node, the value goes straight into the returned tuple when the
    options need nothing at the site; otherwise one call of the shared :class:`Pipeline` is
    inserted right after the node (``node -> output(name, node, copy) -> [flow, kept]``), and
    with ``fn=`` every later user of the node reads ``flow`` instead::

        before:  prev -> node -> next
        after:   prev -> node -> pipeline.output -> getitem(0) -> next
                                                  -> getitem(1) -> (output tuple)

    Args:
        graph: a copy of a frontend's graph whose nodes carry their sites.
        modules: resolves a ``call_module`` target (for the in-place analysis).
        selected: names of the sites to capture.
        capture: what to keep of each site.
        copy: when to copy a value before a later in-place op can overwrite it.
        pipeline: the tapped module's pipeline.
        escapes: what the graph returns goes to code fxprobe cannot see, which may write into
            it (a traced module called from untraced code): returned values count as written.

    With ``copy="auto"``, a captured value whose first overwriting in-place op is all that sees
    the aliasing (``Hazards.sole_writer``) is kept safe by running that op out of place
    (:func:`run_out_of_place`) instead of copying the value first.

    Returns:
        The captured site names in tuple order, the names whose value is copied, and the names
        made safe by running their overwriting op out of place.
    """
    out_node = next(n for n in reversed(graph.nodes) if n.op == "output")
    outplaced: set[str] = set()
    if copy == "auto" and capture == "output" and pipeline.reduce is None:
        # Where one in-place op is all that would overwrite a captured value, run it out of
        # place: the same values, and no copy kernel.
        _, outplaced = outplace(
            lambda: Hazards(graph, modules, escapes),
            {s.name: n for n in graph.nodes for s in sites_of(n) if s.name in selected},
            lambda w: {} if run_out_of_place(w, modules) else None)
    hazards = Hazards(graph, modules, escapes) if copy == "auto" else None
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    names: list[str] = []
    values: list[Any] = []
    copied: set[str] = set()
    flowing: dict[fx.Node, fx.Node] = {}  # a node's current value, after interventions
    for node in list(graph.nodes):
        for site in sites_of(node):
            if site.name not in selected:
                continue
            name = site.name
            value: Any = None
            if capture in ("input", "both"):
                args, at = _call_args(node, site)
                kept_args = []
                for a in args:
                    if isinstance(a, fx.Node):
                        risky = _needs_copy(copy, hazards, a, at, True)
                        # A module call's inputs are named in metadata, which the intervention
                        # of an earlier site did not rewrite: the value that flows instead.
                        a = flowing.get(a, a)
                        if pipeline.reduce is not None or risky:
                            with graph.inserting_before(at):
                                a = graph.call_function(pipeline.keep, (a, risky))
                            copied.update([name] if risky else [])
                    kept_args.append(a)
                value = tuple(kept_args)
                if capture == "both" and pipeline.input_grads:
                    _watch_inputs(pipeline, name, node, at, [flowing.get(a, a) for a in args])
            if capture in ("output", "both"):
                current = flowing.get(node, node)
                risky = _needs_copy(copy, hazards, node, node, False)
                after = placeholders[-1] if node.op == "placeholder" else current
                kept: fx.Node = current
                if pipeline.per_site:
                    with graph.inserting_after(after):
                        res = graph.call_function(pipeline.output, (name, current, risky))
                    with graph.inserting_after(res):
                        flow = graph.call_function(operator.getitem, (res, 0))
                    with graph.inserting_after(flow):
                        kept = graph.call_function(operator.getitem, (res, 1))
                    if pipeline.fn is not None or pipeline.wants_grads:
                        # An edit of a kernel's keys or values: the cache keeps what the
                        # model computed (a gradient watch is no edit: everything reads it).
                        kept_out = unedited(current) if pipeline.fn is not None else None
                        current.replace_all_uses_with(
                            flow, delete_user_cb=lambda user, r=res, k=kept_out:
                            user is not r and not (k is not None and k(user)))
                        flowing[node] = flow
                    # An in-place write (or the point after one, capture.points, which
                    # knows whether code after it reads the written argument): the edit goes
                    # into the written tensor too.
                    writes = (node.args[3] if node.op == "call_function"
                              and node.target == pipeline.point and len(node.args) > 3
                              else _writes_first(node, modules))
                    if pipeline.fn is not None and writes and not node.meta.get(KERNEL_KV):
                        with graph.inserting_after(kept):
                            graph.call_function(write_back, (current, flow))
                    if node.op == "placeholder":
                        placeholders.append(kept)
                elif risky:
                    with graph.inserting_after(after):
                        kept = graph.call_function(clone_tree, (current,))
                    if node.op == "placeholder":
                        placeholders.append(kept)
                copied.update([name] if risky and pipeline.reduce is None else [])
                value = kept if capture == "output" else (value, kept)
            names.append(name)
            values.append(value)
    out_node.args = ((out_node.args[0], tuple(values)),)
    graph.lint()
    return tuple(names), frozenset(copied), frozenset(outplaced - copied)  # copied anyway


def _watch_inputs(pipeline: Pipeline, name: str, node: fx.Node, at: fx.Node,
                  args: list[Any]) -> None:
    """``grad=True, capture="both"``: the call (the nodes from ``at`` to ``node``, which fx
    records contiguously) reads an alias of each input, whose gradient is its ``grad_input``."""
    pipeline.arity[name] = len(args)
    body: set[fx.Node] = set()
    n = at
    while n is not node:
        body.add(n)
        n = n.next
    body.add(node)
    # The aliases of calls inside this one that start where it starts (placed before ``at``)
    # read its inputs for those calls: they read this call's aliases instead.
    start, n = at, at.prev
    while n.op == "call_function" and n.target in (pipeline.watch_input, pipeline.keep):
        if n.target == pipeline.watch_input:
            body.add(n)
        start, n = n, n.prev
    for i, a in enumerate(args):
        if isinstance(a, fx.Node):
            with at.graph.inserting_before(start):
                alias = at.graph.call_function(pipeline.watch_input, (name, i, a))
            for user in [u for u in a.users if u in body]:
                user.replace_input_with(a, alias)


def _writes_first(node: fx.Node, modules: Callable[[str], nn.Module]) -> bool:
    """Whether ``node`` is an in-place op on its first argument and code after it reads that
    argument (``x.relu_()`` with its result unused), not only its result."""
    first = node.args[0] if node.args else None
    if not (isinstance(first, fx.Node) and first in effects(node, modules)[1]):
        return False
    # The tensor written: the first argument, and through a chain of in-place writes on it
    # (``y.add_(1).mul_(3)`` writes ``y``, which code after it reads), the tensor it started at.
    chain, at = {first}, first
    while at.args and isinstance(at.args[0], fx.Node) and at.args[0] in effects(at, modules)[1]:
        at = at.args[0]
        chain.add(at)
    later = False
    for n in node.graph.nodes:
        if n is node:
            later = True
        elif later and n.op != "output" and chain.intersection(n.all_input_nodes):
            return True
    return False


def _call_args(node: fx.Node, site: Site) -> tuple[tuple[Any, ...], fx.Node]:
    """The positional arguments of a site's call and the node before which they are read."""
    calls = node.meta.get(CALL_ARGS)
    if site.inlined or (calls and site.name in calls):  # a module call: the module's inputs
        args, first = node.meta[CALL_ARGS][site.name]
        return args, first
    return tuple(node.args), node


def _needs_copy(policy: CopyPolicy, hazards: Hazards | None, value: fx.Node,
                consumer: fx.Node, is_input: bool) -> bool:
    if policy == "never":
        return False
    if policy == "always" or hazards is None:
        return True
    if is_input:
        return hazards.input_at_risk(value, consumer)
    return hazards.output_at_risk(value)


def compile_region(path: str, holder: nn.Module, graph: fx.Graph, names: tuple[str, ...],
                   copied: frozenset[str], outplaced: frozenset[str] = frozenset()) -> Compiled:
    """Turn an instrumented graph into a plain function of ``(holder, *args, **kwargs)``.

    Submodule calls become calls of globals of the generated function: on a class that defines
    ``__getattr__`` (every ``nn.Module``), even a hit in the instance dict is a slow attribute
    load, while a global load is specialised by the interpreter.
    """
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
    filename = f"<fxprobe:{path or 'root'}:{next(_counter)}>"
    linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)
    scope: dict[str, Any] = dict(code.globals)
    scope.update(modules)
    exec(compile(src, filename, "exec"), scope)
    return Compiled(path, graph, names, copied, outplaced, scope["forward"], holder)
