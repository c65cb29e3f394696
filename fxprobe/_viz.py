"""Graph export: a model's sites as a Graphviz picture, tapped sites and hook fallbacks marked.

``to_dot`` draws the plan fxprobe makes of a model: every traced region's fx graph (one node per
site, edges for data flow), the modules that run as written because ``torch.fx`` could not trace
them (with the reason in a tooltip) and the hook sites inside them, all nested in clusters that
follow the module hierarchy. Shapes come from the last forward of a tapped module, or from
running an example input through a private copy of the model (no user hook, no tap, no change
to buffers or to the random number generator).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import fx, nn

from ._errors import ConfigError, RenderError
from ._mirror import drop_overrides, mirror
from ._options import TracerKind, check_choice
from ._program import check_model
from ._select import as_selectors, select
from ._shapes import propagate
from ._site import Site, node_site
from ._summary import ValueInfo, describe_value
from ._trace import Fallback, Plan, Region, plan

if TYPE_CHECKING:
    import graphviz

SUFFIXES = ("svg", "png", "pdf", "dot", "gv")
"""File suffixes ``render`` writes; ``dot`` and ``gv`` need no Graphviz program."""

_INSTALL_HINT = (
    "install Graphviz (apt install graphviz, brew install graphviz, or "
    "conda install -c conda-forge graphviz) so that 'dot' is on PATH, "
    "or write a .dot file, which needs no Graphviz program"
)
# Okabe-Ito colours: told apart with every common colour-vision deficiency; the tapped fill
# and the fallback border also differ in line weight and dash pattern, not only in hue.
_TAPPED_FILL = "#E69F00"
_FALLBACK_PEN = "#D55E00"
_IO_FILL = "#D7EAF8"
_GRAPH_ATTR = {"rankdir": "TB", "fontname": "Helvetica", "fontsize": "10", "newrank": "true",
               "nodesep": "0.2", "ranksep": "0.3", "labelloc": "t", "labeljust": "l"}
_NODE_ATTR = {"shape": "box", "style": "rounded,filled", "fillcolor": "white",
              "color": "#555555", "fontname": "Helvetica", "fontsize": "9",
              "margin": "0.08,0.03", "height": "0.3"}
_EDGE_ATTR = {"color": "#777777", "arrowsize": "0.6"}
_LEGEND = ("orange fill, bold border: tapped    dashed: reached by a module hook    "
           "red dashed: runs as written, torch.fx could not trace it (hover for why)    "
           "double border: module drawn as one node (depth)")


@dataclass(eq=False)
class _Item:
    """One thing to draw: a site, a module that runs as written, or a model input/output."""

    id: str
    role: str
    """site, input, output, return, module (an opaque module with no site of its own)."""
    owner: str
    """The module path this item belongs to, for clusters and for ``depth``."""
    module: str | None = None
    """For module calls and hook sites: the called module's path."""
    site: Site | None = None
    members: list[_Item] = field(default_factory=list)
    """For a collapsed module: the items it stands for."""
    folded: list[str] = field(default_factory=list)
    """Sites folded into this one: shape plumbing that feeds it, or optional inputs."""
    constants: list[str] = field(default_factory=list)
    """Attributes (parameters, buffers, constants) read by this op, drawn in its label."""


@dataclass
class _Scene:
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


