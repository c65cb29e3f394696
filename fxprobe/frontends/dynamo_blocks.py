"""Repeated blocks captured once and called as one op of the graph around them.

Dynamo's tracing of a whole model costs about the same again for every decoder layer, and so
does torch's ``nested_compile_region`` (which traces each call to check it against the
body): at 32 layers a first forward costs several times a 2-layer one. By default
(``FXPROBE_DYNAMO_REGIONS=shared``) a :class:`~.dynamo.DynamoRegion` installs, on fxprobe's copy
and for a call without a cache, the forward of each repeated block (``dynamo_inline.
repeated_blocks``) as a call of :func:`block_call`, which dynamo puts in the region's graph
as one op (``torch._dynamo.allow_in_graph``) without tracing into it. Running, that op calls
the block through a second ``torch.compile`` of the block's forward with the region's own
backend (:class:`Blocks`, a code object per region): dynamo captures the block's code once
for every instance (its parameters are graph inputs), and the region names that graph for
each instance (``dynamo_versions._Captured.version``: ``model.layers.7.add_1``, its canonical names
``blocks.7.*``). The op's own site is the block's module call (``model.layers.7``), and the
canonical pass names the stream around the blocks (``resid_pre``, ``embed``, ``ln_final``,
``logits``) from the ops (``canonical_ends.around_shared``).

While dynamo traces the graph around the blocks, each op's value is made on fake tensors:
the first block's forward runs on the trace's fake tensors (its parameters made fake), and a
later block whose inputs, parameters and buffers have the same shapes, strides and dtypes
gets an output like it when its modules' other attributes are equal too (``_settings``: a
convolution's ``stride``; an integer equal to the block's place in its list, a layer's
``layer_idx``, is not compared). Running, such a block's output is checked against that
block's once per trace (the same shapes where their inputs had the same shapes), and a block
whose output differs raises ``DynamoError`` rather than run on. The forward runs through its
submodules' ``__call__``, so the region shares the blocks only while no block's module has a
hook and no global module hook is set (``dynamo_inline.hooked``); a call that meets one (set
inside the model's forward) runs again unmarked, for good.

Warm, each block call would go through dynamo's frame evaluation (the ``torch.compile``
wrapper, its cache lookup, the ``recompile_limit`` setting around it): about as much again
as a small layer's own graph. :meth:`Blocks.cached` does dynamo's cache lookup itself: the
first of the code's cache entries whose guards (dynamo's own guard tree, checked on this
call's frame as dynamo checks it: shapes, strides, dtypes, devices, grad mode, autocast,
training flags, the parameters and every module attribute and global the trace read) pass
runs its transformed code, which calls fxprobe's graph for the block (``dynamo_versions._Captured``,
named per instance and choosing the per-call version as always). Only a transformed code that
does nothing else qualifies (no graph break, whose resume function dynamo would compile; no
side effect replayed; no global or attribute but the block's parameters): any other call,
and any call no entry's guards pass, goes through dynamo as before (which compiles it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import dis
import functools
import re
import types
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.fx.experimental._config as fx_config
from torch import fx, nn
from torch._dynamo import eval_frame
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils import _pytree as pytree

from ..core.errors import DynamoError
from ..core.site import source_name
from .dynamo_inline import HookCheck
from .dynamo_shapes import UNCHECKED, call_frame, serving
from .mirror import _OVERRIDE  # the mark of a forward fxprobe installed on its copy

_LIVE: weakref.WeakValueDictionary[int, Blocks] = weakref.WeakValueDictionary()
_MISS = object()  # no cache entry served the call (Blocks.cached)
_STATE_NAMES = frozenset({"_modules", "_parameters", "_buffers"})
_PLAIN_NAMES = _STATE_NAMES | frozenset({  # the block's parameters, read as the graph's inputs
    "__import_torch_dot__dynamo_dot_utils", "record_pregraph_bytecode_enter",
    "record_pregraph_bytecode_exit", "call_size", "call_stride", "call_storage_offset"})
_PLAIN_OPS = frozenset({
    "NOP", "CACHE", "RESUME", "COPY_FREE_VARS", "LOAD_FAST",
    "LOAD_FAST_CHECK", "LOAD_FAST_BORROW", "LOAD_CONST", "LOAD_SMALL_INT", "STORE_FAST",
    "DELETE_FAST", "LOAD_GLOBAL", "LOAD_ATTR", "LOAD_METHOD", "PUSH_NULL", "COPY", "SWAP",
    "POP_TOP", "PRECALL", "KW_NAMES", "CALL", "CALL_KW", "CALL_FUNCTION_EX", "BINARY_SUBSCR",
    "BUILD_LIST", "BUILD_TUPLE", "BUILD_MAP", "BUILD_CONST_KEY_MAP", "LIST_EXTEND",
    "LIST_APPEND", "LIST_TO_TUPLE", "DICT_MERGE", "DICT_UPDATE", "UNPACK_SEQUENCE",
    "RETURN_VALUE", "RETURN_CONST"})


def _plain(code: types.CodeType) -> bool:
    """Whether a transformed code of a block only calls its one graph: it reads the frame's
    arguments and the block's parameters (``_modules``, ``_parameters``), calls the graph and
    dynamo's own helpers (no more calls than those callables), and builds what it returns from
    plain containers. No graph break (dynamo would compile the resume function it calls, or
    the code it calls as written), no side effect replayed (a store), no other global or
    attribute (each could run Python code that dynamo would compile)."""
    graphs = set()
    # Each call must call one of the callables loaded by name (or a local that dynamo keeps
    # one in: ``LOAD_ATTR call_size; COPY 1; STORE_FAST tmp``), never the frame's arguments.
    callables = calls = 0
    holders: set[str] = set()
    before: list[Any] = [None, None]  # the two instructions before
    for ins in dis.get_instructions(code):
        if ins.opname not in _PLAIN_OPS:
            return False
        calls += ins.opname.startswith("CALL")
        if ins.opcode in dis.hasname:
            name = ins.argval
            if isinstance(name, str) and name.startswith("__compiled_fn"):
                graphs.add(name)
            elif name not in _PLAIN_NAMES:
                return False
            callables += _callable(ins)
        elif ins.opname == "STORE_FAST" and before[1].opname == "COPY" and _callable(before[0]):
            holders.add(ins.argval)
        elif ins.opname.startswith("LOAD_FAST") and ins.argval in holders:
            callables += 1
        before = [before[1], ins]
    return len(graphs) == 1 and calls <= callables and not any(
        isinstance(c, types.CodeType) for c in code.co_consts)


def _callable(ins: Any) -> bool:
    """Whether ``ins`` loads one of the functions a plain transformed code calls."""
    return ins is not None and ins.opcode in dis.hasname and isinstance(ins.argval, str) \
        and ins.argval not in _STATE_NAMES and not ins.argval.startswith("__import_")


_SOURCE = re.compile(r"^L\['(args|kwargs)'\]((?:\[(?:\d+|'\w+')\])+)(?:\.size\(\)\[\d+\])?$")
_STEP = re.compile(r"\[(?:(\d+)|'(\w+)')\]")


def block_inputs(graph: fx.Graph) -> dict[str, tuple[int | str, ...]]:
    """Where each input of a block's own graph comes from among the arguments of the
    :func:`block_call` op that runs it (``CapturedGraph.inputs``): ``(0, 2 + i, ...)`` for the
    forward's argument ``i`` (the op's first two are the :class:`Blocks` key and the block's
    index), ``(1, name, ...)`` for a keyword, then the indices into the tuples it holds (a
    size the graph takes as an input comes from the tensor it measures)."""
    out: dict[str, tuple[int | str, ...]] = {}
    for node in graph.nodes:
        found = _SOURCE.match(source_name(node) or "") if node.op == "placeholder" else None
        if found is None:
            continue
        steps = [int(i) if i else key for i, key in _STEP.findall(found.group(2))]
        first = steps[0]
        out[node.name] = ((0, 2 + first, *steps[1:]) if found.group(1) == "args"
                          and isinstance(first, int) else (1, *steps))
    return out


@torch._dynamo.allow_in_graph
def block_call(key: int, index: int, *args: Any, **kwargs: Any) -> Any:
    """A call of block ``index`` of the :class:`Blocks` numbered ``key``: one op of the
    region's graph, which dynamo does not trace into."""
    return _LIVE[key].run(index, args, kwargs)


