"""fxprobe keeps only the selected values: the tensor storages reachable from a tapped module
(and from a cache ``run_with_cache`` returns), other than the model's own parameters and
buffers, add up to the bytes of the selected values, computed by hand from their shapes.

Reachable means reachable through Python references (``gc.get_referents``) from the tapped
module: its recording, its programs, the graphs dynamo handed it, the pipeline; modules,
classes and module globals are not followed (they are not the tapped module's). Fake tensors
(dynamo's example values in node meta) hold no memory and are not counted, nor are the
constants of a captured graph (attributes of its ``GraphModule``: a few bytes of code, the
same at every input size), nor dynamo's record of a graph input (``GraphArg`` in node meta,
which the graphs' copies keep: where dynamo made a Python number attribute of a module, such
as an attention's ``scaling``, a graph input, it holds that number as a 0-d tensor)."""

from __future__ import annotations

import gc
import sys
import types

import pytest
import torch
from torch import nn
from torch._dynamo.variables.builder import GraphArg
from torch._subclasses.fake_tensor import FakeTensor

import fxprobe

tf = pytest.importorskip("transformers")

LAYERS, HIDDEN, BATCH, SEQ = 3, 16, 2, 12
SELECTED = LAYERS * BATCH * SEQ * HIDDEN * 4  # float32 (batch, seq, hidden) per layer


def _model() -> nn.Module:
    torch.manual_seed(0)
    return tf.LlamaForCausalLM(tf.LlamaConfig(
        num_hidden_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=2,
        num_key_value_heads=1, intermediate_size=32, vocab_size=100,
        max_position_embeddings=64)).eval()


def kept_bytes(root: object, model: nn.Module) -> dict[int, tuple[int, tuple[int, ...]]]:
    """The storages reachable from ``root`` that are not ``model``'s parameters or buffers:
    {data pointer: (bytes, shape of a tensor viewing it)}."""
    own = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    globals_ = {id(vars(m)) for m in list(sys.modules.values()) if m is not None}
    seen: set[int] = set()
    stack = [root]
    out: dict[int, tuple[int, tuple[int, ...]]] = {}
    constants: set[int] = set()
    while stack:
        o = stack.pop()
        if id(o) in seen:
            continue
        seen.add(id(o))
        if isinstance(o, torch.Tensor):
            if not isinstance(o, FakeTensor) and o.device.type != "meta":
                st = o.untyped_storage()
                if st.nbytes() and st.data_ptr() not in own:
                    out[st.data_ptr()] = (st.nbytes(), tuple(o.shape))
            continue
        if isinstance(o, (types.ModuleType, type, types.FrameType, GraphArg)) or (
                id(o) in globals_):
            continue
        if isinstance(o, torch.fx.GraphModule):  # a captured graph's constants are code
            constants.update(t.untyped_storage().data_ptr() for t in (
                *vars(o).values(), *o.buffers(), *o.parameters())
                if isinstance(t, torch.Tensor) and not isinstance(t, FakeTensor))
        stack.extend(gc.get_referents(o))
    return {ptr: v for ptr, v in out.items() if ptr not in constants}


def _total(kept: dict[int, tuple[int, tuple[int, ...]]]) -> int:
    return sum(b for b, _ in kept.values())


def test_tap_and_run_with_cache_keep_the_selected_bytes_and_no_more_across_calls(young_gc):
    model = _model()
    tapped = fxprobe.tap(model, ops="blocks.*.resid_post", tracer="dynamo")
    ids = torch.randint(1, 100, (BATCH, SEQ))
    with torch.no_grad():
        for x in (ids, ids.flip(1), ids):  # a second and third call: nothing accumulates
            out = tapped(x, use_cache=False)
            del out
            gc.collect()
            kept = kept_bytes(tapped, model)
            assert _total(kept) == SELECTED, sorted(kept.values())
            assert all(shape == (BATCH, SEQ, HIDDEN) for _, shape in kept.values())
        for _ in range(2):  # per-call caches: the cache holds its values, the tapped module
            # what tap() selected (this call's), nothing else
            out, cache = tapped.run_with_cache(ids, names="blocks.*.resid_mid", use_cache=False)
            del out
            gc.collect()
            in_cache = kept_bytes(cache, model)
            assert _total(in_cache) == SELECTED, sorted(in_cache.values())
            kept = kept_bytes(tapped, model)
            assert _total(kept) == SELECTED, sorted(kept.values())
            assert not set(kept) & set(in_cache)
            del cache
