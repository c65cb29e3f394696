"""``fxprobe.extractor``: a pure ``fx.GraphModule`` returning ``(output, {site: value})``.

Where :func:`fxprobe.tap` records values as a side effect and falls back to hooks, the extractor
is one graph with no side effects at all, so that ``torch.compile(fullgraph=True)``,
``torch.export.export`` and (when every captured value is a tensor) ``torch.jit.script`` can take
it whole. It is built from the same tracing, site names, selectors and in-place analysis as
``tap``: a value that a later in-place op overwrites is copied where it is produced, by a
``.clone()`` node when the value is known to be a tensor.
"""

from __future__ import annotations

import functools
import operator
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Unpack

import torch
from torch import fx, nn

from ..capture.inplace import Hazards, effects
from ..capture.pipeline import clone_tree
from ..capture.rewrite import copy_graph
from ..core.errors import (
    ConfigError,
    FxProbeError,
    SelectorError,
    TraceError,
    UnsupportedModelError,
)
from ..core.names import closest
from ..core.ops import (
    PASS_THROUGH,
    TENSOR_FUNCTIONS,
    TENSOR_METHODS,
    TENSOR_MODULES,
    TENSOR_OPERATORS,
    inplace_name,
    is_torch_callable,
)
from ..core.options import TraceOptions, arguments, keywords
from ..core.select import CANONICAL, CANONICAL_ELSEWHERE, as_selectors, paths_in, select
from ..core.site import Site, reach, sites_of
from ..core.view import Plan
from ..frontends.fx import Fallback, Region, plan
from ..frontends.mirror import mirror
from .dualgraph import ExtractorModule, model_info
from .layout import declared_format
from .program import check_model
from .shapes import with_canonical


@keywords(TraceOptions, tracer="fx")
def extractor(model: nn.Module, ops: Any = None, *, train: bool = False,
              return_nodes: Sequence[str] | Mapping[str, str] | None = None,
              **options: Unpack[TraceOptions]) -> ExtractorModule:
    """A module whose forward returns ``(model output, {site name: value})``, side-effect free.

    With ``return_nodes`` (torchvision's ``create_feature_extractor`` argument) it returns only
    ``{name: value}`` instead, and computes nothing after the last requested value.

    The result is an ``fx.GraphModule`` (an :class:`ExtractorModule`) holding a train and an
    eval graph, switched by ``.train()``/``.eval()``, in eval mode unless ``train``; it carries
    timm-style ``feature_info``/``channels()``/``reduction()``. It shares
    every parameter and buffer with ``model`` (training it trains the model) and leaves the model
    object untouched. A value that a later in-place op would overwrite (``ReLU(inplace=True)``
    after a BatchNorm, ``+=``) is copied where it is produced, so each value is the one the site
    computed. It compiles with ``torch.compile(fullgraph=True)``, exports with
    ``torch.export.export`` and scripts with ``torch.jit.script`` when every selected value is a
    tensor (see docs/extractor.md).

    Args:
        model: an ``nn.Module`` that ``torch.fx`` can trace whole (with ``leaf_modules``).
        ops: ``None`` (every site, inputs and attributes included), a selector, or a list of
            selectors, as in :func:`fxprobe.tap`.
        tracer: only ``"fx"``: an extractor is one graph, so there is no hook fallback.
        leaf_modules: module types or qualified paths kept as single calls (not traced into;
            their insides cannot be selected).
        autowrap_functions: functions recorded as single calls instead of traced into.
        train: return the module in training mode (both modes are traced; ``.train()`` and
            ``.eval()`` switch the graph, control flow on ``self.training`` included).
        return_nodes: instead of ``ops``, exact site names as torchvision spells them: a list
            (``["layer1", "layer2.0.relu"]``) or a dict renaming them
            (``{"layer1": "feat1"}``). A module path such as ``"layer1"`` is that module's
            output; a transformer's canonical names (``"blocks.3.resid_post"``, where
            ``fxprobe.sites(model)`` lists them) are names too. The forward then returns
            ``{name: value}`` in the order given, and the graph is pruned: ops that no
            requested value depends on are dropped (the model's head is not run), except
            in-place writes that a kept op still reads.

    Returns:
        An ``fx.GraphModule`` named like the model's class.

    Raises:
        TraceError: part of the model cannot be traced; the message names each such module.
        SelectorError: a selector matches no site. SelectorTypeError: a selector of unknown
        type, or a ``return_nodes`` name that is no site. ConfigError: ``tracer`` is not
        ``"fx"``, both ``ops`` and ``return_nodes`` given, or ``return_nodes`` malformed
        (not strings, two names renamed alike). UnsupportedModelError: not an
        ``nn.Module``, a TorchScript module, or a container without a forward.

    Example:
        >>> ex = fxprobe.extractor(model, ops=[nn.Conv2d, "layer1.*"])
        >>> out, feats = torch.compile(ex, fullgraph=True)(x)
        >>> body = fxprobe.extractor(model, return_nodes={"layer2": "feat"})
        >>> body(x)["feat"].shape  # layer3, layer4 and the head do not run
    """
    o = arguments(TraceOptions, options, "fxprobe.extractor", tracer="fx")
    return build_extractor(model, ops, o["tracer"], o["leaf_modules"], o["autowrap_functions"],
                           train, return_nodes)


