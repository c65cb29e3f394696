"""DOT emission for ``to_dot``: clusters that follow the module hierarchy, labels, tooltips,
classes and colours of the items ``fxprobe.present.viz_items`` collected, and the caption."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..core.site import node_site
from ..core.view import CapturedGraph, Fallback, ValueInfo
from .summary import describe_value
from .viz_items import (
    Folded,
    Item,
    Scene,
    block_runs,
    collapse,
    fold_blocks,
    items_of,
    path_depth,
    path_inside,
    path_parent,
    path_prefix,
    site_lines,
)

# Okabe-Ito colours: told apart with every common colour-vision deficiency; the tapped fill
# and the fallback border also differ in line weight and dash pattern, not only in hue.
_TAPPED_FILL = "#E69F00"
_FALLBACK_PEN = "#D55E00"
_IO_FILL = "#D7EAF8"
_GRAPH_ATTR = {"rankdir": "TB", "fontname": "Helvetica", "fontsize": "10", "newrank": "true",
               "nodesep": "0.2", "ranksep": "0.25", "labelloc": "t", "labeljust": "l"}
_NODE_ATTR = {"shape": "box", "style": "rounded,filled", "fillcolor": "white",
              "color": "#555555", "fontname": "Helvetica", "fontsize": "9",
              "margin": "0.08,0.03", "height": "0.3"}
_EDGE_ATTR = {"color": "#777777", "arrowsize": "0.6"}
_LEGEND = ("orange fill, bold border: tapped    dashed: reached by a module hook    "
           "red dashed: runs as written, torch.fx could not trace it (hover for why)    "
           "double border: module drawn as one node (depth)")


def _cluster_of(item: Item, drawn: list[Item]) -> str:
    if item.role == "group":
        return path_parent(item.owner)
    if item.module is None or item.module == "":
        return item.owner
    m = item.module
    for other in drawn:
        if other is item or other.module == m and other.role != "group":
            continue
        if other.owner == m or other.owner.startswith(m + "."):
            return m  # the module has things drawn inside it: the call sits in its box
    return path_parent(m)


def draw(graphviz: Any, scene: Scene, depth: int | None, rankdir: str,
         show_plumbing: bool = True, focus: str | None = None, fold: bool = True) -> Any:
    p = scene.plan
    folds = Folded()

    def given(name: str, default: object) -> bool:  # an example input gave another value
        info = scene.infos.get(name)
        return info is not None and info != describe_value(default)

    items, edges, after = items_of(p, scene.tapped, show_plumbing, scene.graphs,
                                   scene.root, given, folds)
    rep = collapse(items, depth, focus)
    if fold:
        rep, folds.blocks = fold_blocks(items, rep, block_runs(scene.root), depth, focus)
    drawn: list[Item] = []
    seen: set[str] = set()
    for it in items:
        r = rep[it.id]
        if r.id not in seen:
            seen.add(r.id)
            drawn.append(r)
    fallbacks = {f.path: f for f in p.fallbacks}
    clusters: dict[str, list[Item]] = {}
    for it in drawn:
        clusters.setdefault(_cluster_of(it, drawn), []).append(it)
    boxed_root = "" in fallbacks or "" in scene.graphs

    dot = graphviz.Digraph(name=_text(scene.title), graph_attr={**_GRAPH_ATTR,
                           "rankdir": rankdir, "label": _caption(scene, depth, folds, focus)},
                           node_attr=_NODE_ATTR, edge_attr=_EDGE_ATTR)
    dot.comment = "fxprobe.to_dot"
    outs = _leaving(items, edges, rep)
    first: dict[str, int] = {}  # clusters in the order their first item is drawn
    where = {id(it): scope for scope, members in clusters.items() for it in members}
    for i, it in enumerate(drawn):
        scope = where[id(it)]
        for k in range(1, path_depth(scope) + 1):
            first.setdefault(path_prefix(scope, k), i)
    paths = list(first)

    def emit(g: Any, scope: str) -> None:
        for it in clusters.get(scope, []):
            if scope == "" and it.role in ("input", "output"):
                continue
            g.node(_text(it.id), **_node_attrs(it, scene, fallbacks, depth, outs))
        for child in paths:
            if child and path_parent(child) == scope:
                with g.subgraph(name=_text(f"cluster_{child}")) as c:
                    c.attr(**_cluster_attrs(child, scene, fallbacks))
                    emit(c, child)

    for role, rank in (("input", "source"), ("output", "sink")):  # model inputs on top
        with dot.subgraph(name=f"{role}s") as g:
            g.attr(rank=rank)
            for it in clusters.get("", []):
                if it.role == role:
                    g.node(_text(it.id), **_node_attrs(it, scene, fallbacks, depth, outs))
    if boxed_root:
        with dot.subgraph(name="cluster_/") as c:
            c.attr(**_cluster_attrs("", scene, fallbacks))
            emit(c, "")
    else:
        emit(dot, "")
    real: dict[tuple[str, str], None] = {}  # deduplicated, in order
    for a, b in edges:
        if rep[a] is not rep[b]:
            real[(rep[a].id, rep[b].id)] = None
    order = _order_edges(scene, drawn, clusters, paths, where, fallbacks, list(real))
    order += [(rep[a].id, rep[b].id) for a, b in after if rep[a] is not rep[b]]
    for a, b in dict.fromkeys(order):
        dot.edge(_text(a), _text(b), style="invis")
    for a, b in real:
        dot.edge(_text(a), _text(b))
    return dot


def _order_edges(scene: Scene, drawn: list[Item], clusters: Mapping[str, list[Item]],
                 paths: list[str], where: Mapping[int, str], fallbacks: Mapping[str, Any],
                 real: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Invisible edges that stack what runs inside an untraced module in execution order.

    fx sees no data flow there; without these, Graphviz spreads the module's hook sites and
    traced children side by side in arbitrary order. The module's own call comes last: its
    node stands for the value that leaves it, and what feeds the call is drawn above it all.
    """
    regions = [*scene.plan.regions, *scene.graphs]  # dynamo's graphs have data flow too
    index = {id(it): i for i, it in enumerate(drawn)}
    span: dict[str, tuple[Item, Item]] = {}  # first and last item drawn inside each cluster
    for it in drawn:
        scope = where[id(it)]
        for k in range(0, path_depth(scope) + 1):
            q = path_prefix(scope, k)
            first, _ = span.get(q, (it, it))
            span[q] = (first, it)
    out: list[tuple[str, str]] = []
    for scope in ["", *paths]:
        traced = any(path_inside(scope, r) for r in regions) and scope not in fallbacks
        if traced or scope not in span:
            continue
        parts: list[tuple[int, str, str]] = []
        call: Item | None = None
        for it in clusters.get(scope, []):
            if it.module == scope and it.role != "group":
                call = it
            elif it.role not in ("input", "output"):
                parts.append((index[id(it)], it.id, it.id))
        for child in paths:
            if child and path_parent(child) == scope:
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
            ids = {it.id for it in drawn if path_inside(where[id(it)], scope)}
            out += [(a, chain[0][0]) for a, b in real if b == call.id and a not in ids]
    return out


