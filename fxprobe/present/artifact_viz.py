"""What ``to_dot`` draws for a deployed artifact: its sites as one graph, in the fx plan's shape.

A ScriptModule's inlined IR or an ExportedProgram's ATen graph has far more nodes than sites
(constants, list plumbing, ops inside ``torch.nn`` modules). The drawing keeps one node per
site, with an edge from each site to the nearest sites its value is computed from, and hands
``_viz`` an ordinary :class:`~fxprobe.frontends.fx.Plan` (one region, no fallbacks) and a stand-in
module tree whose classes carry the artifact's type names, for the cluster labels.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from torch import fx, nn

from ..core.site import Site, attach
from ..frontends.fx import Plan, Region


@dataclass
class ArtifactPicture:
    """A plan to draw, a stand-in root for module names, and how to run an example input."""

    title: str
    plan: Plan
    root: nn.Module
    run: Callable[[tuple[Any, ...], dict[str, Any]], dict[str, Any]]
    """Run an example input through a tapped copy; the value of every site, by name."""


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
    for path in sorted({p for s in sites for p in _prefixes(s.module_path)}, key=len):
        parent_path, _, child = path.rpartition(".")
        parent = root.get_submodule(parent_path) if parent_path else root
        if child not in parent._modules:
            parent.add_module(child, make(types.get(path)))
    return root


def _prefixes(path: str) -> Iterable[str]:
    parts = path.split(".") if path else []
    return (".".join(parts[:i]) for i in range(1, len(parts) + 1))


def picture(title: str, sites: Sequence[Site], keys: Sequence[Any],
            inputs_of: Callable[[Any], Iterable[Any]], key_of: Callable[[Any], Any],
            run: Callable[[tuple[Any, ...], dict[str, Any]], dict[str, Any]]) -> ArtifactPicture:
    """Build the picture from each site's value (``keys[i]``) and the graph's data flow.

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
    plan = Plan(region, {"": region}, [], list(sites))
    return ArtifactPicture(title, plan, root, run)


def _site_value(*args: Any) -> Any:
    """Stands for the computation of a site in the drawn graph (never called)."""
    raise NotImplementedError


def script_picture(module: Any) -> ArtifactPicture:
    from ..core.options import default_options
    from ..frontends.script import ScriptGraph, quiet_jit
    from ..runtime.artifact import tap_script

    with quiet_jit():
        sg = ScriptGraph(module)

    def run(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        tapped = tap_script(module, None, default_options())
        tapped(*args, **kwargs)
        return dict(tapped.taps)

    return picture(f"{module.original_name} (TorchScript)", sg.sites, sg.values,
                   lambda v: v.node().inputs(), lambda v: v.unique(), run)


def export_picture(program: Any) -> ArtifactPicture:
    from ..core.options import default_options
    from ..frontends.export import ExportGraph, tap_export

    eg = ExportGraph(program)

    def run(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        tapped = tap_export(program, None, default_options())
        tapped(*args, **kwargs)
        return dict(tapped.taps)

    return picture("ExportedProgram (torch.export)", eg.sites, eg.nodes,
                   lambda n: n.all_input_nodes, lambda n: n, run)