def to_dot(obj: nn.Module, example_input: Any = None, *,
           example_kwargs: Mapping[str, Any] | None = None, ops: Any = None,
           depth: int | None = None, tracer: TracerKind = "auto", train: bool | None = None,
           rankdir: str = "TB", show_plumbing: bool = False) -> graphviz.Digraph:
    """Draw a tapped module, or a model, as a ``graphviz.Digraph``.

    Nodes are sites (name, op and, when known, dtype and shape); edges are data flow inside
    traced code. Tapped sites are filled orange with a bold border; sites reached by a module
    hook are dashed; modules that run as written because ``torch.fx`` could not trace them have
    a red dashed border and say why in their tooltip. Clusters follow the module hierarchy.

    Args:
        obj: a :class:`~fxprobe.TappedModule` (its selected sites are marked, and the shapes of
            its last forward shown) or any ``nn.Module`` (never modified).
        example_input: a tensor or a tuple of positional arguments to propagate shapes with:
            it runs through a private copy of the model, with no hook, tap or buffer update.
        example_kwargs: keyword arguments for that run.
        ops: for a plain model, the sites to mark as tapped (any ``ops=`` of ``fxprobe.tap``);
            None marks none.
        depth: draw every module nested deeper than ``depth`` levels as one node (0: only the
            model's direct children). None draws everything.
        tracer: for a plain model, as in ``fxprobe.tap``.
        train: for a plain model, draw its train-mode graph (default: its current mode).
        rankdir: Graphviz layout direction, ``"TB"`` (top to bottom) or ``"LR"``.
        show_plumbing: draw shape plumbing as nodes of its own. By default the ops that only
            compute sizes (``x.size()``, ``x.shape``, ``getitem`` and arithmetic on them, the
            tuples built for ``view``) are folded into the op they feed (listed in its
            tooltip; their inputs are linked to it), the attributes an op reads (``weight``,
            ``bias`` of a ``Conv1D``) are named in its label, and the inputs of a submodule
            traced on its own that have a default (``attn_mask=None``, ``is_causal=False``)
            are listed in one small node without edges. A tapped site is always drawn.

    Returns:
        A ``graphviz.Digraph``; ``.source`` is the DOT text, ``.pipe("svg")`` renders it.

    Raises:
        ConfigError: a bad ``depth`` or ``rankdir``, ``ops``/``tracer``/``train`` given with a
            tapped module, or an ``example_input`` the model cannot run.
        SelectorError: a selector in ``ops`` matches no site.

    Example:
        >>> dot = fxprobe.to_dot(model, torch.randn(1, 3, 224, 224), ops=nn.Conv2d, depth=2)
        >>> dot.pipe("svg")
    """
    graphviz = _import_graphviz()
    if depth is not None and (isinstance(depth, bool) or not isinstance(depth, int) or depth < 0):
        raise ConfigError(f"depth={depth!r} is not accepted; pass an int >= 0, or None")
    if rankdir not in ("TB", "LR", "BT", "RL"):
        raise ConfigError(f"rankdir={rankdir!r} is not accepted; use 'TB', 'LR', 'BT' or 'RL'")
    scene = _scene(obj, ops=ops, tracer=tracer, train=train)
    if example_input is not None or example_kwargs:
        args = _as_args(example_input)
        if scene.run is not None:  # a deployed artifact: run a tapped copy of it
            infos = {k: describe_value(v)
                     for k, v in scene.run(args, dict(example_kwargs or {})).items()}
        else:
            infos = propagate(scene.plan, scene.root, args, dict(example_kwargs or {}))
        scene.infos.update(infos)
        scene.ran = True
    return _draw(graphviz, scene, depth, rankdir, show_plumbing)


def render(obj: nn.Module, path: str | Path, **kwargs: Any) -> Path:
    """Write the picture of ``to_dot(obj, **kwargs)`` to ``path``, in the format of its suffix.

    ``.svg``, ``.png`` and ``.pdf`` are rendered by the Graphviz ``dot`` program; ``.dot`` (or
    ``.gv``) is the DOT text, which needs no Graphviz program.

    Returns:
        The path written.

    Raises:
        ConfigError: an unknown suffix. RenderError: ``dot`` is missing or fails.
    """
    path = Path(path)
    suffix = path.suffix.lower().lstrip(".")
    if suffix not in SUFFIXES:
        raise ConfigError(
            f"cannot tell the format of {str(path)!r} from its suffix; end the file name in "
            + ", ".join("." + s for s in SUFFIXES)
        )
    if not path.parent.is_dir():
        raise RenderError(
            f"cannot write {str(path)!r}: the folder {str(path.parent)!r} does not exist; "
            "create it first or pass a path in an existing folder"
        )
    dot = to_dot(obj, **kwargs)
    data = (dot.source.encode("utf-8") if suffix in ("dot", "gv")
            else pipe(dot, suffix, str(path)))
    try:
        path.write_bytes(data)
    except OSError as e:
        raise RenderError(f"cannot write {str(path)!r}: {e.strerror or e}") from e
    return path