def build_extractor(model: nn.Module, ops: Any, tracer: str, leaf_modules: Sequence[Any],
                    autowrap_functions: Sequence[Callable[..., Any]], train: bool,
                    return_nodes: Sequence[str] | Mapping[str, str] | None,
                    untraceable_as_leaves: bool = False) -> ExtractorModule:
    """:func:`extractor`; with ``untraceable_as_leaves`` (``fxprobe.features``), a module fx
    cannot trace is kept as one call (as if in ``leaf_modules``; its insides are no sites)."""
    model = check_model(model, "fxprobe.extractor")
    renames = _return_nodes(return_nodes, ops)
    if tracer != "fx":
        raise ConfigError(
            f"extractor(tracer={tracer!r}) is not accepted: an extractor is one fx graph of the "
            "whole model, so only tracer='fx' is; use fxprobe.tap(model, tracer=...) to reach "
            "untraceable modules by hooks"
        )
    selectors = as_selectors(ops, paths_in(model))
    plans: dict[bool, tuple[nn.Module, Plan]] = {}
    graphs: dict[bool, fx.Graph] = {}
    failures: dict[bool, FxProbeError] = {}
    for mode in (train, not train):
        try:
            plans[mode] = _plan(model, mode, leaf_modules, autowrap_functions,
                                untraceable_as_leaves, renames)
        except FxProbeError as e:
            if mode == train:
                raise
            failures[mode] = e  # raised when .train(mode) switches to it
    for mode, (_, p) in plans.items():
        other = plans.get(not mode)
        try:
            graphs[mode] = _graph(model, mode, p, selectors, renames,
                                  other[1].sites if other is not None else None)
        except FxProbeError as e:
            if mode == train:
                raise
            failures[mode] = e
    gm = ExtractorModule(plans[train][0], graphs[train], class_name=type(model).__name__)
    known = model_info(model)
    entries = {mode: _entries(g, renames, known) for mode, g in graphs.items()}
    gm.attach(plans[not train][0] if (not train) in graphs else None, graphs, failures, entries,
              declared_format(model))
    gm.train(train)
    return gm


def _plan(model: nn.Module, train: bool, leaf_modules: Sequence[Any],
          autowrap_functions: Sequence[Callable[..., Any]], as_leaves: bool = False,
          wanted: Mapping[str, str] | None = None) -> tuple[nn.Module, Plan]:
    """One mode's module tree and fx plan, traced whole (else a TraceError naming why); with
    ``as_leaves``, the modules that fail are traced again as leaves, unless a ``wanted`` site
    lies inside one."""
    root = mirror(model)
    root.train(train)
    # "auto" lists every module that fails (as Fallbacks) instead of stopping at the first.
    p = plan(root, tracer="auto", leaf_modules=leaf_modules,
             autowrap_functions=autowrap_functions)
    if p.fallbacks and as_leaves and all(f.path for f in p.fallbacks):
        paths = [str(f.path) for f in p.fallbacks]
        inside = [n for n in wanted or () if any(n.startswith(f"{q}.") for q in paths)]
        if not inside:
            root = mirror(model)  # a fresh copy: nothing of the failed trace carries over
            root.train(train)
            p = plan(root, tracer="auto", leaf_modules=[*leaf_modules, *paths],
                     autowrap_functions=autowrap_functions)
    if p.fallbacks:
        raise _untraceable(type(model).__name__, p.fallbacks)
    if p.root_region is None:
        raise UnsupportedModelError(
            f"{type(model).__name__} is a container without a forward of its own; pass a module "
            "whose forward runs it (for an nn.ModuleList, the module that iterates over it)"
        )
    return root, with_canonical(p)


