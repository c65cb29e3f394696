"""A module call's output as the call hands it on: after the call's in-place writes into it.

A module call's site sits on one node of the graph. The node that computed the output shows it
before the rest of the call ran, and the call may still write it in place: itself
(``y.add_(b)``, ``y.copy_(z)``, the write-back of ``dist.all_reduce(y)`` in a tensor-parallel
layer) or through a view (``y.view(-1).add_(1)``, ``y[:, :2].mul_(0)``, a view of the base the
output is a view of). :func:`settle` finds the node the site belongs on, adding one where no
node of the graph holds the written value::

    before:  y -> v = view(y) -> add_(v) -> head(y)
    after:   y -> v = view(y) -> add_(v) -> s = as_returned(y) -> head(s)

The call's own nodes after ``s`` (``y.sum()`` written into the call's input) go on reading
``y``: an edit of the site reaches the code after the call, as a forward hook's does. Only the
call's own nodes count: code after the call that writes what it returned is not the
module's (a forward hook that clones the output does not see it either).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from torch import fx, nn

from .inplace import OUT_OF_PLACE, _Groups, effects, settled

_COPIED_META = ("example_value", "val", "tensor_meta", "stack_trace")


def as_returned(value: object) -> object:
    """A module call's output as the call hands it on (the node its site sits on, placed after
    the call's last write into it through a view)."""
    return value


setattr(as_returned, OUT_OF_PLACE, True)  # writes nothing (for the in-place analysis)


def settle(value: fx.Node, nodes: Sequence[fx.Node],
           modules: Callable[[str], nn.Module] | None = None) -> fx.Node:
    """The node a module call's site sits on: :func:`settled`, or, where a later node of the
    call writes storage that ``value`` may share (a view of it, its base, another view of the
    base), a new node right after the last such write whose value is ``value``: the readers
    after it read that node (so an edit of the site reaches them).

    Args:
        value: the node that computed what the call returns.
        nodes: the call's nodes after ``value``, in graph order.
        modules: resolves a ``call_module`` target (None: such a node may write all it reads).

    An op the analysis cannot see into counts as a write (``capture.inplace.effects``): the
    new node then comes later within the call, where the value is still the one returned.
    """
    last = settled(value, nodes)
    if not nodes:
        return last
    found = [(n, *_effects(n, modules)) for n in nodes]
    if not any(writes for _, _, writes in found):
        return last
    # Which values may share storage: every node of the graph up to the call's end.
    groups = _Groups()
    end = nodes[-1]
    for n in value.graph.nodes:
        for a in _effects(n, modules)[0]:
            groups.union(n, a)
        if n is end:
            break
    root = groups.find(value)
    position = {n: i for i, n in enumerate(nodes)}
    written = [n for n, _, writes in found if any(groups.find(w) == root for w in writes)]
    if not written or position[written[-1]] <= position.get(last, -1):
        return last
    graph = value.graph
    with graph.inserting_after(written[-1]):
        node = graph.call_function(as_returned, (last,))
    for key in _COPIED_META:
        if key in last.meta:
            node.meta[key] = last.meta[key]
    # The readers after the call read the new node (an edit of the site reaches them); the
    # call's own nodes after it go on reading ``last``: a forward hook's edit reaches only
    # the code the call hands its output to.
    own, after = set(nodes), False
    for n in graph.nodes:
        if n is node:
            after = True
        elif after and n not in own and last in n.all_input_nodes:
            n.replace_input_with(last, node)
    return node


def _effects(n: fx.Node, modules: Callable[[str], nn.Module] | None
             ) -> tuple[list[fx.Node], list[fx.Node]]:
    if n.op == "call_module" and modules is None:
        everything = list(n.all_input_nodes)
        return everything, everything
    if n.op in ("placeholder", "get_attr", "output"):
        return [], []
    return effects(n, modules or _no_modules)


def _no_modules(target: str) -> nn.Module:
    raise LookupError(target)
