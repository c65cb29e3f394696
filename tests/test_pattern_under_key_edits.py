"""The pattern beside SDPA under an edit of the keys: the kernel reads the edited keys, so the
pattern (and the scores) fxprobe shows are the edited keys' too, whichever way the edit is
made (a per-call block on keys selected at ``tap()`` or not, ``fn=``) and wherever the keys'
cache keeps what the model computed. Keys edited to zero give every position the same score:
each row of the causal pattern is uniform, ``1 / (i + 1)``, computed here by hand; outside the
block the pattern is the model's own again (the eager model's ``output_attentions``)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

import fxprobe

tf = pytest.importorskip("transformers")

_IDS = torch.tensor([[5, 6, 7, 8, 9]])
_UNIFORM = torch.tril(torch.ones(5, 5)) / torch.arange(1, 6).unsqueeze(1)


def _model(family: str, attn: str = "sdpa") -> Any:
    torch.manual_seed(0)
    if family == "gpt2":
        config = tf.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=64)
        model = tf.GPT2LMHeadModel(config)
    else:
        config = tf.LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                                num_key_value_heads=2, intermediate_size=48, vocab_size=100)
        model = tf.LlamaForCausalLM(config)
    model.config._attn_implementation = attn
    return model.eval()


def _zero(site: Any, value: torch.Tensor) -> torch.Tensor | None:
    return value * 0 if "blocks.0.attn.k" in site.canonical else None


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("how", ["block, keys selected", "block", "fn"])
@torch.no_grad()
def test_the_pattern_is_the_edited_keys(family: str, how: str) -> None:
    model = _model(family)
    eager = _model(family, "eager")
    own = eager(input_ids=_IDS, output_attentions=True).attentions[0]
    torch._dynamo.reset()
    ops = ["blocks.0.attn.pattern", "blocks.0.attn.scores"] + (
        [] if how == "block" else ["blocks.0.attn.k"])  # fn= edits the sites it taps
    tapped = fxprobe.tap(copy.deepcopy(model), ops=ops, tracer="dynamo",
                         fn=_zero if how == "fn" else None)
    if how == "fn":
        tapped(input_ids=_IDS)
    else:
        tapped(input_ids=_IDS)
        torch.testing.assert_close(tapped.taps["blocks.0.attn.pattern"], own)
        with tapped.intervene({"blocks.0.attn.k": _zero}):
            tapped(input_ids=_IDS)
    pattern = tapped.taps["blocks.0.attn.pattern"]
    for head in range(pattern.shape[1]):
        torch.testing.assert_close(pattern[0, head], _UNIFORM, msg=f"head {head}")
    scores = tapped.taps["blocks.0.attn.scores"][0, 0]
    assert torch.all(scores[torch.tril(torch.ones(5, 5)).bool()] == 0)  # q . 0
    if how != "fn":  # and after the block, the model's own pattern again
        tapped(input_ids=_IDS)
        torch.testing.assert_close(tapped.taps["blocks.0.attn.pattern"], own)