def pipe(dot: graphviz.Digraph, fmt: str, what: str = "the picture") -> bytes:
    """Run the ``dot`` program on ``dot``'s source; a :class:`RenderError` says how to fix it."""
    graphviz = _import_graphviz()
    if shutil.which("dot") is None:
        raise RenderError(f"writing {what} needs the Graphviz 'dot' program, which is not on "
                          f"PATH; {_INSTALL_HINT}")
    try:
        data: bytes = dot.pipe(format=fmt)
    except graphviz.ExecutableNotFound as e:
        raise RenderError(f"writing {what} needs the Graphviz 'dot' program; "
                          f"{_INSTALL_HINT}") from e
    except graphviz.CalledProcessError as e:
        err = (e.stderr or b"").decode(errors="replace").strip().splitlines()
        raise RenderError(f"Graphviz 'dot' failed writing {what}: "
                          f"{err[0] if err else e}") from e
    return data


def _import_graphviz() -> Any:
    try:
        import graphviz
    except ImportError as e:  # a declared dependency, but an optional feature
        raise ImportError("fxprobe.to_dot needs the graphviz package: pip install graphviz "
                          f"(and, to render pictures, the Graphviz program: {_INSTALL_HINT})"
                          ) from e
    return graphviz


# -- what to draw ---------------------------------------------------------------------------

def _scene(obj: nn.Module, *, ops: Any, tracer: TracerKind, train: bool | None) -> _Scene:
    from ._artifact import TappedArtifact, artifact_kind

    if artifact_kind(obj) is not None or isinstance(obj, TappedArtifact):
        return _artifact_scene(obj, ops=ops, tracer=tracer, train=train)
    view = getattr(obj, "_fxprobe_view", None)
    if view is not None:
        given = [n for n, v in (("ops", ops), ("train", train)) if v is not None]
        given += ["tracer"] if tracer != "auto" else []
        if given:
            raise ConfigError(
                f"{', '.join(given)} cannot be given with a TappedModule, which is drawn with "
                "its own selection, tracer and mode; pass the model instead, or "
                "change the tapped module (fxprobe.tap(model, ops=...), tapped.train())"
            )
        v = view()
        scene = _Scene(v.title, v.plan, v.root, _drawn(v.plan, v.selected), {}, v.capture)
        for info in v.captures:
            scene.dynamo[info.path] = sum(
                1 for s in v.selected if s.how == "dynamo" and (
                    not info.path or s.module_path == info.path
                    or s.module_path.startswith(info.path + ".")))
        if v.taps is not None:
            scene.infos.update({name: describe_value(v.taps[name]) for name in v.taps})
        return scene
    obj = check_model(obj, "fxprobe.to_dot")
    check_choice("tracer", tracer, TracerKind)
    root = mirror(obj)
    drop_overrides(root)
    training = obj.training if train is None else bool(train)
    root.train(training)
    p = plan(root, tracer=tracer)
    chosen: list[Site] = []
    if ops is not None:
        mode = "train" if training else "eval"
        chosen = select(p.sites, as_selectors(ops), context=f"{type(obj).__name__} ({mode} mode)",
                        fallbacks=p.fallbacks)
    return _Scene(f"{type(obj).__name__} ({'train' if training else 'eval'} mode)", p, root,
                  _drawn(p, chosen), {})


def _artifact_scene(obj: Any, *, ops: Any, tracer: TracerKind, train: bool | None) -> _Scene:
    """A ScriptModule or ExportedProgram (or what fxprobe.tap made of one), as a scene."""
    from ._artifact import TappedArtifact, artifact_kind
    from ._artifact_viz import export_picture, script_picture

    given = ["train"] if train else []  # drawn in the mode the artifact is in
    given += ["tracer"] if tracer != "auto" else []
    tapped = obj if isinstance(obj, TappedArtifact) else None
    given += ["ops"] if ops is not None and tapped is not None else []
    if given:
        raise ConfigError(
            f"{', '.join(given)} cannot be given for a TorchScript module or an exported "
            "program, which is drawn from its graph as it is (and a tapped one with its own "
            "selection)")
    source = tapped.source if tapped is not None else obj
    if source is None:
        raise ConfigError(
            "this tapped artifact was loaded from a file and no longer holds the program it "
            "was made from; draw the original (fxprobe.to_dot(program, ops=...))")
    pic = script_picture(source) if artifact_kind(source) == "script" else export_picture(
        source)
    p = pic.plan
    if tapped is not None:
        chosen: Sequence[Site] = tapped.sites
    elif ops is not None:
        chosen = select(p.sites, as_selectors(ops), context=pic.title)
    else:
        chosen = []
    scene = _Scene(pic.title, p, pic.root, _drawn(p, chosen), {}, run=pic.run)
    if tapped is not None:
        taps = tapped.taps
        scene.infos.update({name: describe_value(taps[name]) for name in taps})
    return scene


