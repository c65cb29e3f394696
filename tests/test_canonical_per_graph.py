"""One canonical name, another site in another graph of the same code: with a KV cache,
``blocks.L.attn.k``/``.v`` are the keys and values the kernel reads (the cache concatenated
with this step's), without one the layer's own. Each forward reads and edits the site its own
graph gave the name, however many graphs of the other kind ran before (``tapped.taps``,
``run_with_cache``, ``intervene``); the reference is a tapped copy that never ran the other
graph, and the cache the model returns."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers as tf

import fxprobe

_IDS = torch.tensor([[5, 17, 3, 42, 8, 11]])
_NEXT = torch.tensor([[23]])


def _llama() -> tf.LlamaForCausalLM:
    torch.manual_seed(0)
    config = tf.LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            max_position_embeddings=64)
    return tf.LlamaForCausalLM(config).eval()


def _fresh(model: torch.nn.Module, **call: object) -> dict[str, torch.Tensor]:
    """The keys and values of block 0 from a tapped copy that ran only ``call``."""
    torch._dynamo.reset()
    tapped = fxprobe.tap(copy.deepcopy(model), ops="blocks.0.attn.[kv]", tracer="dynamo")
    tapped(**call)
    return {n: tapped.taps[n].clone() for n in ("blocks.0.attn.k", "blocks.0.attn.v")}


@pytest.mark.parametrize("tracer", ["auto"])  # the default; dynamo runs the same graphs
@torch.no_grad()
def test_taps_and_caches_read_the_site_each_graph_names(tracer: str) -> None:
    model = _llama()
    plain = _fresh(model, input_ids=_IDS, use_cache=False)
    torch._dynamo.reset()
    tapped = fxprobe.tap(model, ops="blocks.0.attn.[kv]", tracer=tracer)
    tapped(input_ids=_IDS, use_cache=False)
    tapped.generate(_IDS, max_new_tokens=3, do_sample=False)
    first = tapped(input_ids=_IDS, use_cache=True)
    past = first.past_key_values
    step = tapped(input_ids=_NEXT, past_key_values=past)
    # With a cache: what the kernel reads, the whole cache after this step.
    torch.testing.assert_close(tapped.taps["blocks.0.attn.k"], past.layers[0].keys)
    torch.testing.assert_close(tapped.taps["blocks.0.attn.v"], past.layers[0].values)
    assert "blocks.0.attn.k" in tapped.taps
    assert step.logits.shape == (1, 1, 100)
    # Without one, after both kinds ran: the layer's own keys and values, as never cached.
    tapped(input_ids=_IDS, use_cache=False)
    for name, want in plain.items():
        torch.testing.assert_close(tapped.taps[name], want, msg=name)
    _, cache = tapped.run_with_cache(input_ids=_IDS, use_cache=False, names="blocks.0.attn.*")
    for name, want in plain.items():
        torch.testing.assert_close(cache[name], want, msg=name)
    # And a cache of a cached step: the concatenated keys, not the step's own.
    again = tapped(input_ids=_IDS, use_cache=True).past_key_values
    _, cache = tapped.run_with_cache(input_ids=_NEXT, past_key_values=again,
                                     names="blocks.0.attn.k")
    torch.testing.assert_close(cache["blocks.0.attn.k"], again.layers[0].keys)