class Blocks:
    """The repeated blocks of one region, their forward compiled once for all of them."""

    def __init__(self, blocks: list[nn.Module], backend: Callable[..., Any],
                 module_ids: dict[int, str]) -> None:
        self.blocks = blocks
        self.forward = forward = type(blocks[0]).forward

        def run_block(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
            return forward(module, *args, **kwargs)

        # A code object of this region's own: dynamo caches graphs (and counts recompiles
        # against recompile_limit) per code object.
        run_block.__code__ = run_block.__code__.replace(
            co_name=f"fxprobe_block_{type(blocks[0]).__name__}")
        self.compiled = torch.compile(run_block, backend=backend, dynamic=True)
        self.run_block = run_block
        self.direct: dict[types.CodeType, Callable[..., Any] | None] = {}
        """Each transformed code of ``run_block`` as a function (None: not plain, ``_function``)."""
        self.lookup = True
        """Whether :meth:`cached` looks the graph up (until a guard tree fails to check)."""
        self.mode: Any = None  # the fake mode of the trace the two caches below belong to
        self.fake_state: dict[int, dict[str, torch.Tensor]] = {}
        self.made: dict[str, Any] = {}
        self.first: dict[str, int] = {}  # the block whose output each key was made for
        self.twins: dict[int, int] = {}  # block -> the block whose output made its own
        self.ran: dict[int, tuple[Any, Any]] = {}  # block -> its last shapes in and out
        self.unchecked: set[int] = set()  # twins and their models not checked since a trace
        self.places = _places(blocks)
        """The attributes that hold each block's place (``_settings``)."""
        self.paths = frozenset(module_ids[id(b)] for b in blocks)
        """The blocks' paths relative to the region."""
        self.capturing = False
        """Whether dynamo is capturing the blocks' own code now (not a graph break: the
        region's ``DynamoInfo.breaks`` counts only the graphs around the blocks)."""
        self.stream_out = False
        """Whether the graph around the blocks names each call ``blocks.L.resid_post``
        (``canonical``): the blocks' own graphs then do not."""
        self.ones: list[set[int]] | None = None
        """Each tensor argument's dims of size exactly 1 in the region's last trace."""
        self.symbolic: Callable[..., Any] | None = None
        """``dynamo_shapes.symbolic_batch``, set by the region (:meth:`batch`)."""
        self.key = id(self)
        _LIVE[self.key] = self
        self.forwards: list[tuple[nn.Module, Any]] = []
        for i, block in enumerate(blocks):
            fn = functools.partial(block_call, self.key, i)
            setattr(fn, _OVERRIDE, True)  # not a forward the user replaced (frontends.mirror)
            self.forwards.append((block, fn))
        self.hooked = HookCheck(self.forwards)
        """Whether a module of a block has a hook (looked at again after a registration)."""

    def run(self, index: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        block = self.blocks[index]
        first = next((a for a in args if isinstance(a, torch.Tensor)), None)
        mode = first.fake_mode if isinstance(first, FakeTensor) else (
            detect_fake_mode((args, kwargs)) if first is None else None)
        if mode is None:  # running: the block's own graph, named for this instance
            out = self.cached(block, args, kwargs)
            if out is _MISS:
                # One code object for every instance: each may need graphs of its own (a
                # layer reading its index), as many as a block traced inside the model gets.
                config = torch._dynamo.config
                limit = config.recompile_limit
                config.recompile_limit = limit * len(self.blocks)
                try:
                    # Each size its own symbol: dynamo's duck sizing would give a head
                    # dimension of 8 (RoPE's cos) and a first sequence length of 8 one
                    # symbol, and the head dimension's fixed size would fix the length.
                    self.capturing = True  # a graph captured now is a block's own
                    with fx_config.patch(  # type: ignore[attr-defined]
                            use_duck_shape=False), self.batch((args, kwargs)):
                        out = self.compiled(block, *args, **kwargs)
                finally:
                    config.recompile_limit = limit
                    self.capturing = False
            if index in self.unchecked:  # once per trace
                self._check(index, args, kwargs, out)
            return out
        if self.hooked():  # set inside the model's forward (transformers' recorder
            # of output_attentions): it would see fake tensors. Not a graph break, which would
            # run the block's own graph with the hook and lose what it records: the capture
            # fails, and the call runs again unshared (dynamo_inline.run_marked).
            raise _Hooked("fxprobe: a module hook inside a shared block")
        if mode is not self.mode:
            self.mode, self.fake_state, self.made, self.first = mode, {}, {}, {}
            self.unchecked = set()
        key = _meta((args, kwargs, dict(block.named_parameters()),
                     dict(block.named_buffers()))) + _settings(block, self.places)
        made = self.made.get(key)
        if made is not None:  # a block like one whose output was made in this trace
            self.twins[index] = self.first[key]
            self.unchecked |= {index, self.first[key]}
            with mode:
                return pytree.tree_map_only(torch.Tensor, lambda t: torch.empty_strided(
                    t.shape, t.stride(), dtype=t.dtype, device=t.device,
                    requires_grad=t.requires_grad), made)
        state = self.fake_state.get(index)
        if state is None:
            state = self.fake_state[index] = {
                n: mode.from_tensor(t, static_shapes=True)
                for n, t in [*block.named_parameters(), *block.named_buffers()]}
        self.ones = [{d for d, n in enumerate(t.shape) if type(n) is int and n == 1}
                     for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        with torch.nn.utils.stateless._reparametrize_module(block, state), mode:
            out = self.forward(block, *args, **kwargs)
        self.made[key], self.first[key] = out, index
        return out

    def batch(self, values: Any) -> Any:
        """Within the region's first call (``dynamo_shapes.symbolic_batch``), the block's
        first capture too: a size 1 the region's trace kept exact stays exact (the batch of
        rotary embeddings, which broadcasts), the others are symbols."""
        if not fx_config.backed_size_oblivious or self.ones is None or self.symbolic is None:
            return contextlib.nullcontext()
        ones = self.ones
        tensors = [t for t in pytree.tree_leaves(values) if isinstance(t, torch.Tensor)]
        return self.symbolic(tensors, lambda i, t: ones[i] if i < len(ones) else set(
            range(t.dim())))

    def cached(self, block: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The call through the graph dynamo compiled for it, looked up as dynamo looks it up
        (see the module docstring); ``_MISS`` where dynamo must run it."""
        stance = getattr(eval_frame, "_stance", None)  # torch.compiler.set_stance
        if not self.lookup or stance is not None and (
                stance.stance != "default" or stance.backend is not None
                or stance.skip_guard_eval_unsafe):
            return _MISS
        entry = serving(self.run_block, call_frame(self.run_block, block, args, kwargs))
        if entry is UNCHECKED:  # not a guard tree this torch checks so: dynamo runs every call
            self.lookup = False
            return _MISS
        code = getattr(entry, "code", None)
        if not isinstance(code, types.CodeType):  # no entry serves, or invalidated meanwhile
            return _MISS
        fn = self.direct[code] if code in self.direct else self.direct.setdefault(
            code, self._function(code))
        return _MISS if fn is None else fn(block, *args, **kwargs)

    def _function(self, code: types.CodeType) -> Callable[..., Any] | None:
        """``code`` (a transformed code of ``run_block``) as a function, where it is plain
        (``_plain``)."""
        if not _plain(code) or code.co_freevars != self.run_block.__code__.co_freevars:
            return None
        return types.FunctionType(code, self.run_block.__globals__, code.co_name, None,
                                  self.run_block.__closure__)

    def _check(self, index: int, args: Any, kwargs: Any, out: Any) -> None:
        """Where the graph around the blocks took block ``index``'s output to be shaped as
        its twin's, check it: the same shapes out where the shapes in are the same."""
        seen = (_shapes((args, kwargs)), _shapes(out))
        self.ran[index] = seen
        twin = self.ran.get(self.twins.get(index, -1))
        if twin is None or twin[0] != seen[0]:
            return  # its model block has not run on inputs of these shapes (or it is one)
        self.unchecked.discard(index)
        if not self.unchecked & self.twins.keys():
            self.unchecked.clear()
        if twin[1] != seen[1]:
            raise DynamoError(
                f"fxprobe: blocks {self.twins[index]} and {index} of "
                f"{type(self.blocks[0]).__name__} return values of different shapes for "
                f"inputs of the same shapes ({twin[1]} and {seen[1]}), which the shared "
                "capture (the default, FXPROBE_DYNAMO_REGIONS=shared) took to be alike; set "
                "FXPROBE_DYNAMO_REGIONS=marked for this model.")


class _Hooked(RuntimeError):
    """A module hook set inside a shared block while dynamo traces the graph around it."""


def _meta(tree: Any) -> str:
    """What the output made on fake tensors depends on: the structure, and each tensor's
    shape, strides, dtype, device and whether it requires grad (other leaves as they are)."""
    leaves, spec = pytree.tree_flatten(tree)
    return repr(spec) + repr([
        (tuple(t.shape), t.stride(), t.dtype, t.device, t.requires_grad)
        if isinstance(t, torch.Tensor) else t for t in leaves])


def _shapes(tree: Any) -> tuple[Any, ...]:
    return tuple(tuple(t.shape) for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor))


_MODULE_OWN = frozenset(vars(nn.Module())) - {"training"}  # nn.Module's bookkeeping


def _places(blocks: list[nn.Module]) -> frozenset[tuple[str, str]]:
    """The integer attributes (module path, name) equal to the block's place in its list in
    every block (``layer_idx``), not those that only happen to equal it in one (block 16's
    ``head_dim`` of 16)."""
    found: set[tuple[str, str]] | None = None
    for i, block in enumerate(blocks):
        here = {(path, k) for path, m in block.named_modules() for k, v in vars(m).items()
                if type(v) is int and v == i}
        found = here if found is None else found & here
    return frozenset(found or ())


def _settings(block: nn.Module, places: frozenset[tuple[str, str]]) -> str:
    """What else a block's output may depend on: every other attribute of each of its modules
    (a convolution's ``stride``, a layer's ``sliding_window``), a number, string or tuple of
    them by value, any other object by identity (one config shared by every block is equal);
    not an integer that is every block's place (``places``, ``layer_idx``: every layer would
    differ, where it reads a cache the blocks are not shared; what it may still change is
    checked when the blocks run, ``Blocks._check``)."""

    def value(v: Any) -> Any:
        if v is None or isinstance(v, (bool, int, float, str, torch.dtype, torch.device)):
            return v
        if isinstance(v, (tuple, list)):
            return type(v).__name__, tuple(value(x) for x in v)
        return "id", id(v)

    return repr([(path, sorted((k, value(v)) for k, v in vars(m).items()
                               if k not in _MODULE_OWN and (path, k) not in places
                               and not getattr(v, _OVERRIDE, False)))  # fxprobe's forward
                 for path, m in block.named_modules()])


def names_stream(call: Any) -> None:
    """Say that the graph around the blocks names each block's call ``resid_post`` (``call``:
    one such call node)."""
    blocks = _LIVE.get(call.args[0])
    if blocks is not None:
        blocks.stream_out = True


def inner_names(blocks: Blocks | None, prefix: str, graph: Any, named: Any) -> Any:
    """``named`` without ``blocks.L.resid_post`` where it is a shared block's own graph and
    the graph around the blocks names the call with it (one name, one site)."""
    if blocks is None or not blocks.stream_out or prefix not in blocks.paths:
        return named
    changed: dict[int, Any] = {}
    for s in named.order:
        keep = tuple(c for c in s.canonical if not c.endswith(".resid_post"))
        if keep != s.canonical:
            changed[id(s)] = dataclasses.replace(s, canonical=keep)
    return named.with_sites(changed, graph) if changed else named
