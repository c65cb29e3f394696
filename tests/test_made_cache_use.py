"""Whether a call gets the cache its model would make (``frontends/dynamo_kv.py``) follows
what the model's code does with ``use_cache``: a ``use_cache`` the call gives through
``**kwargs`` (a ``...ForCausalLM`` without the parameter), and an outer forward that changes
it (or hands on another flag) before it hands the cache to the decoder. Against the untapped
model: the output, and the cache returned (None where the model returns none)."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import transformers as tf
from canonical_support import DECODER, TOKENS
from torch import nn
from transformers.modeling_outputs import CausalLMOutputWithPast

import fxprobe


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(2, 100, (1, n), generator=torch.Generator().manual_seed(seed))


def _cache_like(out: Any, ref: Any) -> None:
    assert (out is None) == (ref is None), f"cache {type(out).__name__}, model's {ref!r:.40}"
    if ref is not None:
        assert out.get_seq_length() == ref.get_seq_length()
        for x, y in zip(out.layers, ref.layers, strict=True):
            torch.testing.assert_close(x.keys, y.keys)


class LabelsStopTheCache(tf.LlamaForCausalLM):
    """As GIT's ``...ForCausalLM``: given labels, it asks its decoder for no cache."""

    def forward(self, input_ids: Any = None, cache: Any = None, use_cache: Any = None,
                labels: Any = None, **kwargs: Any) -> Any:
        if labels is not None:
            use_cache = False
        out = self.model(input_ids=input_ids, cache=cache, use_cache=use_cache)
        return CausalLMOutputWithPast(logits=self.lm_head(out.last_hidden_state),
                                      cache=out.cache)


class StreamingFlag(tf.LlamaForCausalLM):
    """As Mimi's encoder: its own flag, not ``use_cache``, says whether the decoder caches."""

    def forward(self, input_ids: Any = None, cache: Any = None, streaming: bool = False,
                **kwargs: Any) -> Any:
        out = self.model(input_ids=input_ids, cache=cache, use_cache=streaming)
        return CausalLMOutputWithPast(logits=self.lm_head(out.last_hidden_state),
                                      cache=out.cache)


def _make(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "granitemoe":
        return tf.GraniteMoeForCausalLM(tf.GraniteMoeConfig(
            **DECODER, **TOKENS, num_local_experts=2, num_experts_per_tok=1)).eval()
    cls = {"labels": LabelsStopTheCache, "streaming": StreamingFlag}[kind]
    return cls(tf.LlamaConfig(**DECODER, **TOKENS)).eval()


CALLS = {  # kind: calls (keyword arguments besides the ids), each after a plain first call
    "granitemoe": [{"use_cache": False}, {}, {"use_cache": False}],
    "labels": [{"labels": "ids"}, {}, {"labels": "ids"}],
    "streaming": [{"streaming": True}, {}, {"streaming": True}],
}


@pytest.mark.parametrize("mode", ["marked", None])
@pytest.mark.parametrize("kind", sorted(CALLS))
def test_the_cache_returned_is_the_models(kind: str, mode: str | None,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    if mode is None:
        monkeypatch.delenv("FXPROBE_DYNAMO_REGIONS", raising=False)
    else:
        monkeypatch.setenv("FXPROBE_DYNAMO_REGIONS", mode)
    model, twin = _make(kind), _make(kind)
    tapped = fxprobe.tap(model, ops="blocks.*.resid_post", tracer="dynamo")
    assert os.environ.get("FXPROBE_DYNAMO_REGIONS") == mode
    for i, extra in enumerate([{}, *CALLS[kind]]):
        ids = _ids(5 + i % 2, i)
        kwargs = {k: ids if v == "ids" else v for k, v in extra.items()}
        with torch.no_grad():
            ref, out = twin(ids, **kwargs), tapped(ids, **kwargs)
        torch.testing.assert_close(out.logits, ref.logits)
        _cache_like(out.cache, ref.cache)