def _graph(model: nn.Module, train: bool, p: Plan, selectors: Any,
           renames: Mapping[str, str] | None, other: Sequence[Site] | None) -> fx.Graph:
    """One mode's graph; a selector that matches only the ``other`` mode's sites is no error."""
    region = p.root_region
    assert region is not None
    context = f"{type(model).__name__} ({'train' if train else 'eval'} mode)"
    if renames is not None:
        aliases = {c: s.name for s in p.sites for c in s.canonical}  # blocks.3.resid_post
        _check_names(renames, p.sites, context, aliases)
        return build_features_graph(region, renames, aliases)
    selected = select(p.sites, selectors, context=context, fallbacks=p.fallbacks,
                      other_mode=(lambda: other) if other is not None else None)
    return build_graph(region, {s.name for s in selected})


def _entries(graph: fx.Graph, renames: Mapping[str, str] | None,
             known: Mapping[str, Mapping[str, Any]]) -> list[dict[str, Any]]:
    """``feature_info`` entries of a graph's returned values: ``module`` (the site) and
    ``name`` (its key), with the model's ``num_chs``/``reduction`` where it lists the site."""
    (out,) = (n for n in graph.nodes if n.op == "output")
    if renames is not None:
        pairs = list(renames.items())
    else:
        pairs = [(k, k) for k in out.args[0][1]]
    entries = []
    for site, name in pairs:
        d: dict[str, Any] = {"module": site, "name": name}
        if site in known:
            d.update(num_chs=known[site]["num_chs"], reduction=known[site]["reduction"])
        entries.append(d)
    return entries


def copy_tree(value: Any) -> Any:
    """A copy of every tensor in ``value`` (a nest of tuples, lists and dicts); the rest as is."""
    if isinstance(value, fx.Proxy):
        # Unpickling a GraphModule traces its code again: stay one node instead of vanishing.
        return value.tracer.create_proxy("call_function", copy_tree, (value,), {})
    return clone_tree(value)


def build_graph(region: Region, selected: set[str]) -> fx.Graph:
    """Copy the region's graph; make it return ``(output, {name: value})``, copying at risk."""
    graph = copy_graph(region.graph)
    (out,) = (n for n in graph.nodes if n.op == "output")
    result = out.args[0]
    graph.erase_node(out)
    _resolve_placeholder_types(graph, region.module)
    hazards = Hazards(graph, region.module.get_submodule)
    tensors = known_tensors(graph, region.module)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    values: dict[str, fx.Node] = {}
    for new, site in [(n, s) for n in list(graph.nodes) for s in sites_of(n)]:
        name = site.name
        if name not in selected:
            continue
        value = new
        if new.op != "get_attr" and hazards.output_at_risk(new):
            # Placeholders must stay together at the top of the graph.
            after = placeholders[-1] if new.op == "placeholder" else new
            with graph.inserting_after(after):
                if new in tensors:  # a method call: torch.jit.script can compile it
                    value = graph.call_method("clone", (new,))
                else:  # type unknown (a tuple, an int...): copy every tensor inside it
                    value = graph.call_function(copy_tree, (new,))
            if new.op == "placeholder":
                placeholders.append(value)
        values[name] = value
    graph.output((result, values))  # untyped: the model's return annotation no longer holds
    graph.lint()
    return graph


def build_features_graph(region: Region, renames: Mapping[str, str],
                         aliases: Mapping[str, str] | None = None) -> fx.Graph:
    """Copy the region's graph; return ``{new name: value}`` only, pruned, copying at risk
    (``renames`` by site name, or by a canonical name ``aliases`` maps to one).

    The requested values become the output before anything is copied, so that the pruning sees
    what is needed: ``prune`` drops every op they do not depend on, and only then is the
    in-place analysis run, on the pruned graph (a value overwritten only by code that no longer
    runs needs no copy).
    """
    graph = copy_graph(region.graph)
    (out,) = (n for n in graph.nodes if n.op == "output")
    graph.erase_node(out)
    _resolve_placeholder_types(graph, region.module)
    produced = {site.name: n for n in graph.nodes for site in sites_of(n)}
    graph.output({new: produced[name if name in produced else (aliases or {})[name]]
                  for name, new in renames.items()})
    prune(graph, region.module.get_submodule)
    (out,) = (n for n in graph.nodes if n.op == "output")
    hazards = Hazards(graph, region.module.get_submodule)
    tensors = known_tensors(graph, region.module)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    copies: dict[fx.Node, fx.Node] = {}
    for node in dict.fromkeys(out.args[0].values()):
        if node.op == "get_attr" or not hazards.output_at_risk(node):
            continue
        after = placeholders[-1] if node.op == "placeholder" else node
        with graph.inserting_after(after):
            if node in tensors:
                copies[node] = graph.call_method("clone", (node,))
            else:
                copies[node] = graph.call_function(copy_tree, (node,))
        if node.op == "placeholder":
            placeholders.append(copies[node])
    out.args = ({k: copies.get(v, v) for k, v in out.args[0].items()},)
    graph.lint()
    return graph


