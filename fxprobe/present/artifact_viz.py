"""What ``to_dot`` draws for a deployed artifact: its sites as one graph, in the fx plan's shape.

A ScriptModule's inlined IR or an ExportedProgram's ATen graph has far more nodes than sites
(constants, list plumbing, ops inside ``torch.nn`` modules). The drawing keeps one node per
site, with an edge from each site to the nearest sites its value is computed from, as an
ordinary :class:`~fxprobe.core.view.Plan` (one region, no fallbacks) and a stand-in module tree
whose classes carry the artifact's type names, for the cluster labels. Reading the artifact's
graph (and tapping it to run an example input) is the runtime's part
(``fxprobe.runtime.pictures``), which hands this the sites and their data flow.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from torch import fx, nn

from ..core.site import Site, attach
from ..core.view import Plan, Region


def _stand_in(sites: Sequence[Site]) -> nn.Module:
    """Empty modules at every module path, of classes named like the artifact's."""
    classes: dict[str, type[nn.Module]] = {}

    def make(type_name: str | None) -> nn.Module:
        name = (type_name or "Module").rpartition(".")[2] or "Module"
        cls = classes.get(name)
        if cls is None:
            cls = classes[name] = type(name, (nn.Module,), {})
        return cls()

    root = make(None)
    types = {s.module_path: s.type_name for s in sites if s.kind == "call_module"}
    # Parents first; siblings in the order they first run, as a module registers them.
    first = {p: i for i, s in reversed(list(enumerate(sites))) for p in _prefixes(s.module_path)}
    for path in sorted(first, key=lambda p: (p.count("."), first[p])):
        parent_path, _, child = path.rpartition(".")
        parent = root.get_submodule(parent_path) if parent_path else root
        if child not in parent._modules:
            parent.add_module(child, make(types.get(path)))
    return root


def _prefixes(path: str) -> Iterable[str]:
    parts = path.split(".") if path else []
    return (".".join(parts[:i]) for i in range(1, len(parts) + 1))


def picture(sites: Sequence[Site], keys: Sequence[Any],
            inputs_of: Callable[[Any], Iterable[Any]],
            key_of: Callable[[Any], Any]) -> tuple[Plan, nn.Module]:
    """The plan to draw, and a stand-in root for module names, from each site's value
    (``keys[i]``) and the graph's data flow.

    Args:
        inputs_of: the values a value is computed from (through its producing node).
        key_of: a hashable identity of a value.
    """
    graph = fx.Graph()
    node_of: dict[Any, fx.Node] = {}
    order: dict[Any, int] = {}
    near: dict[Any, frozenset[Any]] = {}

    def nearest(value: Any, depth: int = 0) -> frozenset[Any]:
        """The site values ``value`` is computed from, looking through plumbing."""
        k = key_of(value)
        if k in near:
            return near[k]
        near[k] = frozenset()  # a cycle (loop-carried value) ends here
        found: set[Any] = set()
        for v in inputs_of(value):
            vk = key_of(v)
            if vk in node_of:
                found.add(vk)
            elif depth < 500:
                found |= nearest(v, depth + 1)
        near[k] = frozenset(found)
        return near[k]

    for site, value in zip(sites, keys, strict=True):
        k = key_of(value)
        node = node_of.get(k)
        if node is None:
            preds = sorted(nearest(value), key=lambda p: order[p])
            args = tuple(node_of[p] for p in preds)
            if site.kind == "placeholder":
                node = graph.placeholder(site.name)
            else:
                node = graph.call_function(_site_value, args)
            node_of[k] = node
            order[k] = len(order)
        attach(node, site)
    graph.output(tuple(n for n in graph.nodes if n.op != "placeholder" and not n.users))
    root = _stand_in(sites)
    region = Region("", root, graph)
    return Plan(region, {"": region}, [], list(sites)), root


def _site_value(*args: Any) -> Any:
    """Stands for the computation of a site in the drawn graph (never called)."""
    raise NotImplementedError
