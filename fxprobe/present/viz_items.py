"""What the picture of a model holds: the items (sites, calls, inputs) and the edges between them.

``to_dot`` reads a model into a :class:`Scene` (``present.viz``), turns it into :class:`Item` s
in execution order with the data-flow edges between them (this module), and emits DOT text
(``fxprobe.present.viz_dot``). Here: which node of which graph becomes an item, what is folded into
what (shape plumbing, attributes, inputs with defaults), which items a ``depth`` collapses, and
which runs of repeated blocks fold into one node.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import fx, nn

from ..core.site import Site, node_site
from ..core.view import CapturedGraph, Plan, ValueInfo, is_state


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
    graph: str | None = None
    """For the items of a graph torch dynamo captured: its key in ``tapped.graphs``."""
    span: list[str] = field(default_factory=list)
    """For a node standing for a run of repeated blocks: their paths (:func:`fold_blocks`)."""


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
    artifact: bool = False
    """A deployed artifact: every site is a value of its one graph."""
    dynamo: dict[str, int] = field(default_factory=dict)
    """Modules torch dynamo runs: their tapped sites, by path."""
    graphs: dict[str, list[CapturedGraph]] = field(default_factory=dict)
    """The graphs dynamo captured that are drawn op by op, by the path of the module it runs
    (see :func:`newest`); a module dynamo runs without any is drawn as one call."""
    selected: tuple[Site, ...] = ()
    """The sites tapped (``tapped.sites``) or marked with ``ops=``, as the user selected them."""


@dataclass
class Folded:
    """What the picture leaves out by default (``show_plumbing=True`` draws it), for the
    caption."""

    shape_ops: set[str] = field(default_factory=set)
    """Shape plumbing folded into the ops it feeds, by site name."""
    inputs: list[str] = field(default_factory=list)
    """The model's inputs left at a constant default (``attn_mask=None``), as ``name=value``."""
    modules: dict[str, list[str]] = field(default_factory=dict)
    """Modules that pass their input through unchanged (``Identity``, ``Dropout`` in eval
    mode), by type name: their input is drawn going straight to their users."""
    blocks: list[Item] = field(default_factory=list)
    """The nodes that stand for runs of repeated blocks (:func:`fold_blocks`)."""

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


def passes_through(module: nn.Module) -> bool:
    """Whether ``module`` returns its input unchanged: ``nn.Identity``, or a dropout module in
    eval mode (or with ``p=0``)."""
    if isinstance(module, nn.Identity):
        return True
    if isinstance(module, nn.modules.dropout._DropoutNd):
        return not module.training or module.p == 0
    return False


def _no_value(node: fx.Node) -> bool:
    """``torch._assert(...)`` and friends: checks that compute no value anything reads."""
    return node.op == "call_function" and node.target in (torch._assert,
                                                          torch._assert_async) \
        and not node.users


