"""A graph dynamo captures for a frame fxprobe cannot place in the module tree (a function the
model calls with a module as an argument, split off by a graph break inside it) is named as
the region's own: fxprobe says so, once per code location, instead of handing out names
without a module path in silence. A decorated forward's frame (transformers'
``dynamic_rope_update``) is placed by the function the decorator wraps."""

from __future__ import annotations

import warnings

import pytest
import torch

import fxprobe

transformers = pytest.importorskip("transformers")


def _llama() -> torch.nn.Module:
    cfg = transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, vocab_size=256, max_position_embeddings=128,
        attn_implementation="sdpa")
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


def test_sdpa_with_output_attentions_warns_of_sites_without_a_module_path() -> None:
    model = _llama()
    ids = torch.randint(1, 256, (1, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids).logits
        rotary = {}

        def keep(m: torch.nn.Module, args: object, out: tuple[torch.Tensor, ...]) -> None:
            rotary["cos"] = out[0].clone()

        handle = model.model.rotary_emb.register_forward_hook(keep)
        model(ids)
        handle.remove()
        tapped = fxprobe.tap(model, ops="*", tracer="dynamo")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            # transformers warns (logger.warning_once) inside sdpa_attention_forward, and
            # dynamo breaks the graph there: the function runs as a frame of its own
            out = tapped(ids, output_attentions=True)
        said = [str(w.message) for w in caught if "no module path" in str(w.message)]
        assert len(said) == 1, said  # one location, said once: both layers call the function
        assert "sdpa_attention.py" in said[0] and "'attention_probs'" in said[0]
        torch.testing.assert_close(out.logits, want)
        assert "scaled_dot_product_attention" in tapped.taps  # named with no module path
        # the rotary embedding's decorated forward, also split off, keeps its module path
        # (its value is the cos the module returns, as a forward hook sees it)
        cos = [n for n in tapped.taps if n.startswith("model.rotary_emb.")
               and torch.equal(tapped.taps[n], rotary["cos"])]
        assert cos, sorted(n for n in tapped.taps if "rotary" in n)
