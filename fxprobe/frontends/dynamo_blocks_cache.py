"""Shared blocks (``dynamo_blocks``) for a call with a key/value cache.

A decoder layer updates the model's cache as a side effect (``cache.update(k, v,
self.layer_idx)`` in its attention), and the cache is a Python object, which an op of the
graph (``allow_in_graph``) cannot take. By default (``FXPROBE_DYNAMO_REGIONS=shared``), for a call
that carries a cache (``dynamo_inline.carries_cache``), each block's forward on fxprobe's copy
is a plain function (:func:`_layer_forward`) dynamo traces in the graph around the blocks: it
reads the block's entry of a transformers ``DynamicCache`` (``cache.layers[i]``, exactly a
``DynamicLayer``), calls the block as one op (:func:`~.dynamo_blocks.block_call`) with that
entry's keys and values (``None`` before its first update) instead of the cache, reads the
entry's new keys and values from a second op (:func:`block_kv`, no site), and writes them
back into the entry (dynamo replays the writes after the graph)::

    layer = cache.layers[i]
    out = block_call(key, i, x, ..., fxprobe_kv=("cache", layer.keys, layer.values))
    keys, values = block_kv(key, i, out)
    layer.keys, layer.values, layer.is_initialized = keys, values, True

Inside the op, the block's forward (:class:`KVBlocks`, compiled once for every block) gets a
stand-in cache whose ``update`` runs ``DynamicLayer.update`` on a private ``DynamicLayer``
holding those keys and values: the same ops as the real update, traced once for all layers.
Any other cache (a sliding-window layer, ``StaticCache``, ``EncoderDecoderCache``, an
offloading cache, a ``DynamicCache`` subclass) or a block whose ``layer_idx`` is not its place
in the list is traced in place, layer by layer, as the whole capture does (the block's own
forward, called from the same function).
"""

from __future__ import annotations

import functools
import inspect
import operator
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from ..capture.inplace import OUT_OF_PLACE
from ..core.errors import DynamoError
from . import dynamo_inline
from .dynamo_blocks import _LIVE, Blocks, block_call
from .mirror import _OVERRIDE  # the mark of a forward fxprobe installed on its copy

KV = "fxprobe_kv"
"""The keyword under which a block's op receives its cache entry: (the cache's keyword in the
block's forward, or its place among the positional arguments; keys; values)."""

OWN_FILE = __file__
"""This file, whose frames in a node's stack trace are fxprobe's, not the model's code."""

CACHE_ARGS = ("cache", "past_key_values", "past_key_value", "layer_past")
"""The keywords a transformers layer takes its cache by (5.x: ``cache``; earlier names)."""


@torch._dynamo.allow_in_graph
def block_kv(key: int, index: int, out: Any) -> Any:
    """The keys and values block ``index`` of the :class:`KVBlocks` numbered ``key`` left in
    its cache entry when it returned ``out`` (read after it: ``out`` orders the two ops)."""
    return _LIVE[key].kv_out(index)  # type: ignore[attr-defined]


# It reads the stash, never ``out`` (for the in-place analysis: no write into what the block
# returned, so the stream after a block that returns a tuple, Bloom's, is the block's output).
setattr(block_kv, OUT_OF_PLACE, True)


def reads_kv(node: Any) -> bool:
    """Whether a graph node is :func:`block_kv` or a part of its result: fxprobe's own
    plumbing, no op of the model's (no site)."""
    if node.op != "call_function":
        return False
    if node.target is block_kv:
        return True
    return node.target is operator.getitem and getattr(node.args[0], "target", None) is block_kv


class _Update:
    """``update`` as transformers' ``Cache.update`` does it for one ``DynamicLayer`` (the
    layer's own code, on a private copy of its state), counting the calls."""

    layer: Any
    updates: int

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args: Any, **kwargs: Any) -> Any:
        self.updates += 1
        return self.layer.update(key_states, value_states, *args, **kwargs)


