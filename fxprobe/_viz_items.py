"""What the picture of a model holds: the items (sites, calls, inputs) and the edges between them.

``to_dot`` reads a model into a :class:`Scene` (``fxprobe._viz``), turns it into :class:`Item` s
in execution order with the data-flow edges between them (this module), and emits DOT text
(``fxprobe._viz_dot``). Here: which node of which graph becomes an item, what is folded into
what (shape plumbing, attributes, inputs with defaults), and which items a ``depth`` collapses.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import fx, nn

from ._site import Site, node_site
from ._summary import ValueInfo
from ._trace import Plan, Region


@dataclass(eq=False)
class Item:
    """One thing to draw: a site, a module that runs as written, or a model input/output."""

    id: str
    role: str
    """site, input, output, return, module (an opaque module with no site of its own)."""
    owner: str
    """The module path this item belongs to, for clusters and for ``depth``."""
    module: str | None = None
    """For module calls and hook sites: the called module's path."""
    site: Site | None = None
    members: list[Item] = field(default_factory=list)
    """For a collapsed module: the items it stands for."""
    folded: list[str] = field(default_factory=list)
    """Sites folded into this one: shape plumbing that feeds it, or optional inputs."""
    constants: list[str] = field(default_factory=list)
    """Attributes (parameters, buffers, constants) read by this op, drawn in its label."""


@dataclass
class Scene:
    """Everything ``to_dot`` knows about one model before it draws."""

    title: str
    plan: Plan
    root: nn.Module
    tapped: frozenset[str]
    infos: dict[str, ValueInfo]
    capture: str = "output"
    ran: bool = False
    """True when an example input ran: a site without a value did not run."""
    run: Callable[[tuple[Any, ...], dict[str, Any]], dict[str, Any]] | None = None
    """For a deployed artifact: run an example input, return every site's value."""
    dynamo: dict[str, int] = field(default_factory=dict)
    """Modules torch dynamo runs (drawn as one call each): their tapped sites, by path."""

def path_depth(path: str) -> int:
    return path.count(".") + 1 if path else 0


def path_parent(path: str) -> str:
    return path.rpartition(".")[0]


def path_prefix(path: str, n: int) -> str:
    return ".".join(path.split(".")[:n])


def path_inside(path: str, scope: str) -> bool:
    return scope == "" or path == scope or path.startswith(scope + ".")


_SIZE_METHODS = frozenset({"size", "dim", "numel", "ndimension", "nelement"})
_SIZE_ATTRS = frozenset({"shape", "ndim", "dtype", "device", "is_cuda"})
# Optional inputs whose default is one of these are drawn compactly.
_CONSTANTS = (type(None), bool, int, float, str)


def plumbing(graph: fx.Graph) -> set[fx.Node]:
    """The nodes that only compute sizes: ``x.size()``, ``x.shape`` and what Python operators
    and builtins make of them (``getitem``, ``+``, ``//``, tuples for ``view``), never a
    tensor op (``torch.zeros(x.size(0))`` is not plumbing)."""
    found: set[fx.Node] = set()
    for n in graph.nodes:
        if n.op == "call_method" and n.target in _SIZE_METHODS:
            found.add(n)
        elif n.op == "call_function" and n.target is getattr and len(n.args) > 1 \
                and n.args[1] in _SIZE_ATTRS:
            found.add(n)
        elif n.op == "call_function" and getattr(n.target, "__module__", None) in (
                "_operator", "operator", "builtins") and n.all_input_nodes \
                and all(a in found for a in n.all_input_nodes):
            found.add(n)
    return found


def _optional_input(node: fx.Node) -> bool:
    return node.op == "placeholder" and len(node.args) > 0 and isinstance(node.args[0],
                                                                           _CONSTANTS)