def prune(graph: fx.Graph, modules: Callable[[str], nn.Module]) -> bool:
    """Drop the nodes the output does not need; return whether any was dropped.

    ``Graph.eliminate_dead_code`` alone is not enough: it keeps no in-place method call whose
    result is unused (``x.relu_()``), although a kept op that reads ``x`` later needs the write.
    Here an op that writes in place (per ``_inplace``, which counts code it cannot see into as
    a writer) is kept when a kept op reads the written storage after it. The output itself does
    not count as such a reader: a returned value that a kept write overwrites is copied by the
    caller. Side-effectful calls (``torch._assert``) before the last kept op are kept.
    Placeholders stay (the signature does not change).
    """
    nodes = list(graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    hazards = Hazards(graph, modules)
    writes = {n: effects(n, modules)[1] for n in nodes}
    live: set[fx.Node] = set()

    def keep(n: fx.Node) -> None:
        reach([n], lambda m: m.all_input_nodes, into=live)

    for n in nodes:
        if n.op in ("output", "placeholder"):
            keep(n)
    # Checks and other side-effectful calls (torch._assert on the input's shape) that run
    # before the last kept op still run, as in torchvision's extractor; later ones do not.
    last = max((order[n] for n in live if n.op not in ("output", "placeholder")), default=-1)
    for n in nodes:
        if n.op == "call_function" and order[n] < last and n.is_impure():
            keep(n)
    changed = True
    while changed:
        changed = False
        for w in nodes:
            if w in live or not writes[w]:
                continue
            if any(order[u] > order[w] and u.op != "output"
                   for target in writes[w] for m in hazards.members(target)
                   for u in m.users if u in live):
                keep(w)
                changed = True
    dropped = [n for n in reversed(nodes) if n not in live]
    for n in dropped:
        graph.erase_node(n)
    return bool(dropped)


def known_tensors(graph: fx.Graph, root: nn.Module) -> set[fx.Node]:
    """Nodes whose value is sure to be a single tensor (a conservative answer)."""
    known: set[fx.Node] = set()

    def first_known(n: fx.Node) -> bool:
        return bool(n.args) and isinstance(n.args[0], fx.Node) and n.args[0] in known

    for n in graph.nodes:
        is_tensor = False
        if n.op == "placeholder":
            is_tensor = n.type is torch.Tensor
        elif n.op == "get_attr":
            is_tensor = isinstance(_get_attr(root, str(n.target)), torch.Tensor)
        elif n.op == "call_module":
            m = root.get_submodule(str(n.target))
            if isinstance(m, PASS_THROUGH):
                is_tensor = first_known(n)
            else:
                is_tensor = isinstance(m, TENSOR_MODULES) and not getattr(
                    m, "return_indices", False)
        elif n.op == "call_method":
            name = str(n.target)
            is_tensor = first_known(n) and (name in TENSOR_METHODS or inplace_name(name))
        elif n.op == "call_function":
            fn = n.target
            if fn in TENSOR_OPERATORS:
                is_tensor = any(isinstance(a, fx.Node) and a in known for a in n.args[:2])
                if fn is operator.getitem:
                    is_tensor = first_known(n)
            elif is_torch_callable(fn):
                name = getattr(fn, "__name__", "")
                is_tensor = name in TENSOR_FUNCTIONS or inplace_name(name)
        if is_tensor:
            known.add(n)
    # Whatever an in-place tensor op writes into is a tensor, even an unannotated input.
    for n in graph.nodes:
        target = n.args[0] if n.args and isinstance(n.args[0], fx.Node) else None
        if target is None:
            continue
        if n.op == "call_method" and inplace_name(str(n.target)):
            known.add(target)
        elif n.op == "call_function" and is_torch_callable(n.target) and (
                inplace_name(getattr(n.target, "__name__", ""))
                or n.kwargs.get("inplace") is True):
            known.add(target)
        elif n.op == "call_module":
            m = root.get_submodule(str(n.target))
            if isinstance(m, TENSOR_MODULES) and getattr(m, "inplace", False) is True:
                known.add(target)
    return known


def _return_nodes(return_nodes: Any, ops: Any) -> dict[str, str] | None:
    """``{site name: output name}`` from torchvision's list or dict form, validated."""
    if return_nodes is None:
        return None
    if ops is not None:
        raise ConfigError(
            "extractor() got both ops= and return_nodes=: pass one. return_nodes (exact site "
            "names, torchvision's form) returns only the requested values and prunes the graph; "
            "ops (selectors) returns (output, values)"
        )
    if isinstance(return_nodes, Mapping):
        pairs = list(return_nodes.items())
    elif isinstance(return_nodes, (list, tuple)):
        pairs = [(n, n) for n in return_nodes]
    else:
        raise ConfigError(
            f"return_nodes={return_nodes!r} is a {type(return_nodes).__name__}; pass a list of "
            "site names (['layer1', 'layer2']) or a dict renaming them ({'layer1': 'feat1'})"
        )
    if not pairs:
        raise ConfigError("return_nodes is empty: name at least one site (fxprobe.sites(model))")
    renames: dict[str, str] = {}
    for name, new in pairs:
        if not isinstance(name, str) or not isinstance(new, str):
            raise ConfigError(
                f"return_nodes entry {name!r}: {new!r} is not a pair of strings; site names and "
                "output names are strings (a train/eval pair of lists is not supported: build "
                "one extractor that switches modes with .train()/.eval())")
        if name in renames:
            raise ConfigError(f"return_nodes names site {name!r} twice")
        renames[name] = new
    news = list(renames.values())
    twice = sorted({n for n in news if news.count(n) > 1})
    if twice:
        raise ConfigError(
            f"return_nodes renames several sites to {', '.join(map(repr, twice))}: output names "
            "must be unique")
    return renames


def _check_names(renames: Mapping[str, str], sites: Sequence[Site], context: str,
                 aliases: Mapping[str, str]) -> None:
    known = [s.name for s in sites] + list(aliases)
    names = set(known)
    for name in renames:
        if name in names:
            continue
        close = closest(name, known)
        hint = f" Closest site names: {', '.join(close)}." if close else ""
        canonical = CANONICAL.match(name) and not aliases
        raise SelectorError(
            f"return_nodes names {name!r}, which is no site of {context}.{hint} Site names are "
            "torchvision's (get_graph_node_names), module paths included, and where the "
            "model is a transformer fxprobe recognises, canonical names (blocks.3.resid_post); "
            "run fxprobe.sites(model) for the node names and fxprobe.sites(model).modules for "
            "the module paths." + (f" {CANONICAL_ELSEWHERE}" if canonical else ""))


def _get_attr(root: Any, target: str) -> Any:
    return functools.reduce(lambda obj, part: getattr(obj, part, None), target.split("."), root)


def _resolve_placeholder_types(graph: fx.Graph, module: nn.Module) -> None:
    """Turn string annotations (``from __future__ import annotations``) into types.

    fx keeps them as strings and prints them as undefined names (``_torch_Tensor_``) that
    ``torch.jit.script`` cannot resolve; one that cannot be evaluated is dropped (TorchScript
    then assumes ``Tensor``).
    """
    strings = [n for n in graph.nodes if n.op == "placeholder" and isinstance(n.type, str)]
    if not strings:
        return
    try:
        hints = typing.get_type_hints(type(module).forward)
    except Exception:  # any annotation that does not evaluate: keep none of them
        hints = {}
    for n in strings:
        n.type = hints.get(str(n.target).lstrip("*"))


def _untraceable(model_name: str, fallbacks: Sequence[Fallback]) -> TraceError:
    lines = []
    for f in fallbacks:
        at = f"\n      at {f.location}" if f.location else ""
        lines.append(f"  - {f.what}: {f.error}{at}")
    paths = [f.path for f in fallbacks if f.path]
    hints = []
    if paths:
        hints.append(
            f"pass leaf_modules={paths!r} (paths or types) to keep them as single calls, whose "
            "insides are then not captured")
    if any(not f.path for f in fallbacks):
        hints.append(
            "leaf_modules cannot help with the top-level forward: build the extractor from a "
            "traceable submodule, move the code that fails into a submodule named in "
            "leaf_modules, or name the offending function in autowrap_functions")
    hints.append("or use fxprobe.tap(model, ...), which reaches untraceable modules by hooks")
    return TraceError(
        f"fxprobe.extractor needs one fx graph of the whole {model_name}, but torch.fx could "
        "not trace:\n" + "\n".join(lines) + "\nTo fix: " + "; ".join(hints) + "."
    )