def _caption(scene: Scene, depth: int | None, folds: Folded | None = None,
             focus: str | None = None) -> str:
    """The caption: the counts ``tapped.sites`` and ``fxprobe.sites`` give, then what the
    picture leaves out."""
    p = scene.plan
    nodes = {s.name: s for s in p.sites if not s.inlined}
    for graphs in scene.graphs.values():  # sites of dynamo's graphs, known after a forward
        for g in graphs:
            for n in g.graph.nodes:
                own = node_site(n)
                if own is not None and not own.inlined:
                    nodes.setdefault(own.name, own)
    line = f"{scene.title}: {_count(len(nodes), 'site')}"
    if not scene.artifact:  # an artifact's sites are all values of its one graph
        line += " (" + _by_how(nodes.values()) + ")"
    chosen = scene.selected
    line += f", {len(chosen)} tapped"
    if chosen and not scene.artifact:
        line += " (" + _by_how(chosen) + ")"
    if not scene.artifact:
        line += f", {_count(len(p.fallbacks), 'module')} run as written"
    for path, n in scene.dynamo.items():
        line += f", {path or 'the model'} runs under torch dynamo ({_dynamo_note(scene, path, n)})"
    if focus is not None:
        line += f", {focus} drawn whole"
    if depth is not None:
        line += f", modules nested deeper than {depth} drawn as one node"
    lines = [line]
    if folds is not None:
        left = []
        if folds.inputs:
            left.append("inputs at their default " + ", ".join(folds.inputs))
        if folds.modules:
            left.append("modules that pass their input through " + ", ".join(
                f"{len(names)} {kind}" for kind, names in folds.modules.items()))
        if folds.shape_ops:
            left.append(f"{_count(len(folds.shape_ops), 'shape op')} (into the ops they feed)")
        if left:
            lines.append("not drawn (show_plumbing=True draws them): " + "; ".join(left))
        if folds.blocks:
            lines.append("repeated blocks drawn as one node after the first of each run "
                         "(fold=False draws them): " + ", ".join(
                             f"{f.span[0]} ... {f.span[-1]}" if len(f.span) > 1 else f.span[0]
                             for f in folds.blocks))
    return "".join(_text(x) + "\\l" for x in [*lines, _LEGEND])


