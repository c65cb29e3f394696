"""Shared blocks (``frontends/dynamo_blocks.py``) capture a block's code with dynamic sizes
from its first call: a first sequence length equal to the heads' dimension (8 here, the last
dim of RoPE's cos) must not fix the length, so a new length or batch runs the graphs already
captured, with the values of forward hooks that clone on an untapped copy; and the layers' own
graph is not reported as a graph break (``DynamoInfo.breaks``)."""

from __future__ import annotations

import copy

import pytest
import torch
from reference import hooked
from torch import nn

import fxprobe

transformers = pytest.importorskip("transformers")


def _llama() -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(  # head_dim 32 / 4 = 8
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=100, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(cfg).eval()


def _hooked(model: nn.Module, x: torch.Tensor, **kwargs: object) -> list[torch.Tensor]:
    """Each layer's output, then the logits, by hooks that clone on an untapped copy."""
    ref = copy.deepcopy(model)
    paths = [f"model.layers.{i}" for i in range(len(ref.model.layers))]
    with torch.no_grad():
        out, kept = hooked(ref, lambda: ref(x, **kwargs), keep=tuple(paths))
    return [*(kept[p][0] for p in paths), out.logits]


@pytest.mark.parametrize("use_cache", [False, True])
def test_a_first_length_equal_to_the_head_dim_captures_nothing_new_later(
        monkeypatch: pytest.MonkeyPatch, use_cache: bool) -> None:
    monkeypatch.setenv("FXPROBE_DYNAMO_REGIONS", "shared")
    model = _llama()
    tapped = fxprobe.tap(model, ops=["blocks.*.resid_post", "logits"], tracer="dynamo")
    graphs = None
    for i, shape in enumerate([(2, 8), (3, 11), (2, 5), (2, 8)]):
        x = torch.randint(0, 100, shape, generator=torch.Generator().manual_seed(i))
        with torch.no_grad():
            out = tapped(x, use_cache=use_cache)
        *layers, logits = _hooked(model, x, use_cache=use_cache)
        assert torch.equal(out.logits, logits), shape
        assert torch.equal(tapped.taps["logits"], logits), shape
        for n, value in enumerate(layers):
            assert torch.equal(tapped.taps[f"blocks.{n}.resid_post"], value), (shape, n)
        (info,) = tapped.dynamo_info
        graphs = info.graphs if graphs is None else graphs
        assert info.graphs == graphs, (shape, info)  # the first capture serves every shape
        assert info.breaks == 0, info  # the layers' own graph is no graph break