def items_of(p: Plan, tapped: frozenset[str] = frozenset(), show_plumbing: bool = True,
             graphs: Mapping[str, Sequence[CapturedGraph]] | None = None,
             root: nn.Module | None = None,
             given: Callable[[str, object], bool] = lambda name, default: False,
             folds: Folded | None = None,
             ) -> tuple[list[Item], list[tuple[str, str]], list[tuple[str, str]]]:
    """Items in site order, the data-flow edges between them (by item id), and the pairs to
    stack in execution order that no data flow links (the graphs of a module dynamo runs,
    one after another, then the module's call).

    Unless ``show_plumbing``, what is folded is noted in ``folds``: shape ops, the model's
    inputs left at a constant default (unless ``given(name, default)``: an example input gave
    them another value), and the modules of ``root`` that pass their input through.
    """
    folds = folds if folds is not None else Folded()
    items: list[Item] = []
    edges: list[tuple[str, str]] = []
    by_name = {s.name: s for s in p.sites}
    placed: set[str] = set()
    regions_by_site: dict[str, str] = {}
    for region in p.regions.values():
        for _node, site in region.sites():
            regions_by_site[site.name] = region.path
    node_ids: dict[tuple[str, fx.Node], str] = {}
    stood: dict[tuple[str, fx.Node], list[str]] = {}  # the items a folded node stands for
    graphs = graphs or {}
    whole = graphs.get("") if p.root_region is None else None  # the model, under dynamo

    def add_graph(key: str, path: str, graph: fx.Graph, out: str | None,
                  dynamo: CapturedGraph | None = None,
                  feeds: Mapping[fx.Node, list[str]] | None = None) -> None:
        """The items of one graph; ``key`` tells its nodes apart from other graphs'. ``feeds``:
        the items its inputs are drawn from (a block's graph, fed by the op that calls it)."""
        gkey = dynamo.key if dynamo is not None else None
        optional: list[fx.Node] = []
        folded: set[fx.Node] = set()
        through: set[fx.Node] = set()  # modules that return their input: linked across
        if not show_plumbing:
            shape_ops = plumbing(graph)
            for node in graph.nodes:
                own = node_site(node)
                if own is not None and own.name in tapped:
                    continue  # a tapped site is always drawn
                if own is not None and _optional_input(node) and not (
                        not path and given(own.name, node.args[0])):
                    optional.append(node)
                    folded.add(node)
                    if not path:  # the model's: named in the caption, no edge down the picture
                        folds.inputs.append(f"{own.name}={node.args[0]!r}")
                elif node in shape_ops or _no_value(node) or (
                        node.op == "get_attr" and own is not None):
                    folded.add(node)
                    if own is not None and node.op != "get_attr":
                        folds.shape_ops.add(own.name)
                elif own is not None and own.kind == "call_module" and root is not None \
                        and len(node.all_input_nodes) == 1 and _through(root, own):
                    folded.add(node)
                    through.add(node)
                    kind = type(root.get_submodule(own.module_path)).__name__
                    folds.modules.setdefault(kind, []).append(own.name)
        sources: dict[fx.Node, list[str]] = dict(feeds or {})  # what a folded node stands for
        names: dict[fx.Node, list[str]] = {}  # the folded sites behind a folded node

        def source_ids(n: fx.Node) -> list[str]:
            sid = node_ids.get((key, n))
            if sid is not None:
                return [sid]
            return sources.get(n, [])

        if optional and path:  # a submodule traced on its own: a note in its box
            shown = [f"{str(n.target).lstrip('*')} (default {n.args[0]!r})" for n in optional]
            items.append(Item(f"{path}/optional", "optional", path, folded=shown))
        for node in graph.nodes:
            if node in folded and node.op == "get_attr":
                continue  # drawn in the label of each op that reads it
            if node in folded:
                if node not in optional:
                    ids = [i for a in node.all_input_nodes for i in source_ids(a)]
                    sources[node] = stood[(key, node)] = list(dict.fromkeys(ids))
                    own = node_site(node)
                    behind = [x for a in node.all_input_nodes for x in names.get(a, [])]
                    names[node] = behind + ([own.name] if own is not None
                                            and node not in through else [])
                continue
            if node.op == "output":
                # Not the key itself: graphviz reads a colon in an edge's end as a port.
                oid = out or (f"{path}/dynamo{key.split(':', 2)[2]}/return" if dynamo
                              else f"{path}/return")
                if out is None or dynamo is None:  # the whole model's: appended last; an
                    # item of another graph (the op calling a block): there already
                    items.append(Item(oid, "output" if oid == "/output" else "return", path,
                                      graph=gkey))
                node_ids[(key, node)] = oid
            else:
                own = node_site(node)
                if own is None or own.name in placed:  # drawn once, whatever the graphs
                    continue
                name = own.name
                site = by_name.get(name, own if dynamo is not None else None)
                module = own.module_path if own.kind == "call_module" else None
                owner = own.module_path
                role = "input" if node.op == "placeholder" and not path else "site"
                items.append(Item(name, role, owner, module, site,
                                  graph=gkey))
                placed.add(name)
                node_ids[(key, node)] = name
            target = node_ids.get((key, node))
            if target is None:
                continue
            direct = [src for src in node.all_input_nodes
                      if src not in folded or src in through]
            for src in direct:
                edges.extend((sid, target) for sid in source_ids(src))
            for src in node.all_input_nodes:
                if src in folded and src.op == "get_attr":
                    items[-1].constants.append(str(src.target).rpartition(".")[2])
                elif not direct:  # only shape ops feed it: link what they measured
                    edges.extend((sid, target) for sid in source_ids(src))
                for name in names.get(src, []):
                    if name not in items[-1].folded:
                        items[-1].folded.append(name)

    def add_region(path: str) -> None:
        region = p.regions[path]
        add_graph(path, path, region.graph, None if path else "/output")

    if p.root_region is None:
        items.append(Item("/input", "input", ""))
        if not whole:
            items.append(Item("/model", "module", "", ""))
            edges += [("/input", "/model"), ("/model", "/output")]
    done: set[str] = set()
    for s in p.sites:  # regions appear where their first site runs
        hit = regions_by_site.get(s.name)
        if hit is not None and hit not in done:
            done.add(hit)
            add_region(hit)
        elif s.how == "hook" and s.name not in placed:
            items.append(Item(s.name, "site", s.name, s.name, s))
            placed.add(s.name)
    for path in p.regions:
        if path not in done:
            add_region(path)
    after: list[tuple[str, str]] = []
    for path, drawn in graphs.items():
        after += _add_dynamo(path, drawn, items, edges, add_graph, node_ids, stood,
                             not path and whole is not None)
    modules = {it.module for it in items if it.module is not None}
    for f in p.fallbacks:
        if f.path and f.path not in modules:  # no site of its own: still show it
            items.append(Item(f"{f.path}/module", "module", f.path, f.path))
    if p.root_region is None:
        items.append(Item("/output", "output", ""))
    return items, edges, after