def _drawn(p: Plan, selected: Sequence[Site]) -> frozenset[str]:
    """The names drawn as tapped: a module call fx traced through marks its last node."""
    names = {s.name for s in selected}
    for region in p.regions.values():
        for node, site in region.sites():
            if site.inlined and site.name in names:
                own = node_site(node)
                if own is not None:
                    names.add(own.name)
    return frozenset(names)


def _as_args(example_input: Any) -> tuple[Any, ...]:
    if example_input is None:
        return ()
    if isinstance(example_input, tuple):
        return example_input
    return (example_input,)


# -- drawing ----------------------------------------------------------------------------------

def _depth(path: str) -> int:
    return path.count(".") + 1 if path else 0


def _parent(path: str) -> str:
    return path.rpartition(".")[0]


def _prefix(path: str, n: int) -> str:
    return ".".join(path.split(".")[:n])


def _inside(path: str, scope: str) -> bool:
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


def _items(p: Plan, tapped: frozenset[str] = frozenset(), show_plumbing: bool = True
           ) -> tuple[list[_Item], list[tuple[str, str]]]:
    """Items in site order, and the data-flow edges between them (by item id)."""
    items: list[_Item] = []
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
            items.append(_Item(f"{region.path}/optional", "optional", region.path,
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
                items.append(_Item(oid, role, region.path))
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
                items.append(_Item(name, role, owner, module, site))
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
        items.append(_Item("/input", "input", ""))
        items.append(_Item("/model", "module", "", ""))
        edges += [("/input", "/model"), ("/model", "/output")]
    done: set[str] = set()
    for s in p.sites:  # regions appear where their first site runs
        hit = regions_by_site.get(s.name)
        if hit is not None and hit[0].path not in done:
            done.add(hit[0].path)
            add_region(hit[0])
        elif s.how == "hook" and s.name not in placed:
            items.append(_Item(s.name, "site", s.name, s.name, s))
            placed.add(s.name)
    for path, region in p.regions.items():
        if path not in done:
            add_region(region)
    modules = {it.module for it in items if it.module is not None}
    for f in p.fallbacks:
        if f.path and f.path not in modules:  # no site of its own: still show it
            items.append(_Item(f"{f.path}/module", "module", f.path, f.path))
    if p.root_region is None:
        items.append(_Item("/output", "output", ""))
    return items, edges


def _collapse(items: list[_Item], depth: int | None) -> dict[str, _Item]:
    """Map each item id to what is drawn for it: itself, or the node of a collapsed module."""
    if depth is None:
        return {it.id: it for it in items}
    groups: dict[str, list[_Item]] = {}
    for it in items:
        if _depth(it.owner) > depth:
            groups.setdefault(_prefix(it.owner, depth + 1), []).append(it)
    rep: dict[str, _Item] = {}
    for it in items:
        if _depth(it.owner) <= depth:
            rep[it.id] = it
            continue
        path = _prefix(it.owner, depth + 1)
        members = groups[path]
        if all(m.module == path for m in members):
            rep[it.id] = it  # calls of a module with nothing drawn inside: draw the calls
            continue
        gid = f"{path}/group"
        group = rep.get(gid) or _Item(gid, "group", path, path, None, members)
        rep[gid] = group
        rep[it.id] = group
    return rep


def _cluster_of(item: _Item, drawn: list[_Item]) -> str:
    if item.role == "group":
        return _parent(item.owner)
    if item.module is None or item.module == "":
        return item.owner
    m = item.module
    for other in drawn:
        if other is item or other.module == m and other.role != "group":
            continue
        if other.owner == m or other.owner.startswith(m + "."):
            return m  # the module has things drawn inside it: the call sits in its box
    return _parent(m)


def _draw(graphviz: Any, scene: _Scene, depth: int | None, rankdir: str,
          show_plumbing: bool = True) -> Any:
    p = scene.plan
    items, edges = _items(p, scene.tapped, show_plumbing)
    folded = len({name for it in items if it.role != "optional" for name in it.folded})
    rep = _collapse(items, depth)
    drawn: list[_Item] = []
    seen: set[str] = set()
    for it in items:
        r = rep[it.id]
        if r.id not in seen:
            seen.add(r.id)
            drawn.append(r)
    fallbacks = {f.path: f for f in p.fallbacks}
    clusters: dict[str, list[_Item]] = {}
    for it in drawn:
        clusters.setdefault(_cluster_of(it, drawn), []).append(it)
    root_fallback = "" in fallbacks

    dot = graphviz.Digraph(name=_text(scene.title), graph_attr={**_GRAPH_ATTR,
                           "rankdir": rankdir, "label": _caption(scene, depth, folded)},
                           node_attr=_NODE_ATTR, edge_attr=_EDGE_ATTR)
    dot.comment = "fxprobe.to_dot"
    first: dict[str, int] = {}  # clusters in the order their first item is drawn
    where = {id(it): scope for scope, members in clusters.items() for it in members}
    for i, it in enumerate(drawn):
        scope = where[id(it)]
        for k in range(1, _depth(scope) + 1):
            first.setdefault(_prefix(scope, k), i)
    paths = list(first)

    def emit(g: Any, scope: str) -> None:
        for it in clusters.get(scope, []):
            if scope == "" and it.role in ("input", "output"):
                continue
            g.node(_text(it.id), **_node_attrs(it, scene, fallbacks, depth))
        for child in paths:
            if child and _parent(child) == scope:
                with g.subgraph(name=_text(f"cluster_{child}")) as c:
                    c.attr(**_cluster_attrs(child, scene, fallbacks))
                    emit(c, child)

    for role, rank in (("input", "source"), ("output", "sink")):  # model inputs on top
        with dot.subgraph(name=f"{role}s") as g:
            g.attr(rank=rank)
            for it in clusters.get("", []):
                if it.role == role:
                    g.node(_text(it.id), **_node_attrs(it, scene, fallbacks, depth))
    if root_fallback:
        with dot.subgraph(name="cluster_/") as c:
            c.attr(**_cluster_attrs("", scene, fallbacks))
            emit(c, "")
    else:
        emit(dot, "")
    real: dict[tuple[str, str], None] = {}  # deduplicated, in order
    for a, b in edges:
        if rep[a] is not rep[b]:
            real[(rep[a].id, rep[b].id)] = None
    for a, b in _order_edges(scene, drawn, clusters, paths, where, fallbacks, list(real)):
        dot.edge(_text(a), _text(b), style="invis")
    for a, b in real:
        dot.edge(_text(a), _text(b))
    return dot


def _order_edges(scene: _Scene, drawn: list[_Item], clusters: Mapping[str, list[_Item]],
                 paths: list[str], where: Mapping[int, str], fallbacks: Mapping[str, Any],
                 real: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Invisible edges that stack what runs inside an untraced module in execution order.

    fx sees no data flow there; without these, Graphviz spreads the module's hook sites and
    traced children side by side in arbitrary order. The module's own call comes last: its
    node stands for the value that leaves it, and what feeds the call is drawn above it all.
    """
    regions = list(scene.plan.regions)
    index = {id(it): i for i, it in enumerate(drawn)}
    span: dict[str, tuple[_Item, _Item]] = {}  # first and last item drawn inside each cluster
    for it in drawn:
        scope = where[id(it)]
        for k in range(0, _depth(scope) + 1):
            q = _prefix(scope, k)
            first, _ = span.get(q, (it, it))
            span[q] = (first, it)
    out: list[tuple[str, str]] = []
    for scope in ["", *paths]:
        traced = any(_inside(scope, r) for r in regions) and scope not in fallbacks
        if traced or scope not in span:
            continue
        parts: list[tuple[int, str, str]] = []
        call: _Item | None = None
        for it in clusters.get(scope, []):
            if it.module == scope and it.role != "group":
                call = it
            elif it.role not in ("input", "output"):
                parts.append((index[id(it)], it.id, it.id))
        for child in paths:
            if child and _parent(child) == scope:
                first, last = span[child]
                parts.append((index[id(first)], first.id, last.id))
        parts.sort()
        chain = [(a, b) for _, a, b in parts]
        if call is not None:
            chain.append((call.id, call.id))
        if scope == "" and chain:
            chain.insert(0, ("/input", "/input"))
        out += [(chain[i][1], chain[i + 1][0]) for i in range(len(chain) - 1)]
        if call is not None and len(chain) > 1:
            ids = {it.id for it in drawn if _inside(where[id(it)], scope)}
            out += [(a, chain[0][0]) for a, b in real if b == call.id and a not in ids]
    return out


def _caption(scene: _Scene, depth: int | None, folded: int = 0) -> str:
    p = scene.plan
    nodes = [s for s in p.sites if not s.inlined]
    hooks = sum(1 for s in nodes if s.how == "hook")
    tapped = [s for s in nodes if s.name in scene.tapped]
    tapped_hooks = sum(1 for s in tapped if s.how == "hook")
    line = (f"{scene.title}: {len(nodes)} sites ({len(nodes) - hooks} fx, {hooks} hook), "
            f"{len(tapped)} tapped ({len(tapped) - tapped_hooks} fx, {tapped_hooks} hook), "
            f"{len(p.fallbacks)} module(s) run as written")
    for path, n in scene.dynamo.items():
        line += (f", {path or 'the model'} runs under torch dynamo ({n} tapped site(s) in "
                 "its graphs, drawn as one call)")
    if scene.run is not None:  # a deployed artifact: every site is a value of its graph
        line = f"{scene.title}: {len(nodes)} sites, {len(tapped)} tapped"
    if depth is not None:
        line += f", modules nested deeper than {depth} drawn as one node"
    if folded:
        line += f", {folded} shape ops folded into the ops they feed (show_plumbing=True)"
    return _text(line) + "\\l" + _text(_LEGEND) + "\\l"


def _node_attrs(it: _Item, scene: _Scene, fallbacks: Mapping[str, Any],
                depth: int | None) -> dict[str, str]:
    infos = scene.infos
    attrs: dict[str, str] = {}
    classes: list[str] = [it.role]
    tip: list[str] = []
    fallback = fallbacks.get(it.module) if it.module is not None else None
    if it.role == "group":
        lines, tip, tapped, fallback = _group_text(it, scene, fallbacks, depth)
        attrs.update(style="filled", peripheries="2")
        classes.append("collapsed")
    elif it.site is not None:
        s = it.site
        tapped = s.name in scene.tapped
        lines = [s.name, _module_type(scene, it.module) if it.module else s.op]
        tip = [f"{s.name}: {s.op} ({s.kind}, reached by {s.how})",
               f"in module: {s.module_path or '(top level)'}"]
        if s.how == "hook":
            attrs["style"] = "rounded,filled,dashed"
            classes.append("hook")
        if it.role == "input":
            attrs["shape"] = "invhouse"
            attrs["fillcolor"] = _IO_FILL
            tip.append("model input")
        elif s.kind == "placeholder":
            attrs["shape"] = "invhouse"
            tip.append(f"input of the traced module {s.module_path}")
    elif it.role == "optional":
        tapped = False
        lines = ["inputs with defaults:", *it.folded]
        tip = [f"inputs of {it.owner} that have a default, drawn without edges "
               "(show_plumbing=True draws them as inputs)", *it.folded]
        attrs.update(shape="note", fontsize="7", height="0.2", style="filled",
                     fillcolor=_IO_FILL)
    else:
        tapped = False
        if it.role == "module":
            name = "model" if it.id == "/model" else it.module or ""
            lines = [name, _module_type(scene, it.module or "")]
            if fallback is None:
                lines.append("hooks only")
                tip = ["tracer='hooks': reached by module hooks only"]
            attrs["style"] = "filled,dashed"
        else:
            lines = {"input": ["input"], "output": ["output"], "return": ["return"]}[it.role]
            attrs["shape"] = "invhouse" if it.role == "input" else "house"
            if it.role == "return":
                attrs["fontsize"] = "8"
                tip = [f"output of the traced module {it.owner}"]
            else:
                attrs["fillcolor"] = _IO_FILL
                tip = [f"model {it.role}"]
    info = infos.get(it.id if it.role != "group" else "")
    if it.role == "group":
        info = _group_info(it, infos)
    if info is not None and info.label:
        shown = f"in: {info.label}" if it.site is not None and scene.capture == "input" \
            and it.site.name in scene.tapped else info.label
        lines.append(shown)
        tip.append(shown)
    elif scene.ran and it.site is not None:
        lines.append("not run")
        tip.append("did not run with the example input")
    if it.constants:
        lines.insert(2, "uses " + ", ".join(it.constants))
        tip.append("reads attributes: " + ", ".join(it.constants))
    if it.folded and it.role != "optional":
        tip.append("shape ops folded in: " + ", ".join(it.folded))
    if fallback is not None:
        lines.append("runs as written")
        tip += _fallback_tip(fallback)
        attrs.update(color=_FALLBACK_PEN, penwidth="1.5")
        attrs["style"] = "filled,dashed" if it.role in ("group", "module") \
            else "rounded,filled,dashed"
        classes.append("fallback")
    if tapped:
        attrs.update(fillcolor=_TAPPED_FILL, penwidth="2.5")
        if fallback is None:
            attrs["color"] = "black"
        classes.append("tapped")
        tip.append("tapped")
    attrs["label"] = "\\n".join(_text(x) for x in lines)
    attrs["tooltip"] = "\\n".join(_text(x) for x in tip) if tip else attrs["label"]
    attrs["class"] = " ".join(f"fxprobe-{c}" for c in classes)
    return attrs


def _group_text(it: _Item, scene: _Scene, fallbacks: Mapping[str, Any], depth: int | None
                ) -> tuple[list[str], list[str], bool, Any]:
    sites = [m.site for m in it.members if m.site is not None]
    tapped = [s.name for s in sites if s.name in scene.tapped]
    inner = [f for path, f in fallbacks.items() if path and _inside(path, it.owner)]
    mtype = _module_type(scene, it.owner)
    count = f"{len(sites)} sites" + (f", {len(tapped)} tapped" if tapped else "")
    lines = [it.owner, mtype, count]
    tip = [f"{it.owner} ({mtype}): drawn as one node at depth={depth}; {count}"]
    if tapped:
        tip.append("tapped: " + ", ".join(tapped[:12]) + (" ..." if len(tapped) > 12 else ""))
    for f in inner[1:] if inner and inner[0].path == it.owner else inner:
        tip += _fallback_tip(f)
    own = fallbacks.get(it.owner)
    return lines, tip, bool(tapped), own if own is not None else (inner[0] if inner else None)


def _group_info(it: _Item, infos: Mapping[str, ValueInfo]) -> ValueInfo | None:
    # Members are in site (execution) order, so the last one with a value is, for the usual
    # block, its output: the value that leaves the module.
    known = [infos[m.id] for m in it.members if m.id in infos and m.role != "input"]
    return known[-1] if known else None


def _fallback_tip(f: Fallback) -> list[str]:
    tip = [f"{f.where} ({f.module_type.__name__}) runs as written: torch.fx could not trace it",
           f.error]
    if f.location:
        tip.append(f"at {f.location}")
    tip.append("modules inside it are reached by hooks; traceable ones are traced on their own")
    return tip


def _cluster_attrs(path: str, scene: _Scene, fallbacks: Mapping[str, Any]) -> dict[str, str]:
    mtype = _module_type(scene, path)
    name = path or scene.title.split(" (")[0]
    f = fallbacks.get(path)
    if f is None:
        return {"label": _text(f"{name} ({mtype})"), "style": "rounded", "color": "#AAAAAA",
                "fontcolor": "#444444", "fontsize": "9", "tooltip": _text(f"{name} ({mtype})"),
                "class": "fxprobe-module"}
    return {"label": _text(f"{name} ({mtype}): runs as written, hooks inside"),
            "style": "dashed,filled", "fillcolor": "#F4F4F4", "color": _FALLBACK_PEN,
            "penwidth": "1.5", "fontcolor": "#222222", "fontsize": "9",
            "tooltip": "\\n".join(_text(x) for x in _fallback_tip(f)),
            "class": "fxprobe-fallback"}


def _module_type(scene: _Scene, path: str) -> str:
    try:
        return type(scene.root.get_submodule(path) if path else scene.root).__name__
    except AttributeError:
        return "module"


def _text(s: str) -> str:
    """Text for a DOT attribute: backslashes kept literal (``\\N`` and ``\\l`` not expanded)."""
    import graphviz

    out: str = graphviz.nohtml(s.replace("\\", "\\\\"))
    return out