@functools.cache
def _cache_types() -> tuple[type, type, type] | None:
    """transformers' ``DynamicCache`` and ``DynamicLayer``, and the stand-in cache a shared
    block sees: a ``DynamicCache`` (a layer testing ``isinstance(cache, ...)`` takes the path
    it takes with the real one) holding nothing but its one entry, so that any other method a
    layer calls fails while dynamo traces (the call then runs unshared: run_marked)."""
    try:
        from transformers.cache_utils import DynamicCache, DynamicLayer
    except ImportError:  # no transformers: no cache this module knows
        return None

    class StandIn(_Update, DynamicCache):  # type: ignore[misc,valid-type]
        def __init__(self, layer: Any) -> None:  # not DynamicCache's: no layers
            self.layer = layer
            self.updates = 0

    return DynamicCache, DynamicLayer, StandIn


class KVBlocks(Blocks):
    """The blocks of a :class:`~.dynamo_blocks.Blocks` called with their cache entry: the
    block's forward with a stand-in cache, returning what it returns and the entry's new keys
    and values, compiled once for every block."""

    def __init__(self, base: Blocks, backend: Callable[..., Any],
                 module_ids: dict[int, str]) -> None:
        super().__init__(base.blocks, backend, module_ids)
        self.base = base
        types = _cache_types()
        self.types = types
        forward = base.forward
        _, layer_type, stand_in = types if types is not None else (None, None, None)

        def kv_forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
            where, keys, values = kwargs.pop(KV)
            layer = layer_type()  # type: ignore[misc]
            if keys is not None:  # the real entry's state (DynamicLayer.lazy_initialization)
                layer.keys, layer.values = keys, values
                layer.is_initialized, layer.device = True, keys.device
            cache = stand_in(layer)  # type: ignore[misc]
            if isinstance(where, int):  # passed by position (GPT-2's blocks)
                out = forward(module, *args[:where], cache, *args[where + 1:], **kwargs)
            else:
                out = forward(module, *args, **{where: cache}, **kwargs)
            return out, layer.keys, layer.values, cache.updates

        def run_block(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
            return kv_forward(module, *args, **kwargs)

        run_block.__code__ = run_block.__code__.replace(
            co_name=f"fxprobe_block_kv_{type(self.blocks[0]).__name__}")
        self.forward = kv_forward
        self.compiled = torch.compile(run_block, backend=backend, dynamic=True)
        self.run_block = run_block  # the code whose entries Blocks.cached looks up
        self._kv = threading.local()  # block -> its new keys and values, until read
        # The entry is found by the block's place: only where every layer_idx below it says so.
        self.forwards = [(block, _layer_forward(self, i, block, types is not None
                                                and _indices(block) == {i}))
                         for i, block in enumerate(self.blocks)]

    @property  # type: ignore[override]
    def stream_out(self) -> bool:
        return self.base.stream_out

    @stream_out.setter
    def stream_out(self, value: bool) -> None:
        if hasattr(self, "base"):  # set by Blocks.__init__ before base is
            self.base.stream_out = value

    def run(self, index: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        out, keys, values, updates = super().run(index, args, kwargs)
        if updates != 1 or keys is None:
            raise DynamoError(
                f"fxprobe: block {index} of {type(self.blocks[0]).__name__} updated its "
                f"key/value cache {updates} times in one call, where the shared capture "
                "(the default, FXPROBE_DYNAMO_REGIONS=shared) expects once; set "
                "FXPROBE_DYNAMO_REGIONS=marked for this model.")
        self._stash()[index] = (keys, values)
        return out

    def _stash(self) -> dict[int, tuple[Any, Any]]:
        stash = getattr(self._kv, "stash", None)
        if stash is None:  # per thread: two threads' forwards never read each other's
            stash = self._kv.stash = {}
        return stash

    def kv_out(self, index: int) -> tuple[Any, ...]:
        keys, values = self._stash()[index]
        if isinstance(keys, FakeTensor):  # while dynamo traces: values of their own
            return tuple(torch.empty_strided(t.shape, t.stride(), dtype=t.dtype,
                                             device=t.device) for t in (keys, values))
        del self._stash()[index]  # running: the cache holds them now
        return keys, values


def _indices(block: nn.Module) -> set[int]:
    """The ``layer_idx`` of every module of a block (the index its attention updates)."""
    return {v for m in block.modules() for k, v in vars(m).items()
            if k == "layer_idx" and type(v) is int}


def _layer_forward(blocks: KVBlocks, index: int, block: nn.Module, handled: bool) -> Any:
    """The forward installed on block ``index`` for a call with a cache (traced by dynamo)."""
    forward = type(block).forward
    plain, key = blocks.base.key, blocks.key
    types = blocks.types
    place = _cache_place(forward)

    # Traced by dynamo once per block in each capture: no nested function (a generator, a
    # comprehension), each of which dynamo sets up a frame for.
    def call(*args: Any, **kwargs: Any) -> Any:
        where: str | int | None = None
        cache = None
        for name in CACHE_ARGS:
            if kwargs.get(name) is not None:
                where, cache = name, kwargs[name]
                break
        if where is None and place is not None and len(args) > place:
            where, cache = place, args[place]
        layer = _entry(cache, index, types) if cache is not None and handled else None
        if layer is None:
            if cache is None and not any(_is_cache(a, types) for a in args):
                return block_call(plain, index, *args, **kwargs)  # no cache: as without one
            return forward(block, *args, **kwargs)  # a cache not handled: traced in place
        init = layer.is_initialized
        if isinstance(where, int):
            args = (*args[:where], None, *args[where + 1:])
        elif where is not None:  # always, here: the entry's cache was given by keyword
            kwargs = {**kwargs}  # (dict(kwargs): dynamo runs a Python polyfill)
            del kwargs[where]
        kwargs[KV] = (where, layer.keys if init else None, layer.values if init else None)
        out = block_call(key, index, *args, **kwargs)
        keys, values = block_kv(key, index, out)
        if not init:
            layer.device = keys.device
        layer.keys, layer.values, layer.is_initialized = keys, values, True
        return out

    fn = functools.partial(call)
    setattr(fn, _OVERRIDE, True)  # not a forward the user replaced (frontends.mirror)
    return fn


def _cache_place(forward: Callable[..., Any]) -> int | None:
    """Where the forward takes its cache by position (after ``self``), if it can."""
    try:
        params = list(inspect.signature(forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return None
    for i, p in enumerate(params):
        if p.name in CACHE_ARGS:
            ok = p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and i > 0
            return i if ok else None
    return None


@functools.cache
def _cache_base() -> type | None:
    """transformers' ``Cache`` (every cache's base), imported once; None without it."""
    try:
        from transformers.cache_utils import Cache
    except ImportError:
        return None
    return Cache


def _is_cache(value: Any, types: tuple[type, type, type] | None) -> bool:
    base = _cache_base() if types is not None else None
    return base is not None and isinstance(value, base)


def _entry(cache: Any, index: int, types: tuple[type, type, type] | None) -> Any:
    """The cache entry of block ``index`` where it is one this module handles, else None."""
    if types is None:
        return None
    cache_type, layer_type, _ = types
    kind: type = type(cache)  # not narrowed: the cache's attributes are transformers'
    if kind is not cache_type or cache.offloading:
        return None
    replicate = cache.layer_class_to_replicate
    if replicate is not None:
        if replicate is not layer_type:
            return None
        while len(cache.layers) <= index:  # as Cache.update appends them
            cache.layers.append(layer_type())
    if len(cache.layers) <= index:
        return None
    layer = cache.layers[index]
    return layer if type(layer) is layer_type else None


def marks(region: Any, kwargs: dict[str, Any]) -> list[tuple[nn.Module, Any]]:
    """The forwards a ``DynamoRegion`` installs on its blocks for a call: shared, with the
    cache's own where the call carries one (for a model with a ``config``: a module of the
    user's own may keep other state); marked, where it carries none; else none."""
    if not dynamo_inline.carries_cache(region.module, kwargs):  # looked up at each call
        return region.shared.forwards if region.shared is not None else region.blocks
    if region.shared_kv is not None and getattr(region.module, "config", None) is not None:
        return region.shared_kv.forwards  # type: ignore[no-any-return]
    return []