def _add_dynamo(path: str, drawn: Sequence[CapturedGraph], items: list[Item],
                edges: list[tuple[str, str]], add_graph: Callable[..., None],
                node_ids: dict[tuple[str, fx.Node], str],
                stood: Mapping[tuple[str, fx.Node], list[str]],
                whole: bool) -> list[tuple[str, str]]:
    """Draw the graphs of the module dynamo runs at ``path``, one after another; return the
    pairs that stack them (and the module's call after them) in the order they ran. A graph
    one op of another runs (a repeated block's, ``CapturedGraph.called_by``) is drawn inside
    that op's block instead: fed from what feeds the op, into the op's value."""
    spans: list[tuple[str, str]] = []
    stacked = [g for g in drawn if not g.called_by]
    for i, g in enumerate(stacked):
        start = len(items)
        if whole and i == 0:  # the model's inputs feed the first graph
            for node in g.graph.nodes:
                if node.op == "placeholder" and not is_state(node):
                    node_ids[(g.key, node)] = "/input"
        add_graph(g.key, path, g.graph, "/output" if whole and i == len(stacked) - 1 else None, g)
        if len(items) > start:
            last = items[-1].id if not (whole and i == len(stacked) - 1) else "/output"
            spans.append((items[start].id, last))
    for g in drawn:
        if g.called_by:
            _add_called(g, path, stacked, edges, add_graph, node_ids, stood)
    after = [(spans[i][1], spans[i + 1][0]) for i in range(len(spans) - 1)]
    if not spans or whole:
        return after
    inside = {it.id for it in items if path_inside(it.owner, path) and it.graph is not None}
    for it in items:
        if it.module == path and it.graph is None and it.site is not None:  # the call
            after.append((spans[-1][1], it.id))
            after += [(a, spans[0][0]) for a, b in edges if b == it.id and a not in inside]
    return after


