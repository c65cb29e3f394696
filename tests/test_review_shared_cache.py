"""Review of shared blocks with a KV cache (``FXPROBE_DYNAMO_REGIONS=shared``,
``frontends/dynamo_blocks_cache.py``): sequences of cached calls against the untapped model
(its logits, its cache after each call, greedy and beam ``generate``), with edits of the
keys and values a layer caches."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import transformers as tf
from canonical_support import DECODER, TOKENS
from torch import nn

import fxprobe
from fxprobe.frontends.dynamo_blocks import block_call
from fxprobe.frontends.dynamo_blocks_cache import KV


def _llama(layers: int = 2, **extra: Any) -> nn.Module:
    torch.manual_seed(0)
    return tf.LlamaForCausalLM(tf.LlamaConfig(
        **{**DECODER, "num_hidden_layers": layers}, **TOKENS, **extra)).eval()


def _tap(model: nn.Module, monkeypatch: pytest.MonkeyPatch, ops: Any = "blocks.*.resid_post",
         mode: str | None = "shared") -> Any:
    if mode is None:
        monkeypatch.delenv("FXPROBE_DYNAMO_REGIONS", raising=False)
    else:
        monkeypatch.setenv("FXPROBE_DYNAMO_REGIONS", mode)
    return fxprobe.tap(model, ops=ops, tracer="dynamo")


def _kv_calls(tapped: Any) -> list[int]:
    graphs = [c.gm.graph.find_nodes(op="call_function", target=block_call)
              for c in tapped._lifecycle().program.dynamo[""].captured]
    return [sum(KV in n.kwargs for n in calls) for calls in graphs if calls]


def _same_cache(a: Any, b: Any) -> None:
    assert len(a.layers) == len(b.layers)
    for i, (x, y) in enumerate(zip(a.layers, b.layers, strict=True)):
        assert x.is_initialized == y.is_initialized, i
        if x.is_initialized:
            torch.testing.assert_close(x.keys, y.keys, msg=f"keys {i}")
            torch.testing.assert_close(x.values, y.values, msg=f"values {i}")


def _ids(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randint(2, 100, shape, generator=torch.Generator().manual_seed(seed))


def test_beam_search(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _llama()
    tapped = _tap(model, monkeypatch)
    ids = _ids((2, 5), 2)
    with torch.no_grad():
        kw = dict(max_new_tokens=5, num_beams=2, do_sample=False, output_scores=True,
                  return_dict_in_generate=True)
        exp = model.generate(ids, **kw)
        got = tapped.generate(ids, **kw)
    assert torch.equal(got.sequences, exp.sequences)
    for a, b in zip(got.scores, exp.scores, strict=True):
        torch.testing.assert_close(a, b)
    assert any(_kv_calls(tapped))


def test_user_cache_reused_and_cropped(monkeypatch: pytest.MonkeyPatch) -> None:
    """A cache made by the user (from the config), reused over calls and cropped between
    them (as assisted generation does): logits and cache as the model's."""
    model = _llama()
    tapped = _tap(model, monkeypatch)
    mine, ref = tf.DynamicCache(config=model.config), tf.DynamicCache(config=model.config)
    steps = [_ids((1, 5), 4), _ids((1, 1), 5), _ids((1, 3), 6), "crop", _ids((1, 1), 7),
             _ids((1, 2), 8), "crop", _ids((1, 1), 9)]
    with torch.no_grad():
        for i, s in enumerate(steps):
            if isinstance(s, str):
                mine.crop(-2)
                ref.crop(-2)
                continue
            out = tapped(input_ids=s, cache=mine)
            exp = model(input_ids=s, cache=ref)
            torch.testing.assert_close(out.logits, exp.logits, msg=f"step {i}")
            _same_cache(mine, ref)
    assert any(_kv_calls(tapped))


def _half(_site: Any, v: torch.Tensor) -> torch.Tensor:
    return v * 0.5


