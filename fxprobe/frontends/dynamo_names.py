"""Site identity for graphs that torch dynamo captured: the fx frontend's names, from node meta.

Dynamo names a node after the variable it was assigned to (``attn_weights_3``); fxprobe names
it as the fx frontend does: the enclosing module's path, taken from ``node.meta
["nn_module_stack"]``, then the op (``transformer.h.0.attn.softmax``), repeats counted within
the module. A call of a module that fx would not trace into (``nn.Linear``, ``nn.LayerNorm``)
is one site named by its path, whose value is the call's output.

A name must not depend on which graph a node landed in (graph breaks, recompilations), so
:class:`StableNamer` keys each node by what it is (module path, op, source line, occurrence)
and hands out the same name whenever that key comes back.
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn

from ..capture.settle import as_returned, settle
from ..core.names import join as _join
from ..core.ops import method_key, module_key, op_key
from ..core.site import CALL_ARGS, SITES, STATE, Site, attach, source_name
from ..core.view import is_state
from .dynamo_blocks import block_call
from .dynamo_blocks_cache import OWN_FILE, reads_kv
from .dynamo_shapes import is_size
from .mirror import own_forward

_SOURCE_ROOT = re.compile(r"^L\[['\"](\w+)['\"]\]")
_ITEM = re.compile(r"(?:\._modules)?\[['\"]?([^\]'\"]+)['\"]?\]")
FILE_LINE = re.compile(r'File "([^"]+)", line (\d+)')


def frame_id() -> int | None:
    """The id dynamo gives the frame it is compiling now (None outside a compilation)."""
    try:
        compile_id = torch._guards.CompileContext.current_compile_id()
    except Exception:  # a private API: drawing falls back to one entry per graph
        return None
    frame = getattr(compile_id, "frame_id", None)
    return frame if isinstance(frame, int) else None


def positional(forward: Callable[..., Any]) -> tuple[str, ...]:
    """The names of ``forward``'s positional parameters after ``self`` (none where unknown)."""
    try:
        params = list(inspect.signature(forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return ()
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return tuple(p.name for p in itertools.takewhile(lambda p: p.kind in kinds, params))


def module_path(stack_path: str) -> str:
    """``"L['self'].h[0]._modules['attn']"`` -> ``"h.0.attn"`` (relative to the frame's self)."""
    rest = _SOURCE_ROOT.sub("", stack_path)
    rest = _ITEM.sub(r".\1", rest)
    return rest.strip(".")


def param_path(source_name: str) -> str | None:
    """``"L['self']._modules['h']._parameters['weight']"`` -> ``"h.weight"``."""
    if not _SOURCE_ROOT.match(source_name):
        return None
    rest = _SOURCE_ROOT.sub("", source_name)
    rest = re.sub(r"\._(?:modules|parameters|buffers)\[['\"]([^'\"]+)['\"]\]", r".\1", rest)
    if "[" in rest or "(" in rest:
        return None
    return rest.strip(".")


def op_name(node: fx.Node) -> str:
    """The op part of a site name, as fx would name the node (``softmax``, ``matmul``)."""
    target = node.target
    name = target if isinstance(target, str) else getattr(target, "__name__", None) or "op"
    if isinstance(target, torch._ops.OpOverload):
        name = target._opname
    name = fx.graph._snake_case(re.sub(r"\W+", "_", name)).strip("_")
    return name or "op"


def dynamo_op_key(node: fx.Node) -> str | None:
    """The canonical op of a node, for every spelling dynamo records (ATen overloads too)."""
    target = node.target
    if node.op == "call_method":
        return method_key(str(target))
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        packet = target.overloadpacket if isinstance(target, torch._ops.OpOverload) else target
        return method_key(packet.__name__.lstrip("_"))
    return op_key(target)


def _frames(node: fx.Node) -> list[tuple[str, str]]:
    """The (file, line) frames of a node's stack trace, without fxprobe's forward of a shared
    block called with its cache (``dynamo_blocks_cache.OWN_FILE``): no code of the model's,
    a call keeps the name it has without a cache."""
    return [f for f in FILE_LINE.findall(node.meta.get("stack_trace") or "")
            if f[0] != OWN_FILE]


def _location(node: fx.Node) -> str:
    found = _frames(node)
    return f"{found[-1][0]}:{found[-1][1]}" if found else ""


class StableNamer:
    """Hands out site names that stay the same across graphs, breaks and recompilations."""

    def __init__(self) -> None:
        self._names: dict[tuple[str, str, int], str] = {}
        self._counts: dict[str, int] = {}

    def name(self, base: str, location: str, occurrence: int) -> str:
        key = (base, location, occurrence)
        name = self._names.get(key)
        if name is None:
            count = self._counts.get(base, 0)
            self._counts[base] = count + 1
            name = f"{base}_{count}" if count else base
            self._names[key] = name
        return name


@dataclass
class NamedGraph:
    """The sites of one captured graph, for one instance of the frame's module."""

    sites: dict[fx.Node, Site]
    """The site of each node that has one (calls, and the forward's own inputs)."""
    sdpa: dict[fx.Node, Site]
    """The attention-probabilities site beside each scaled_dot_product_attention call."""
    order: list[Site]
    """Every site in graph order (attention probabilities right after their SDPA call)."""
    modules: frozenset[str] = frozenset()
    """The paths of the modules whose code ran in the graph (the frame's own included)."""
    scores: dict[fx.Node, Site] = field(default_factory=dict)
    """The attention-scores site beside each scaled_dot_product_attention call (added by
    ``frontends.canonical``)."""

    def with_sites(self, replaced: Mapping[int, Site], graph: fx.Graph | None = None
                   ) -> NamedGraph:
        """This record with each site whose ``id`` is a key of ``replaced`` replaced by its
        value in every field, and (given ``graph``) on its nodes too (``node.meta[SITES]``):
        the one place where a pass that gives sites new fields (canonical names, sharding)
        puts them back."""

        def swap(s: Site) -> Site:
            return replaced.get(id(s), s)

        if graph is not None:
            for node in graph.nodes:
                if SITES in node.meta:
                    node.meta[SITES] = [swap(s) for s in node.meta[SITES]]
        return dataclasses.replace(
            self, sites={n: swap(s) for n, s in self.sites.items()},
            sdpa={n: swap(s) for n, s in self.sdpa.items()},
            order=[swap(s) for s in self.order],
            scores={n: swap(s) for n, s in self.scores.items()})


def name_graph(graph: fx.Graph, *, root: nn.Module, root_path: str,
               module_ids: dict[int, str], captured_prefix: str, frame_prefix: str,
               is_leaf: Callable[[nn.Module, str], bool], namer: StableNamer,
               probs_fn: Callable[..., Any], repeat: int = 0) -> NamedGraph:
    """Give every call node of a dynamo graph a :class:`Site` (``how="dynamo"``).

    Args:
        graph: the captured graph.
        root: the module the dynamo region runs (fxprobe's copy).
        root_path: its path in the model.
        module_ids: the path (relative to ``root``) of every module, by ``id``; dynamo keys
            ``nn_module_stack`` entries by the id of the module called.
        captured_prefix: the path, relative to ``root``, of the module that was ``self`` in
            the frame when dynamo captured it ("" for the region's own forward).
        frame_prefix: the same for the module instance the names are for (a graph captured
            for ``layers.0`` also runs ``layers.1``).
        is_leaf: whether fx would keep a module (by absolute path) as one call.
        namer: the region's namer.
        probs_fn: the function that stands for attention probabilities.
        repeat: 0, or n for the graph's (n+1)-th run for the same module instance in one
            forward (a module called twice): names of their own, counted on from the first
            run's (``inner.fc``, then ``inner.fc_1``), as repeats within a module are.

    Where the region is the whole model, the tensors its forward was called with (the graph
    inputs marked ``INPUT``) are sites named by their parameter (``input_ids``,
    ``attention_mask``), as fx names them.
    """
    modules: dict[str, nn.Module | None] = {}
    seen_modules: set[str] = {_join(root_path, frame_prefix)}

    def resolve(key: str, path: str) -> str:
        ident = key.split("@", 1)[0]
        rel = module_ids.get(int(ident)) if ident.isdigit() else None
        if rel is None:
            return _join(frame_prefix, module_path(path))
        if captured_prefix != frame_prefix and (
                rel == captured_prefix or rel.startswith(captured_prefix + ".")
                or not captured_prefix):
            rel = _join(frame_prefix, rel[len(captured_prefix):].lstrip("."))
        return rel

    def module_at(rel: str) -> nn.Module | None:
        if rel not in modules:
            try:
                modules[rel] = root.get_submodule(rel)
            except AttributeError:
                modules[rel] = None
        return modules[rel]

    # A size computed in a dynamic graph (``s0 * 2``) is no site: the graph names its tensors
    # as the same graph captured with static shapes does.
    calls = [n for n in graph.nodes if n.op in ("call_function", "call_method", "call_module")
             and not is_size(n)]
    # Which leaf-module call (by nn_module_stack key, unique per call) each node belongs to.
    leaf_call: dict[fx.Node, tuple[str, str, nn.Module]] = {}
    innermost: dict[fx.Node, str] = {}
    for node in calls:
        stack = node.meta.get("nn_module_stack") or {}
        inner = frame_prefix  # code of the frame's own module has no stack entry
        block = _block_of(node)
        for key, (path, _cls) in stack.items():
            rel = resolve(str(key), str(path))
            inner = rel
            if node in leaf_call:
                continue
            m = module_at(rel)
            if m is not None and rel and (is_leaf(m, _join(root_path, rel)) or key == block):
                leaf_call[node] = (str(key), rel, m)
        innermost[node] = _join(root_path, inner)
    members: dict[str, list[fx.Node]] = {}
    for node, (key, _rel, _m) in leaf_call.items():
        members.setdefault(key, []).append(node)
    outputs: dict[fx.Node, tuple[str, nn.Module]] = {}
    inputs: dict[fx.Node, tuple[tuple[fx.Node, ...], fx.Node]] = {}
    added: set[fx.Node] = set()
    for nodes in members.values():
        group = set(nodes)
        leaving = [n for n in nodes if any(u not in group for u in n.users)]
        # A value that only leaves the graph (a hook's kept copy, a cache written back) is
        # not what the code after the call reads.
        read = [n for n in leaving if any(u not in group and u.op != "output" for u in n.users)]
        out = (read or leaving or nodes)[-1]
        _k, rel, m = leaf_call[out]
        written = settle(out, nodes[nodes.index(out) + 1:])
        if written.target is as_returned:  # written through a view: a node of the call's
            _stack_upto(written, nodes[0], _k)
            added.add(written)
        outputs[written] = (_join(root_path, rel), m)
        inputs[written] = (_call_inputs(nodes, group), nodes[0])
    if added:  # in graph order, where the calls of the modules around them find them
        added.update(calls)
        calls = [n for n in graph.nodes if n in added]
    # Calls of modules dynamo traced through (``h.0.mlp``): a site on the one node whose value
    # leaves the call. Without nested graph breaks (dynamo's default) a call that a graph
    # break splits runs as a frame of its own, so every call seen here is whole.
    whole = not getattr(torch._dynamo.config, "nested_graph_breaks", False)
    calls_of: dict[str, list[fx.Node]] = {}
    where: dict[str, tuple[str, nn.Module]] = {}
    for node in calls:
        block = _block_of(node)
        for key, (path, _cls) in (node.meta.get("nn_module_stack") or {}).items():
            rel = resolve(str(key), str(path))
            m = module_at(rel)
            if m is None or not rel:
                continue
            seen_modules.add(_join(root_path, rel))
            if whole and not is_leaf(m, _join(root_path, rel)) and key != block:
                calls_of.setdefault(str(key), []).append(node)
                where[str(key)] = (rel, m)
    module_calls: dict[fx.Node, list[tuple[str, nn.Module, tuple[fx.Node, ...], fx.Node, str]]] = {}
    settles: list[fx.Node] = []  # nodes added after a write through a view (capture.settle)
    for key, nodes in calls_of.items():
        group = set(nodes)
        leaving = [n for n in nodes if any(u not in group for u in n.users)]
        if len(leaving) > 1:
            # Values that only leave the graph (a KV cache dynamo writes back) are not
            # what the code after the call reads.
            leaving = [n for n in leaving
                       if any(u not in group and u.op != "output" for u in n.users)]
        if len(leaving) != 1:
            continue  # several values (a tuple) or none: no one node holds the output
        rel, m = where[key]
        out = settle(leaving[0], nodes[nodes.index(leaving[0]) + 1:])
        if out.target is as_returned and out not in outputs:  # written through a view
            _stack_upto(out, nodes[0], key)
            settles.append(out)
        depth = [module_at(resolve(str(k), str(p))) for k, (p, _c) in
                 (nodes[0].meta.get("nn_module_stack") or {}).items()]
        module_calls.setdefault(out, []).append(
            (_join(root_path, rel), m, _call_inputs(nodes, group), nodes[0],
             _call_location(nodes[0], m, depth[depth.index(m):] if m in depth else [m])))

    if settles:
        known = {*calls, *settles}
        calls = [n for n in graph.nodes if n in known]
    seen: dict[tuple[str, str], int] = {}
    sites: dict[fx.Node, Site] = {}
    sdpa: dict[fx.Node, Site] = {}
    order: list[Site] = []

    def next_name(base: str, loc: str) -> str:
        occurrence = seen.get((base, loc), 0)
        seen[(base, loc)] = occurrence + 1
        return namer.name(base, f"{loc}#{repeat}" if repeat else loc, occurrence)

    if not repeat and not frame_prefix and not root_path:  # the model's own inputs
        for node in graph.nodes:
            arg = node.meta.get(INPUT) if node.op == "placeholder" else None
            if isinstance(arg, str):
                site = Site(namer.name(arg, "", 0), "dynamo", "placeholder", arg, "", None,
                            None)
                attach(node, site)
                sites[node] = site
                order.append(site)
    hooked = _hook_lines(modules.values())
    for node in calls:
        loc = _location(node)
        if node not in outputs and (node.target is as_returned or reads_kv(node)
                                    or hooked and _in_hook(node, hooked)):
            # A hook's own op (the model's hooks run inside the module call dynamo traced):
            # no site, as under fx, where a hooked module is called; named, it would take the
            # name of the forward's op after it (``a.add`` for the forward's ``a.add_1``).
            # Nor the node fxprobe added after a write through a view, nor its reads of a
            # shared block's cache entry (dynamo_blocks_cache): no ops of the model's.
            for path, m, args, first, at in reversed(module_calls.get(node, ())):
                call = Site(next_name(path, at), "dynamo", "call_module", path,
                            path, type(m), module_key(type(m)), inlined=True, listed=False)
                attach(node, call)
                node.meta.setdefault(CALL_ARGS, {})[call.name] = (args, first)
                order.append(call)
            continue
        if node in outputs:
            path, m = outputs[node]
            site = Site(next_name(path, loc), "dynamo", "call_module", path, path, type(m),
                        module_key(type(m)))
            # Its inputs are the module's, not the functional call's (``F.linear(x, w, b)``).
            node.meta.setdefault(CALL_ARGS, {})[site.name] = inputs[node]
        else:
            mpath = innermost[node]
            base = _join(mpath, op_name(node))
            key = dynamo_op_key(node)
            site = Site(next_name(base, loc), "dynamo", node.op, node.target, mpath, None, key)
        attach(node, site)
        sites[node] = site
        order.append(site)
        # Outer calls end after inner ones: the innermost module's site comes first.
        for path, m, args, first, at in reversed(module_calls.get(node, ())):
            call = Site(next_name(path, at), "dynamo", "call_module", path, path,
                        type(m), module_key(type(m)), inlined=True, listed=False)
            attach(node, call)
            node.meta.setdefault(CALL_ARGS, {})[call.name] = (args, first)
            order.append(call)
        if site.op_key == "scaled_dot_product_attention":
            base = _join(site.module_path, "attention_probs")
            probs = Site(next_name(base, loc), "dynamo", "call_function", probs_fn,
                         site.module_path, None, None)
            sdpa[node] = probs
            order.append(probs)
    return NamedGraph(sites, sdpa, order, frozenset(seen_modules))


def _block_of(node: fx.Node) -> Any:
    """For a call of a shared block (``dynamo_blocks.block_call``), the ``nn_module_stack``
    key of the block, whose call it is whole (as a leaf module's call); else None."""
    stack = node.meta.get("nn_module_stack")
    if node.target is not block_call or not stack:
        return None
    return list(stack)[-1]


INPUT = "fxprobe_input"
"""``node.meta`` key on a graph input that is an argument of the region's forward: its
parameter name (dynamo drops the input's source from the graph after the capture, and the
graph is named again later: for another module instance, with intervention points)."""

_ARG = re.compile(r"^L\['args'\]\[(\d+)\]$")
_KWARG = re.compile(r"^L\['kwargs'\]\['(\w+)'\]$")


def input_name(node: fx.Node, arg_names: Sequence[str]) -> str | None:
    """The parameter name of a graph input that is an argument the region's forward was
    called with (dynamo's source ``L['args'][i]`` or ``L['kwargs']['name']`` in the frame
    that calls it), else None."""
    if node.op != "placeholder":
        return None
    name = source_name(node)
    if name is None:
        return None
    found = _KWARG.match(name)
    if found:
        return found.group(1)
    found = _ARG.match(name)
    if found and int(found.group(1)) < len(arg_names):
        return arg_names[int(found.group(1))]
    return None


def _hook_lines(modules: Any) -> dict[str, list[tuple[int, int]]]:
    """The source lines (first, last) of the forward and pre-forward hooks of ``modules``
    (and the global module hooks), by file."""
    from torch.nn.modules import module as torch_module
    fns = [*torch_module._global_forward_pre_hooks.values(),
           *torch_module._global_forward_hooks.values()]
    for m in modules:
        if m is not None:
            fns += [*m._forward_pre_hooks.values(), *m._forward_hooks.values()]
    out: dict[str, list[tuple[int, int]]] = {}
    for fn in fns:
        fn = getattr(fn, "func", fn)  # functools.partial
        code = getattr(getattr(fn, "__func__", fn), "__code__", None)
        if code is None or getattr(fn, "_fxprobe_hook", False):
            continue
        lines = [line for _, _, line in code.co_lines() if line is not None]
        out.setdefault(code.co_filename, []).append((code.co_firstlineno, max(lines, default=0)))
    return out


def _in_hook(node: fx.Node, hooked: dict[str, list[tuple[int, int]]]) -> bool:
    """Whether a frame of ``node``'s stack trace is in the code of one of the ``hooked``."""
    for file, line in FILE_LINE.findall(node.meta.get("stack_trace") or ""):
        if any(a <= int(line) <= b for a, b in hooked.get(file, ())):
            return True
    return False


def _stack_upto(node: fx.Node, first: fx.Node, key: str) -> None:
    """Give ``node`` the module stack of the call ``key`` that ``first`` belongs to."""
    stack = {}
    for k, entry in (first.meta.get("nn_module_stack") or {}).items():
        stack[k] = entry
        if str(k) == key:
            break
    node.meta["nn_module_stack"] = stack


def _forward_code(m: nn.Module | None) -> Any:
    """The code of the forward the model runs for ``m``: not one fxprobe installed on its
    copy (a marked or shared block's), whose frames are not where the model called it."""
    if m is None:
        return None
    forward = own_forward(m)
    return getattr(getattr(forward, "__func__", forward), "__code__", None)


def _call_location(first: fx.Node, m: nn.Module, stack: list[nn.Module | None]) -> str:
    """Where module ``m`` was called (``file:line`` of the caller's frame), from the stack
    trace of the call's first node; ``stack`` is that node's module stack from ``m`` inwards.

    Not the first node's own line: a forward that branches (on a length, an early return)
    starts at another line in another graph, and a key that moved with it would name the
    same call ``blk`` in one graph and ``blk_1`` in the next."""
    code = _forward_code(m)
    frames = _frames(first)
    if code is not None:
        lines = {ln for _, _, ln in code.co_lines() if ln is not None}  # not a nested def's
        inside = [i for i, (file, line) in enumerate(frames)
                  if file == code.co_filename and int(line) in lines]
        # Modules of the same class nested in ``m`` run the same code in deeper frames.
        nested = sum(1 for s in stack if _forward_code(s) is code)
        if 0 < nested <= len(inside) and inside[-nested] > 0:
            file, line = frames[inside[-nested] - 1]
            return f"{file}:{line}"
    return _location(first)


def _call_inputs(nodes: list[fx.Node], group: set[fx.Node]) -> tuple[fx.Node, ...]:
    """The values a module call read from outside it, in first-use order: its tensor inputs,
    without the parameters and buffers (graph inputs that dynamo sourced from a module)."""
    found: dict[fx.Node, None] = {}
    for n in nodes:
        for a in n.all_input_nodes:
            if a in group or a in found or a.op == "get_attr" or is_size(a):
                continue  # (a size in a dynamic graph is no input of the call's)
            if a.op == "placeholder" and (a.meta.get(STATE) or is_state(a)):
                continue
            found[a] = None
    return tuple(found)