def items_of(p: Plan, tapped: frozenset[str] = frozenset(), show_plumbing: bool = True
           ) -> tuple[list[Item], list[tuple[str, str]]]:
    """Items in site order, and the data-flow edges between them (by item id)."""
    items: list[Item] = []
    edges: list[tuple[str, str]] = []
    by_name = {s.name: s for s in p.sites}
    placed: set[str] = set()
    regions_by_site: dict[str, tuple[Region, fx.Node]] = {}
    for region in p.regions.values():
        for node, site in region.sites():
            regions_by_site[site.name] = (region, node)
    node_ids: dict[tuple[str, fx.Node], str] = {}

    def add_region(region: Region) -> None:
        optional: list[fx.Node] = []
        folded: set[fx.Node] = set()
        if not show_plumbing:
            shape_ops = plumbing(region.graph)
            for node in region.graph.nodes:
                own = node_site(node)
                if own is not None and own.name in tapped:
                    continue  # a tapped site is always drawn
                # The model's own inputs stay: the user passes them (with other values).
                if own is not None and region.path and _optional_input(node):
                    optional.append(node)
                    folded.add(node)
                elif node in shape_ops or (node.op == "get_attr" and own is not None):
                    folded.add(node)
        sources: dict[fx.Node, list[str]] = {}  # what a folded node stands for, by item id
        names: dict[fx.Node, list[str]] = {}  # the folded sites behind a folded node

        def source_ids(n: fx.Node) -> list[str]:
            sid = node_ids.get((region.path, n))
            if sid is not None:
                return [sid]
            return sources.get(n, [])

        if optional:
            shown = [f"{str(n.target).lstrip('*')} (default {n.args[0]!r})" for n in optional]
            items.append(Item(f"{region.path}/optional", "optional", region.path,
                               folded=shown))
        for node in region.graph.nodes:
            if node in folded and node.op == "get_attr":
                continue  # drawn in the label of each op that reads it
            if node in folded:
                if node not in optional:
                    ids = [i for a in node.all_input_nodes for i in source_ids(a)]
                    sources[node] = list(dict.fromkeys(ids))
                    own = node_site(node)
                    behind = [x for a in node.all_input_nodes for x in names.get(a, [])]
                    names[node] = behind + ([own.name] if own is not None else [])
                continue
            if node.op == "output":
                oid = "/output" if not region.path else f"{region.path}/return"
                role = "output" if not region.path else "return"
                items.append(Item(oid, role, region.path))
                node_ids[(region.path, node)] = oid
            else:
                own = node_site(node)
                if own is None:
                    continue
                name = own.name
                site = by_name.get(name)
                module = own.module_path if node.op == "call_module" else None
                owner = own.module_path
                role = "input" if node.op == "placeholder" and not region.path else "site"
                items.append(Item(name, role, owner, module, site))
                placed.add(name)
                node_ids[(region.path, node)] = name
            target = node_ids.get((region.path, node))
            if target is None:
                continue
            direct = [src for src in node.all_input_nodes if src not in folded]
            for src in direct:
                sid = node_ids.get((region.path, src))
                if sid is not None:
                    edges.append((sid, target))
            for src in node.all_input_nodes:
                if src in folded and src.op == "get_attr":
                    items[-1].constants.append(str(src.target).rpartition(".")[2])
                elif not direct:  # only shape ops feed it: link what they measured
                    edges.extend((sid, target) for sid in source_ids(src))
                for name in names.get(src, []):
                    if name not in items[-1].folded:
                        items[-1].folded.append(name)

    if p.root_region is None:
        items.append(Item("/input", "input", ""))
        items.append(Item("/model", "module", "", ""))
        edges += [("/input", "/model"), ("/model", "/output")]
    done: set[str] = set()
    for s in p.sites:  # regions appear where their first site runs
        hit = regions_by_site.get(s.name)
        if hit is not None and hit[0].path not in done:
            done.add(hit[0].path)
            add_region(hit[0])
        elif s.how == "hook" and s.name not in placed:
            items.append(Item(s.name, "site", s.name, s.name, s))
            placed.add(s.name)
    for path, region in p.regions.items():
        if path not in done:
            add_region(region)
    modules = {it.module for it in items if it.module is not None}
    for f in p.fallbacks:
        if f.path and f.path not in modules:  # no site of its own: still show it
            items.append(Item(f"{f.path}/module", "module", f.path, f.path))
    if p.root_region is None:
        items.append(Item("/output", "output", ""))
    return items, edges


def collapse(items: list[Item], depth: int | None) -> dict[str, Item]:
    """Map each item id to what is drawn for it: itself, or the node of a collapsed module."""
    if depth is None:
        return {it.id: it for it in items}
    groups: dict[str, list[Item]] = {}
    for it in items:
        if path_depth(it.owner) > depth:
            groups.setdefault(path_prefix(it.owner, depth + 1), []).append(it)
    rep: dict[str, Item] = {}
    for it in items:
        if path_depth(it.owner) <= depth:
            rep[it.id] = it
            continue
        path = path_prefix(it.owner, depth + 1)
        members = groups[path]
        if all(m.module == path for m in members):
            rep[it.id] = it  # calls of a module with nothing drawn inside: draw the calls
            continue
        gid = f"{path}/group"
        group = rep.get(gid) or Item(gid, "group", path, path, None, members)
        rep[gid] = group
        rep[it.id] = group
    return rep