def _add_called(g: CapturedGraph, path: str, stacked: Sequence[CapturedGraph],
                edges: list[tuple[str, str]], add_graph: Callable[..., None],
                node_ids: dict[tuple[str, fx.Node], str],
                stood: Mapping[tuple[str, fx.Node], list[str]]) -> None:
    """Draw the graph of a repeated block inside the op that calls it (in one of ``stacked``):
    each input from what feeds that argument of the op, its output into the op's item (whose
    edges from the op's arguments it replaces). Not found (the op's graph not drawn): drawn
    on its own, its inputs unlinked."""
    call: tuple[str, fx.Node] | None = None
    for other in stacked:
        for node in other.graph.nodes:
            own = node_site(node)
            if own is not None and own.kind == "call_module" \
                    and own.module_path == g.called_by and (other.key, node) in node_ids:
                call = (node_ids[(other.key, node)], node)
                break
        if call is not None:
            key = other.key
            break
    if call is None:
        add_graph(g.key, path, g.graph, None, g)
        return
    call_id, node = call
    feeds: dict[fx.Node, list[str]] = {}
    for ph in g.graph.find_nodes(op="placeholder"):
        where = g.inputs.get(ph.name)
        value: object = (node.args, node.kwargs) if where is not None else None
        for step in where or ():
            try:
                value = value[step]  # type: ignore[index]
            except (IndexError, KeyError, TypeError):
                value = None
                break
        if isinstance(value, fx.Node):
            drawn = node_ids.get((key, value))
            feeds[ph] = [drawn] if drawn is not None else list(stood.get((key, value), []))
    edges[:] = [e for e in edges if e[1] != call_id]
    add_graph(g.key, path, g.graph, call_id, g, feeds)


def _through(root: nn.Module, site: Site) -> bool:
    try:
        return passes_through(root.get_submodule(site.module_path))
    except AttributeError:
        return False


def newest(graphs: Sequence[CapturedGraph]) -> dict[str, list[CapturedGraph]]:
    """The graphs to draw, by the path of the module dynamo runs: of each frame and module
    instance the newest capture (a recompilation for a new shape replaces the graph it was
    made for), in the order they ran in the last forward that ran them (never run: last)."""
    last: dict[tuple[str, int, str], CapturedGraph] = {}
    for g in graphs:
        last[(g.path, g.frame if g.frame is not None else -1 - g.number, g.instance)] = g
    out: dict[str, list[CapturedGraph]] = {}
    never = (1 << 62, 0)
    for g in sorted(last.values(), key=lambda g: (g.ran if g.ran[0] >= 0 else never, g.number)):
        out.setdefault(g.path, []).append(g)
    return out


def collapse(items: list[Item], depth: int | None, focus: str | None = None
             ) -> dict[str, Item]:
    """Map each item id to what is drawn for it: itself, or the node of a collapsed module.

    ``focus`` names a module drawn whole: nothing inside it is collapsed, and the modules
    around it on its path are opened down to it (their other children collapse as usual).
    """
    if depth is None:
        return {it.id: it for it in items}

    def group_of(owner: str) -> str | None:
        """The collapsed module ``owner`` is drawn in, or None to draw the item itself."""
        if focus is not None and path_inside(owner, focus):
            return None
        n = depth + 1
        while focus is not None and n <= path_depth(owner) \
                and path_inside(focus, path_prefix(owner, n)):
            n += 1  # an ancestor of the focus: opened
        return path_prefix(owner, n) if path_depth(owner) >= n else None

    groups: dict[str, list[Item]] = {}
    for it in items:
        g = group_of(it.owner)
        if g is not None:
            groups.setdefault(g, []).append(it)
    rep: dict[str, Item] = {}
    for it in items:
        path = group_of(it.owner)
        if path is None:
            rep[it.id] = it
            continue
        members = groups[path]
        if all(m.module == path for m in members):
            rep[it.id] = it  # calls of a module with nothing drawn inside: draw the calls
            continue
        gid = f"{path}/group"
        group = rep.get(gid) or Item(gid, "group", path, path, None, members)
        rep[gid] = group
        rep[it.id] = group
    return rep


