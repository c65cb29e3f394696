"""Intervention points: one call at every site of a graph, for per-call interventions.

A graph with points is a second version of a captured graph (the dynamo frontend builds it the
first time a call runs under an ``intervene`` block or ``run_with_cache``, and never asks dynamo
for anything): after each node that carries sites, one call of :meth:`Pipeline.point` looks the
sites up in the calling thread's table, and every later user of the node reads what it
returns::

    before:  prev -> node -> next
    after:   prev -> node -> pipeline.point(node, names, ..., canonical, given) -> next

The node's sites move to the point, so the taps of ``tap()`` (inserted after this pass) keep
the value that flows on, after the per-call functions, as they do after ``fn=``.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import fx, nn

from ..core.site import CALL_ARGS, KERNEL_KV, SITES, Site, sites_of, unedited
from .inplace import Hazards
from .pipeline import Pipeline
from .rewrite import _writes_first


def insert_points(graph: fx.Graph, modules: Callable[[str], nn.Module], pipeline: Pipeline,
                  skip: Callable[[Site], bool], escapes: bool = True) -> frozenset[str]:
    """Insert an intervention point after every node with a site, in place; return the names
    of the sites that got one (those ``skip`` leaves).

    Args:
        graph: a copy of a captured graph whose nodes carry their sites.
        modules: resolves a ``call_module`` target (for the in-place analysis).
        pipeline: the tapped module's pipeline, whose ``point`` the graph calls.
        skip: sites that get no point (their value is not the node's, or not editable).
        escapes: what the graph returns goes to code fxprobe does not see.
    """
    hazards = Hazards(graph, modules, escapes)
    # Which nodes write their first argument, read on after them: found before any point goes
    # in (a point after ``y.add_(1)`` would hide from ``.mul_(3)`` that it writes ``y``).
    writing = {n for n in graph.nodes if n.op not in ("placeholder", "output", "get_attr")
               and not n.meta.get(KERNEL_KV) and _writes_first(n, modules)}
    pointed: list[str] = []
    # Every canonical name this graph gives: a name another graph gave a site keeps naming it
    # here unless this graph gives it to a node of its own (``Pipeline.point``).
    given = tuple(dict.fromkeys(c for n in graph.nodes for s in sites_of(n) for c in s.canonical))
    flowing: dict[fx.Node, fx.Node] = {}  # a node with sites: its point
    for node in list(graph.nodes):
        sites = [s for s in sites_of(node) if not skip(s)]
        if not sites or node.op in ("output", "get_attr"):
            continue
        names = tuple(s.name for s in sites)
        risky = hazards.output_at_risk(node)
        kept = unedited(node)  # a kernel's keys or values: the cache keeps what was computed
        writes = node in writing
        anchor = node
        if node.op == "placeholder":
            anchor = [n for n in graph.nodes if n.op == "placeholder"][-1]
        # The canonical names as this graph gives them: another graph of the same code may
        # give one to another node (with a KV cache, ``attn.v`` is the concatenated values).
        with graph.inserting_after(anchor):
            point = graph.call_function(pipeline.point, (
                node, names, risky, writes, tuple(s.canonical for s in sites), given))
        node.replace_all_uses_with(
            point, delete_user_cb=lambda user, p=point, kept=kept: user is not p and not kept(user))
        for key in ("nn_module_stack", "stack_trace"):
            if key in node.meta:
                point.meta[key] = node.meta[key]
        # The sites (and a module call's inputs, still the call's) go with the value.
        moved = [s for s in sites_of(node) if s.name in names]
        node.meta[SITES] = [s for s in sites_of(node) if s.name not in names]
        point.meta[SITES] = moved
        calls = node.meta.get(CALL_ARGS) or {}
        # The inputs of the node's call (none for a placeholder), not the point's arguments.
        point.meta[CALL_ARGS] = {s.name: calls.get(s.name, (tuple(node.args), node))
                                 for s in moved}
        flowing[node] = point
        pointed.extend(names)
    for node in graph.nodes:  # a call's inputs named in metadata: what flows after the points
        calls = node.meta.get(CALL_ARGS)
        if calls:
            node.meta[CALL_ARGS] = {
                name: (tuple(flowing.get(a, a) if isinstance(a, fx.Node) else a for a in args),
                       first) for name, (args, first) in calls.items()}
    graph.lint()
    return frozenset(pointed)