def _halving_kernel(which: str) -> str:
    """An attention implementation that halves layer 1's keys (``k``) or values (``v``) as
    the kernel reads them (the edit written inside the eager kernel)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def kernel(module: nn.Module, q: Any, k: Any, v: Any, *args: Any, **kwargs: Any) -> Any:
        if module.layer_idx == 1:
            k, v = (k * 0.5, v) if which == "k" else (k, v * 0.5)
        return sdpa_attention_forward(module, q, k, v, *args, **kwargs)

    name = f"review_half_{which}"
    tf.AttentionInterface.register(name, kernel)
    return name


@pytest.mark.parametrize("which", ["k", "v"])
def test_edit_of_keys_or_values_as_inside_the_kernel(monkeypatch: pytest.MonkeyPatch,
                                                     which: str) -> None:
    """Halving layer 1's keys (values) on the prompt and on a step: as the same edit inside
    the eager kernel, logits and cache (which keeps what the model computed) alike, and a
    step after them reads the cache as the model does."""
    model = _llama()
    edited = copy.deepcopy(model)
    edited.config._attn_implementation = _halving_kernel(which)
    tapped = _tap(model, monkeypatch, ops=fxprobe.where(lambda s: True))
    calls = [_ids((1, 5), 11), _ids((1, 1), 12), _ids((1, 1), 13)]
    cache = ref = None
    with torch.no_grad():
        for i, ids in enumerate(calls):
            if i < 2:
                exp = edited(input_ids=ids, cache=ref)
                with tapped.intervene({f"blocks.1.attn.{which}": _half}):
                    out = tapped(input_ids=ids, cache=cache)
            else:
                exp = model(input_ids=ids, cache=ref)
                out = tapped(input_ids=ids, cache=cache)
            cache, ref = out.past_key_values, exp.past_key_values
            torch.testing.assert_close(out.logits, exp.logits, msg=f"call {i}")
            _same_cache(cache, ref)
    assert any(_kv_calls(tapped))


class _PreNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln, self.lin = nn.LayerNorm(8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.lin(self.ln(x))


class _PostNorm(_PreNorm):  # the same modules, another forward
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ln(x + self.lin(x))


class _TwoStacks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.config = tf.PretrainedConfig(use_cache=False)
        self.enc = nn.ModuleList([_PreNorm(), _PreNorm()])
        self.dec = nn.ModuleList([_PostNorm(), _PostNorm()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in [*self.enc, *self.dec]:
            x = block(x)
        return x


def test_two_stacks_of_two_classes_each_run_their_own_forward(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An encoder's and a decoder's layers (two classes): each runs its own forward (shared,
    every block ran the first block's class's forward)."""
    torch.manual_seed(0)
    model = _TwoStacks().eval()
    tapped = _tap(model, monkeypatch, ops=fxprobe.where(lambda s: True))
    for n in (3, 5):
        x = torch.randn(2, n, 8)
        with torch.no_grad():
            torch.testing.assert_close(tapped(x), model(x))


def test_encoder_decoder_generate(monkeypatch: pytest.MonkeyPatch) -> None:
    """FSMT: encoder and decoder layers of two classes (shared, the decoder's layers ran the
    encoder layer's forward: a TypeError in generate)."""
    torch.manual_seed(0)
    model = tf.FSMTForConditionalGeneration(tf.FSMTConfig(
        langs=["en", "de"], src_vocab_size=100, tgt_vocab_size=100, d_model=32,
        encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
        max_position_embeddings=64, pad_token_id=1, bos_token_id=0, eos_token_id=2,
        decoder_start_token_id=2)).eval()
    tapped = _tap(model, monkeypatch, ops="decoder.blocks.*.resid_post")
    ids = _ids((2, 6), 50)
    with torch.no_grad():
        kw = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False, num_beams=1)
        assert torch.equal(tapped.generate(ids, **kw), model.generate(ids, **kw))