# -- repeated blocks folded -------------------------------------------------------------------
# A run of sibling blocks of one class (ResNet's layer3.0 ... layer3.5, a ViT's 12 encoder
# layers) is drawn as its first block, whole, then one node that stands for the others, whose
# tooltip lists their sites. ``fold=False`` draws every block.

MIN_RUN = 3
"""The fewest sibling blocks of one class that fold (the first drawn, the others one node)."""

TIP_LINES = 200
"""The most sites a collapsed node's tooltip lists (the rest are counted)."""

_NUMBERED = re.compile(r"^(.*?)(\d+)$")


_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


def block_runs(root: nn.Module) -> list[list[str]]:
    """Runs of at least :data:`MIN_RUN` consecutive sibling modules that hold submodules, are
    of one class, and are named alike but for a trailing number (``0``, ``1``, ... of a
    ``Sequential``/``ModuleList``; ``encoder_layer_0``, ...): their paths, in order.

    Containers (``Sequential``, ``ModuleList``, ``ModuleDict``: ResNet's ``layer1`` ...
    ``layer4``) are stages, not blocks, and do not fold: their blocks do.
    """
    runs: list[list[str]] = []
    for path, module in root.named_modules():
        run: list[str] = []
        key: tuple[object, ...] | None = None
        for name, child in module.named_children():
            m = _NUMBERED.match(name)
            this = (type(child), m.group(1)) if m and not _container(child) \
                and any(True for _ in child.children()) else None
            if this is not None and this == key:
                run.append(f"{path}.{name}" if path else name)
                continue
            if len(run) >= MIN_RUN:
                runs.append(run)
            key, run = this, ([f"{path}.{name}" if path else name] if this else [])
        if len(run) >= MIN_RUN:
            runs.append(run)
    return runs


def _container(module: nn.Module) -> bool:
    # by name too: a deployed artifact's stand-in modules only carry the class names
    return isinstance(module, _CONTAINERS) or type(module).__name__ in (
        "Sequential", "ModuleList", "ModuleDict")


def fold_blocks(items: Sequence[Item], rep: dict[str, Item], runs: Sequence[Sequence[str]],
                depth: int | None, focus: str | None) -> tuple[dict[str, Item], list[Item]]:
    """``rep`` (item id -> what is drawn for it) with the items of every run's blocks but the
    first mapped to one node for the run; returns it and the fold nodes made.

    A run whose blocks ``depth`` draws as one node each (or hides in a bigger one) is left as
    it is, and so is one that holds the focus or lies inside it.
    """
    rep = dict(rep)
    made: list[Item] = []
    for run in runs:
        if depth is not None and path_depth(run[0]) > depth:
            continue  # each block is one node already, or inside one
        if focus is not None and any(path_inside(focus, b) or path_inside(b, focus)
                                     for b in run):
            continue
        rest = run[1:]
        members = [it for it in items
                   if any(path_inside(rep[it.id].owner, b) for b in rest)]
        if not members:
            continue
        node = Item(f"{rest[0]}/fold", "group", rest[0], rest[0], None, members,
                    span=list(rest))
        for it in members:
            rep[it.id] = node
        rep[node.id] = node
        made.append(node)
    return rep, made


def site_lines(sites: Sequence[Site], infos: Mapping[str, ValueInfo]) -> list[str]:
    """One tooltip line per site: ``layer1.1.conv1: Conv2d float32 [1, 64, 56, 56]``, at most
    :data:`TIP_LINES` of them."""
    lines = []
    for s in sites[:TIP_LINES]:
        info = infos.get(s.name)
        shown = f" {info.label}" if info is not None and info.label else ""
        lines.append(f"{s.name}: {s.op}{shown}")
    if len(sites) > TIP_LINES:
        lines.append(f"... and {len(sites) - TIP_LINES} more")
    return lines