def _count(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def _by_how(sites: Any) -> str:
    """``40 fx, 3 hook`` (``dynamo``, ``script``, ``export`` where there are any)."""
    counts: dict[str, int] = {"fx": 0, "hook": 0}
    for s in sites:
        counts[s.how] = counts.get(s.how, 0) + 1
    return ", ".join(f"{n} {how}" for how, n in counts.items())


def _leaving(items: list[Item], edges: list[tuple[str, str]], rep: Mapping[str, Item]
             ) -> dict[str, str]:
    """For each collapsed module, the id of the item whose value leaves it (the last one, in
    execution order, with an edge out of it): the output its node is labelled with."""
    order = {it.id: i for i, it in enumerate(items)}
    out: dict[str, str] = {}
    for a, b in edges:
        group = rep[a]
        if group.role == "group" and rep[b] is not group and a in order \
                and order[a] >= order.get(out.get(group.id, a), -1):
            out[group.id] = a
    return out


def _dynamo_note(scene: Scene, path: str, tapped: int) -> str:
    graphs = scene.graphs.get(path)
    if not graphs:
        return (f"{tapped} tapped site(s) in its graphs, drawn as one call: its ops are drawn "
                "after a forward")
    ops = sum(1 for g in graphs for n in g.graph.nodes if node_site(n) is not None)
    own = sum(1 for g in graphs if not g.called_by)
    note = f"{own} graph(s) of the last capture drawn op by op"
    if own > 1:
        note += ", one after another (graph breaks)"
    return note + f"{_blocks_text(graphs)}, {ops} sites, {tapped} tapped"


def _blocks_text(graphs: Sequence[CapturedGraph]) -> str:
    """The graphs of the repeated blocks a module dynamo runs calls as one op each, captured
    once for all of them and drawn in each block; "" for none."""
    called = [g for g in graphs if g.called_by]
    if not called:
        return ""
    kinds = len({g.number for g in called})
    return (f", and {kinds} graph{'s' if kinds > 1 else ''} of repeated blocks captured "
            f"once, drawn in each of the {len(called)} blocks that run "
            f"{'them' if kinds > 1 else 'it'}")


def _node_attrs(it: Item, scene: Scene, fallbacks: Mapping[str, Any],
                depth: int | None, outs: Mapping[str, str]) -> dict[str, str]:
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
        lines = [f"{s.name}: {_module_type(scene, it.module) if it.module else s.op}"]
        tip = [f"{s.name}: {s.op} ({s.kind}, reached by {s.how})",
               f"in module: {s.module_path or '(top level)'}"]
        if s.canonical:  # the transformer vocabulary's names select it too
            lines.append("= " + ", ".join(s.canonical))
            tip.append("canonical name: " + ", ".join(s.canonical))
        if s.how == "hook":
            attrs["style"] = "rounded,filled,dashed"
            classes.append("hook")
        if it.graph is not None:
            tip.append(f"in the graph torch dynamo captured: tapped.graphs[{it.graph!r}]")
            classes.append("dynamo")
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
            if fallback is None and (it.module or "") in scene.dynamo:  # tracer="dynamo"
                lines.append("torch dynamo")
                tip = ["runs under torch dynamo: its ops are drawn after a forward"]
            elif fallback is None:
                lines.append("hooks only")
                tip = ["tracer='hooks': reached by module hooks only"]
            attrs["style"] = "filled,dashed"
        else:
            lines = {"input": ["input"], "output": ["output"], "return": ["return"]}[it.role]
            attrs["shape"] = "invhouse" if it.role == "input" else "house"
            if it.role == "return" and it.graph is not None:
                lines = ["return", it.graph]
                attrs["fontsize"] = "8"
                tip = [f"what the graph {it.graph} returns to the code torch dynamo runs as "
                       "written (after a graph break, or the caller of "
                       f"{it.owner or 'the model'})"]
            elif it.role == "return":
                attrs["fontsize"] = "8"
                tip = [f"output of the traced module {it.owner}"]
            else:
                attrs["fillcolor"] = _IO_FILL
                tip = [f"model {it.role}"]
    info = infos.get(it.id if it.role != "group" else "")
    if it.role == "group":
        info = _group_info(it, infos, outs.get(it.id))
    if info is not None and info.label:
        shown = f"in: {info.label}" if it.site is not None and scene.capture == "input" \
            and it.site.name in scene.tapped else info.label
        if it.role == "group":  # one line: the count of sites, then what leaves the module
            lines[-1] += f": {shown}"
        else:
            lines.append(shown)
        tip.append(shown)
    elif scene.ran and it.site is not None and it.graph is None:  # dynamo's ops: not propagated
        lines.append("not run")
        tip.append("did not run with the example input")
    if it.constants:
        lines.insert(1, "uses " + ", ".join(it.constants))
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


def _group_text(it: Item, scene: Scene, fallbacks: Mapping[str, Any], depth: int | None
                ) -> tuple[list[str], list[str], bool, Any]:
    scopes = it.span or [it.owner]
    sites = [m.site for m in it.members if m.site is not None]
    names = {s.name for s in sites}
    sites += [s for s in scene.plan.sites  # folded ones (Identity, shape ops) count too
              if not s.inlined and s.name not in names
              and any(path_inside(s.module_path, scope) for scope in scopes)
              and s.kind not in ("placeholder", "get_attr")]
    tapped = [s.name for s in sites if s.name in scene.tapped]
    inner = [f for path, f in fallbacks.items()
             if path and any(path_inside(path, scope) for scope in scopes)]
    mtype = _module_type(scene, it.owner)
    count = _count(len(sites), "site") + (f", {len(tapped)} tapped" if tapped else "")
    if it.span:
        first, last = it.span[0], it.span[-1]
        shown = f"{first} ... {last}" if len(it.span) > 1 else first
        lines = [f"{shown}: {mtype} ×{len(it.span)}", count]
        tip = [f"{shown} ({len(it.span)} × {mtype}): drawn as one node, like the block before "
               f"them (fold=False draws each); {count}"]
    else:
        lines = [f"{it.owner}: {mtype}", count]
        tip = [f"{it.owner} ({mtype}): drawn as one node at depth={depth}; {count}"]
    if tapped:
        tip.append("tapped: " + ", ".join(tapped[:12]) + (" ..." if len(tapped) > 12 else ""))
    tip += site_lines(sites, scene.infos)
    for f in inner[1:] if inner and inner[0].path == it.owner else inner:
        tip += _fallback_tip(f)
    own = fallbacks.get(it.owner) if not it.span else None
    return lines, tip, bool(tapped), own if own is not None else (inner[0] if inner else None)


def _group_info(it: Item, infos: Mapping[str, ValueInfo], out: str | None
                ) -> ValueInfo | None:
    """The value that leaves a collapsed module: its own call's (a tapped module site), else
    that of the member whose value leaves it (``out``); never an inner value in its place."""
    known = infos.get(it.span[-1] if it.span else it.owner)
    if known is None and out is not None:
        known = infos.get(out)
    if known is None and out is None:  # nothing leaves it by an edge: its last value
        last = [infos[m.id] for m in it.members if m.id in infos and m.role != "input"]
        known = last[-1] if last else None
    return known


def _fallback_tip(f: Fallback) -> list[str]:
    tip = [f"{f.where} ({f.module_type.__name__}) runs as written: torch.fx could not trace it",
           f.error]
    if f.location:
        tip.append(f"at {f.location}")
    tip.append("modules inside it are reached by hooks; traceable ones are traced on their own")
    return tip


def _cluster_attrs(path: str, scene: Scene, fallbacks: Mapping[str, Any]) -> dict[str, str]:
    mtype = _module_type(scene, path)
    name = path or scene.title.split(" (")[0]
    f = fallbacks.get(path)
    graphs = scene.graphs.get(path)
    if graphs:
        own = sum(1 for g in graphs if not g.called_by)
        label = f"{name} ({mtype}): runs under torch dynamo, " + (
            f"{own} graphs, one after another (graph breaks)" if own > 1
            else "1 graph") + _blocks_text(graphs)
        tip = [label, *(f"tapped.graphs[{g.key!r}]" for g in graphs)]
        return {"label": _text(label), "style": "rounded,filled", "fillcolor": "#F3F8FC",
                "color": "#0072B2", "penwidth": "1", "fontcolor": "#222222", "fontsize": "9",
                "tooltip": "\\n".join(_text(x) for x in tip), "class": "fxprobe-dynamo"}
    if f is None and path and path in _tapped_modules(scene):
        label = f"{name} ({mtype}): tapped module"
        return {"label": _text(label), "style": "rounded", "color": "black", "penwidth": "2.5",
                "fontcolor": "#222222", "fontsize": "9",
                "tooltip": _text(f"{label}: its output is the value of its last node"),
                "class": "fxprobe-module fxprobe-tapped"}
    if f is None:
        # penwidth set: a cluster inherits its enclosing one's (a tapped module's outline)
        return {"label": _text(f"{name} ({mtype})"), "style": "rounded", "color": "#AAAAAA",
                "penwidth": "1", "fontcolor": "#444444", "fontsize": "9",
                "tooltip": _text(f"{name} ({mtype})"),
                "class": "fxprobe-module"}
    return {"label": _text(f"{name} ({mtype}): runs as written, hooks inside"),
            "style": "dashed,filled", "fillcolor": "#F4F4F4", "color": _FALLBACK_PEN,
            "penwidth": "1.5", "fontcolor": "#222222", "fontsize": "9",
            "tooltip": "\\n".join(_text(x) for x in _fallback_tip(f)),
            "class": "fxprobe-fallback"}


def _tapped_modules(scene: Scene) -> set[str]:
    """Paths of the modules whose call is a tapped site that fx traced through (``layer3``):
    drawn as boxes, outlined like a tapped node."""
    return {s.module_path for s in scene.selected if s.inlined and s.kind == "call_module"}


def _module_type(scene: Scene, path: str) -> str:
    try:
        return type(scene.root.get_submodule(path) if path else scene.root).__name__
    except AttributeError:
        return "module"


def _text(s: str) -> str:
    """Text for a DOT attribute: backslashes kept literal (``\\N`` and ``\\l`` not expanded)."""
    import graphviz

    out: str = graphviz.nohtml(s.replace("\\", "\\\\"))
    return out
