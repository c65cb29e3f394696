"""Repeated blocks traced once by torch dynamo, then inlined back into one flat graph.

Dynamo's symbolic tracing of a deep model costs about the same for every decoder layer. torch's
``nested_compile_region`` (``torch.compiler``) lets dynamo trace a marked function once and
reuse the traced body for every later call whose inputs match: the captured graph then holds
one ``invoke_subgraph`` call per layer, all sharing one body graph. fxprobe marks, on its own
copy of the model (never the model), the forward of each module of a ``ModuleList`` of two or
more modules of one class (the outermost such lists: a model's layers), for the calls of a
model with a ``config`` that carry no cache (:func:`carries_cache`), as a ``functools.partial``
on the instance (a bound method makes torch 2.13 stamp the first instance's weights into later
calls). Where dynamo fails on the marked blocks (a graph break inside one), the call runs again
unmarked, for good (:func:`run_marked`). The backend then :func:`inline_calls` every
``invoke_subgraph`` call before anything names the graph: the body's nodes are copied at each
call, each copy's ``nn_module_stack`` and ``stack_trace`` rewritten from the traced instance to
the called one (``layers.0`` -> ``layers.7``) after checking that the call reads the called
instance's parameters, so that naming, the canonical pass, the taps and the intervention points
see the graph dynamo captures without the marking, node for node::

    getitem(invoke_subgraph(body, "subgraph_0", x, w7...), 0)  ->  body's nodes on (x, w7...)

Repeated blocks are marked under ``FXPROBE_DYNAMO_REGIONS=marked``; the default shares them
instead (:func:`shared`, ``dynamo_blocks``); ``FXPROBE_DYNAMO_REGIONS=0`` turns both off.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import operator
import os
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import fx, nn
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from ..core.errors import ConfigError, DynamoError
from .mirror import (
    _OVERRIDE,  # the mark of a forward fxprobe installed on its copy
    Registrations,
    any_hooks,
    global_keys,
)

MODES = {"shared": "shared", "marked": "marked", "1": "marked", "0": "off"}
"""The values of ``FXPROBE_DYNAMO_REGIONS`` and what each does with repeated blocks: captured
once and called as one op (``shared``, the default, ``dynamo_blocks``), marked and inlined
(``marked``, or ``1``), or traced in every call like the rest (``0``)."""


def mode() -> str:
    """``shared``, ``marked`` or ``off`` (``FXPROBE_DYNAMO_REGIONS``, read as each tapped module
    is built).

    Raises:
        ConfigError: another value.
    """
    value = os.environ.get("FXPROBE_DYNAMO_REGIONS") or "shared"  # set empty: the default
    if value not in MODES:
        raise ConfigError(
            f"FXPROBE_DYNAMO_REGIONS={value!r} is not a mode; use 'shared' (the default: each "
            "distinct block captured once), 'marked' (blocks marked and inlined into one graph) "
            "or '0' (every block traced in every capture)")
    return MODES[value]


def enabled() -> bool:
    """Whether repeated blocks are shared or marked (``FXPROBE_DYNAMO_REGIONS=0`` turns it off)."""
    return mode() != "off"


def shared() -> bool:
    """Whether repeated blocks are captured once for all and called as one op of the graph
    around them (the default, ``dynamo_blocks``) instead of marked
    (``FXPROBE_DYNAMO_REGIONS=marked``)."""
    return mode() == "shared"


def repeated_blocks(root: nn.Module) -> list[nn.Module]:
    """The modules whose forward is marked: the children of each outermost ``ModuleList`` of
    two or more modules of one class, none with a forward of its own on the instance."""
    found: list[nn.Module] = []
    taken: set[int] = set()
    for _name, m in root.named_modules():
        if id(m) in taken or not isinstance(m, nn.ModuleList):
            continue
        children = list(m)
        if len(children) < 2 or len({type(c) for c in children}) != 1:
            continue
        if any("forward" in c.__dict__ for c in children):
            continue  # a forward replaced on the instance (a wrapper, fxprobe's dispatcher)
        if len({id(c) for c in children}) != len(children):
            continue  # one module listed twice
        found.extend(children)
        taken.update(id(x) for c in children for x in c.modules())
    return found


def shareable(root: nn.Module, blocks: list[nn.Module]) -> bool:
    """Whether ``blocks`` (:func:`repeated_blocks`) may be shared (``dynamo_blocks``): one list
    of one class, and no other list of modules outside them. An encoder-decoder whose other
    stack has one layer (T5's one-layer encoder, BART's one-layer decoder) has such a list; the
    canonical pass names two stacks only where both are traced in the graph, so it is marked
    instead."""
    if not blocks or len({type(b) for b in blocks}) != 1:
        return False
    if getattr(getattr(root, "config", None), "is_encoder_decoder", False):
        return False
    inside = {id(x) for b in blocks for x in b.modules()}
    lists = [m for m in root.modules() if isinstance(m, nn.ModuleList) and len(m)
             and id(m) not in inside]
    return sum(any(id(c) in inside for c in m) for m in lists) == 1 and all(
        any(id(x) in inside for x in m.modules()) for m in lists)


def carries_cache(module: nn.Module, kwargs: Mapping[str, Any]) -> bool:
    """Whether a call may carry a key/value cache (the blocks are then not marked): a module
    without a ``config`` (a model of the user's own, whose blocks may keep state), or
    ``past_key_values`` given, or ``use_cache`` (the argument, else ``config.use_cache``) true
    in a model that is no encoder (``config.is_decoder`` false and no encoder-decoder: BERT's
    layers ignore ``use_cache``). A wrong guess costs time: dynamo then traces the blocks
    that update a cache each on its own (tested: sites and values as unmarked)."""
    config = getattr(module, "config", None)
    if config is None or kwargs.get("past_key_values") is not None:
        return True
    use = kwargs.get("use_cache", getattr(config, "use_cache", None))
    return bool(use) and (bool(getattr(config, "is_decoder", True))
                          or bool(getattr(config, "is_encoder_decoder", False)))


def hooked(blocks: list[tuple[nn.Module, Any]]) -> bool:
    """Whether a module hook (on a module of a block, fxprobe's included, or a global one) is
    set: dynamo would reuse the body it traced for a block whose modules are hooked otherwise
    (a hook on one layer's MLP never ran), so such a call is not marked."""
    return any(global_keys()) or any(any_hooks(m) for b, _ in blocks for m in b.modules())


class HookCheck:
    """:func:`hooked` for one list of blocks, looked at again only after a hook was
    registered anywhere (``mirror.Registrations``; a removal draws no number, so blocks
    found hooked stay so until the next registration: they are traced unmarked meanwhile)."""

    def __init__(self, blocks: list[tuple[nn.Module, Any]]) -> None:
        self.blocks = blocks
        self.registrations = Registrations(seen=False)
        self.found = False

    def __call__(self) -> bool:
        if self.blocks and self.registrations.moved():
            self.found = hooked(self.blocks)
        return self.found



def marks(blocks: list[nn.Module]) -> list[tuple[nn.Module, Any]]:
    """Each block with its forward marked as a nested compile region, bound once (dynamo
    guards on the forward it finds: the same object at every call)."""
    out = []
    for block in blocks:
        # A partial, not a bound method: torch 2.13 stamps out the first instance's weights
        # for every later call of a marked bound method on an instance (a wrong answer).
        forward = functools.partial(_marked(type(block).forward), block)
        setattr(forward, _OVERRIDE, True)  # not a forward the user replaced (frontends.mirror)
        out.append((block, forward))
    return out


_INSTALLS = threading.Condition()
_ACTIVE: dict[nn.Module, tuple[Any, collections.Counter[int]]] = {}
"""Each block whose forward a call running now installed: that forward, and how many calls
of each thread run with it."""


@contextlib.contextmanager
def marked(blocks: list[tuple[nn.Module, Any]]) -> Iterator[None]:
    """The marked forwards (:func:`marks`) installed on fxprobe's copy for the duration of a
    call; code run as written inside it runs the same function.

    Calls in several threads share the copy: a forward stays installed until the last call
    running with it returns (another thread's call that ended first would otherwise take it
    away before dynamo checks its guards, and dynamo would capture the call again without
    the forward, under other names: an edit by the first name silently lost), and a call
    that needs other forwards (with a cache where the running ones carry none) waits for
    the running calls to return; a call nested in one of this thread's own replaces them."""
    me = threading.get_ident()
    with _INSTALLS:
        while any(block in _ACTIVE and _ACTIVE[block][0] is not forward
                  and me not in _ACTIVE[block][1] for block, forward in blocks):
            _INSTALLS.wait()
        for block, forward in blocks:
            entry = _ACTIVE.get(block)
            if entry is None or entry[0] is not forward:
                object.__setattr__(block, "forward", forward)
                entry = _ACTIVE[block] = (forward, collections.Counter())
            entry[1][me] += 1
    try:
        yield
    finally:
        with _INSTALLS:
            for block, forward in blocks:
                entry = _ACTIVE.get(block)
                if entry is None or entry[0] is not forward:
                    continue  # replaced by a call nested in this one, which took it away
                entry[1][me] -= 1
                if entry[1][me] <= 0:
                    del entry[1][me]
                if not entry[1]:
                    del _ACTIVE[block]
                    block.__dict__.pop("forward", None)
            _INSTALLS.notify_all()


def run_marked(blocks: list[tuple[nn.Module, Any]], run: Callable[[], Any],
               ran: Callable[[], bool], unmark: Callable[[], None]) -> Any:
    """``run()`` with ``blocks`` marked; where it fails before any of fxprobe's graphs ran
    (``ran()``), ``run()`` again unmarked, and where that succeeds the failure was the
    marking's (a graph break inside a block, which a nested compile region cannot hold;
    dynamo's own assertions stamping a block; fxprobe's checks of the stamped calls):
    ``unmark()`` for good (each block is then traced on its own, as without the marking).
    Floats are specialized while marked: torch 2.13 fails to stamp a block that reads a
    float attribute (an epsilon) lifted as an input."""
    if not blocks:
        return run()
    try:
        with marked(blocks), torch._dynamo.config.patch(specialize_float=True):
            return run()
    except torch._dynamo.exc.FailOnRecompileLimitHit:
        raise
    except Exception as e:
        if ran() or not _compiling(e):
            raise
    result = run()  # the model's own error raises here too, and the marking stays
    unmark()
    return result


def _compiling(e: BaseException) -> bool:
    """Whether ``e`` is dynamo's, raised while it traced (not the model's or an edit's, raised
    while a graph ran: that code must not run twice)."""
    if isinstance(e, torch._dynamo.exc.TorchDynamoException):
        return True
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    where = tb.tb_frame.f_code.co_filename.replace("\\", "/") if tb is not None else ""
    return "/torch/_dynamo/" in where or "/torch/_higher_order_ops/" in where


_MARKED: dict[Any, Any] = {}


def _marked(forward: Any) -> Any:
    """One marked function per forward (dynamo reuses a body per marked function)."""
    fn = _MARKED.get(forward)
    if fn is None:
        fn = _MARKED[forward] = torch.compiler.nested_compile_region(forward)
        setattr(fn, _OVERRIDE, True)  # not a forward the user replaced (frontends.mirror)
    return fn


def _is_call(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is torch.ops.higher_order.invoke_subgraph


def _fail(node: fx.Node, why: str) -> DynamoError:
    return DynamoError(
        f"fxprobe could not inline the block dynamo captured once ({node.format_node()}): "
        f"{why}. Set FXPROBE_DYNAMO_REGIONS=0 to capture every block on its own.")


def drop_dead_sizes(gm: fx.GraphModule, marked: bool) -> None:
    """The sizes that nothing reads, in a graph dynamo traced with marked blocks (``marked``):
    its tracer of a marked block it traces in place records them, dynamo's trace of an
    unmarked block does not (and such a read of a block's value would hide its output)."""
    if not marked:
        return
    _fold_sizes(gm.graph, [n for n in gm.graph.nodes if n.op in ("call_function",
                                                                  "call_method")])
    gm.recompile()


def inline_calls(gm: fx.GraphModule, module_ids: Mapping[int, str], root: nn.Module,
                 example_inputs: Sequence[Any]) -> tuple[int, int]:
    """Inline every ``invoke_subgraph`` call of ``gm`` (see the module docstring); the number
    of calls inlined and of the bodies dynamo traced for them. ``module_ids``: the path of
    every module of ``root`` (the region's module; dynamo's ``nn_module_stack`` keys by
    ``id``); ``example_inputs``: the graph's inputs (its first placeholders), to check that
    each call reads the parameters and buffers of its own instance."""
    graph = gm.graph
    calls = [n for n in graph.nodes if _is_call(n)]
    if not calls:
        return 0, 0
    values = dict(zip([n for n in graph.nodes if n.op == "placeholder"], example_inputs,
                      strict=False))
    state: dict[int, list[str]] = {}
    for name, t in [*root.named_parameters(remove_duplicate=False),
                    *root.named_buffers(remove_duplicate=False)]:
        state.setdefault(id(t), []).append(name)

    def names(node: Any) -> list[str]:
        value = values.get(node) if isinstance(node, fx.Node) else None
        return state.get(id(value), []) if value is not None else []

    # The first call of each body (the one dynamo traced): its operands and metadata, read
    # before any call is inlined (an inlined call is erased).
    traced: dict[str, tuple[tuple[Any, ...], dict[str, Any]]] = {}
    for call in calls:
        traced.setdefault(str(call.args[0].target),  # type: ignore[union-attr]
                          (tuple(call.args[2:]), dict(call.meta)))
    _called_once(graph, calls)
    for call in calls:
        attr = call.args[0]
        if not isinstance(attr, fx.Node) or attr.op != "get_attr":
            raise _fail(call, "its body is not a submodule of the graph")
        body = gm.get_submodule(str(attr.target))
        if not isinstance(body, fx.GraphModule):
            raise _fail(call, "its body is not a graph")
        if any(_is_call(n) or n.op in ("get_attr", "call_module") for n in body.graph.nodes):
            raise _fail(call, "its body calls another marked block or reads an attribute")
        if any(free_unbacked_symbols(n.meta.get("example_value")) for n in body.graph.nodes):
            # A size that depends on data (a mixture of experts' routing): not stamped.
            raise _fail(call, "its body has sizes that depend on the data")
        _inline(graph, call, body.graph, traced[str(attr.target)], module_ids, root, names)
        if not attr.users:
            graph.erase_node(attr)
    graph.lint()
    gm.recompile()
    return len(calls), len(traced)


def _called_once(graph: fx.Graph, calls: list[fx.Node]) -> None:
    """Refuse a block instance called more than once in the graph (``layers[0]`` twice):
    dynamo's keys of a stamped call do not count the calls of the modules below it, as those
    of a block traced in place do (``lin``, ``lin@1``), so its sites would be misnamed (the
    second call's value under the first call's name)."""
    seen: dict[str, fx.Node] = {}
    for call in calls:
        stack = list(call.meta.get("nn_module_stack") or {})
        key = str(stack[-1]).split("@", 1)[0] if stack else ""
        if key in seen:
            raise _fail(call, "its block is called more than once")
        seen[key] = call
    for node in graph.nodes:
        if node.op not in ("call_function", "call_method", "call_module") or _is_call(
                node) or (node.target is operator.getitem and isinstance(
                    node.args[0], fx.Node) and _is_call(node.args[0])):
            continue  # an input, a body, a call, or an output of one
        for key in node.meta.get("nn_module_stack") or {}:
            if str(key).split("@", 1)[0] in seen:
                raise _fail(seen[str(key).split("@", 1)[0]],
                            "its block is called more than once")


def _inline(graph: fx.Graph, call: fx.Node, body: fx.Graph,
            first: tuple[tuple[Any, ...], dict[str, Any]], module_ids: Mapping[int, str],
            root: nn.Module, names: Callable[[Any], list[str]]) -> None:
    operands = list(call.args[2:])
    holders = [n for n in body.nodes if n.op == "placeholder"]
    if len(holders) != len(operands) or call.kwargs:
        raise _fail(call, f"{len(operands)} operands for {len(holders)} inputs")
    retarget = _Retarget(call, first[1], module_ids, root)
    for theirs, ours in zip(first[0], operands, strict=True):
        # The traced instance's own parameter or buffer: this call's must be its twin in the
        # called instance; any other (shared) one: the very same.
        own = [n[len(retarget.traced):] for n in names(theirs)
               if n.startswith(retarget.traced + ".")]
        if own and not any(retarget.block + o in names(ours) for o in own):
            raise _fail(call, f"it reads {names(ours) or ours} for {retarget.block + own[0]!r}")
        if names(theirs) and not own and ours is not theirs:
            raise _fail(call, f"it reads {names(ours) or ours} for {names(theirs)[0]!r}")
    env: dict[fx.Node, Any] = {}
    for holder, operand in zip(holders, operands, strict=True):
        env[holder] = operand
        want = holder.meta.get("example_value")
        got = operand.meta.get("example_value") if isinstance(operand, fx.Node) else operand
        if isinstance(want, torch.Tensor) and not isinstance(got, torch.Tensor):
            # A float attribute (an epsilon) lifted as a tensor at the traced call and handed
            # over as its ``.item()`` at the later ones: the body reads it through ``.item()``.
            if not all(u.op == "call_method" and u.target == "item" for u in holder.users):
                raise _fail(call, f"input {holder.name} is a tensor in the body, not here")
            env.update((u, operand) for u in holder.users)
    out: Any = None
    with graph.inserting_before(call):
        for node in body.nodes:
            if node.op == "placeholder" or node in env:
                continue
            if node.op == "output":
                out = node.args[0]
                continue
            copy = graph.node_copy(node, lambda n: env[n])
            copy.meta = retarget(node.meta)
            env[node] = copy
    if not isinstance(out, (tuple, list)):
        raise _fail(call, "its body returns no tuple")
    for user in list(call.users):
        if user.op != "call_function" or user.target is not operator.getitem or not isinstance(
                user.args[1], int):
            raise _fail(call, f"its result is read by {user.format_node()}, not an index")
        value = out[user.args[1]]
        user.replace_all_uses_with(env[value] if isinstance(value, fx.Node) else value)
        graph.erase_node(user)
    graph.erase_node(call)
    _fold_sizes(graph, [n for n in env.values() if isinstance(n, fx.Node)
                        and n.graph is graph and n.op != "placeholder"])


def _fold_sizes(graph: fx.Graph, nodes: list[fx.Node]) -> None:
    """The sizes a stamped body reads of its inputs (``x.shape[0]``, ``s0 == 1``) that nothing
    uses: dynamo's trace of an unmarked block records no node for them. Only reads: an op
    that returns nothing (``x[i] = v``, a write) is never dropped."""
    for node in reversed(nodes):
        if node.users or not _size(node.meta.get("example_value")):
            continue
        if (node.op == "call_method" and node.target in ("size", "dim", "numel", "stride")) or (
                node.op == "call_function" and node.target in _READS):
            graph.erase_node(node)


_READS = {operator.getitem, operator.eq, operator.ne, operator.lt, operator.le, operator.gt,
          operator.ge, operator.mul, operator.add, operator.sub, operator.floordiv}
_SIZES = (int, bool, torch.SymInt, torch.SymBool)


def _size(value: Any) -> bool:
    """A size: an int or bool (symbolic or not), or a shape of them."""
    if isinstance(value, (tuple, list)):  # torch.Size included
        return bool(value) and all(isinstance(v, _SIZES) for v in value)
    return isinstance(value, _SIZES)


class _Retarget:
    """A body node's metadata, moved from the instance dynamo traced to the one called: its
    ``nn_module_stack`` below the block and its ``stack_trace`` below the call line."""

    def __init__(self, call: fx.Node, first: dict[str, Any], module_ids: Mapping[int, str],
                 root: nn.Module) -> None:
        self.stack = list((call.meta.get("nn_module_stack") or {}).items())
        first_stack = list((first.get("nn_module_stack") or {}).items())
        if not self.stack or len(first_stack) != len(self.stack):
            raise _fail(call, "its module stack is not that of the block dynamo traced")
        self.call, self.root, self.module_ids = call, root, module_ids
        self.block = self._rel(call, self.stack[-1][0])
        self.traced = self._rel(call, first_stack[-1][0])
        self.keys = [k for k, _ in first_stack]
        self.trace = (first.get("stack_trace") or "").rstrip("\n").splitlines()
        self.new_trace = (call.meta.get("stack_trace") or "").rstrip("\n").splitlines()

    def _rel(self, node: fx.Node, key: str) -> str:
        ident = str(key).split("@", 1)[0]
        rel = self.module_ids.get(int(ident)) if ident.isdigit() else None
        if rel is None:
            raise _fail(node, f"module stack entry {key!r} is no module of the region")
        return rel

    def __call__(self, meta: dict[str, Any]) -> dict[str, Any]:
        meta = dict(meta)
        stack = list((meta.get("nn_module_stack") or {}).items())
        d = len(self.stack)
        if [k for k, _ in stack[:d]] != self.keys:
            raise _fail(self.call, "a node of its body runs outside the block")
        new = dict(self.stack)
        for key, (_path, cls) in stack[d:]:
            rel = self._rel(self.call, key)
            if not rel.startswith(self.traced + "."):
                raise _fail(self.call, f"{rel!r} is not inside {self.traced!r}")
            suffix = rel[len(self.traced):]
            module = self.root.get_submodule(self.block + suffix)
            if type(module) is not cls:
                raise _fail(self.call, f"{self.block + suffix!r} is no {cls.__name__}")
            tail = str(key)[len(str(key).split("@", 1)[0]):]
            new[f"{id(module)}{tail}"] = (self.stack[-1][1][0] + suffix, cls)
        meta["nn_module_stack"] = new
        trace = (meta.get("stack_trace") or "").rstrip("\n").splitlines()
        if trace:
            if trace[: len(self.trace)] != self.trace:
                raise _fail(self.call, "the body's stack trace does not start at the call")
            meta["stack_trace"] = "\n".join([*self.new_trace, *trace[len(self.trace):]]) + "\n"
        fns = meta.get("source_fn_stack")
        if fns and fns[0][0].startswith("invoke_subgraph"):
            meta["source_fn_stack"] = fns[1:]
        return meta
