"""Canonical names where blocks are unusual: attention through baddbmm, blocks run out of order or
several times, parallel blocks."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from canonical_support import DECODER, TOKENS, _close, tf
from torch import nn

import fxprobe


def _tap_all(model: nn.Module, **kw: Any) -> Any:
    tapped = fxprobe.tap(model, ops=fxprobe.where(lambda s: True), tracer="dynamo")
    with torch.no_grad():
        tapped(**kw)
    return tapped


def _names(tapped: Any) -> set[str]:
    return {c for s in tapped.sites for c in s.canonical}


def _ids() -> torch.Tensor:
    return torch.randint(2, 100, (2, 7), generator=torch.Generator().manual_seed(0))


BADDBMM = {
    "Bloom": lambda: (tf.BloomConfig(n_layer=3, hidden_size=32, n_head=4, **TOKENS),
                      tf.BloomForCausalLM),
    "GPT-2-reorder": lambda: (tf.GPT2Config(n_layer=3, n_embd=32, n_head=2, n_positions=64,
                                            reorder_and_upcast_attn=True, **TOKENS),
                              tf.GPT2LMHeadModel),
}


@pytest.mark.parametrize("family", list(BADDBMM))
def test_attention_through_baddbmm_is_each_blocks_own(family: str) -> None:
    """``baddbmm(input, q, k.T)`` computes the scores (Bloom, GPT-2 reordered): the kernel is
    the block's own (not the previous block's ``probs @ v`` taken for q: ``cross_attn``)."""
    def build() -> nn.Module:
        config, cls = BADDBMM[family]()
        config._attn_implementation = "eager"
        torch.manual_seed(0)
        return cls(config).eval()

    tapped = _tap_all(build(), input_ids=_ids(), use_cache=False)
    names = _names(tapped)
    assert not [n for n in names if "cross" in n]
    calls: list[tuple[torch.Tensor, torch.Tensor]] = []
    real_fn, real_method = torch.baddbmm, torch.Tensor.baddbmm

    def fn(inp: torch.Tensor, b1: torch.Tensor, b2: torch.Tensor, **kw: Any) -> torch.Tensor:
        calls.append((b1.clone(), b2.clone()))
        return real_fn(inp, b1, b2, **kw)

    def method(self: torch.Tensor, batch1: torch.Tensor, batch2: torch.Tensor,
               **kw: Any) -> torch.Tensor:
        calls.append((batch1.clone(), batch2.clone()))
        return real_method(self, batch1, batch2, **kw)

    mp = pytest.MonkeyPatch()
    try:
        mp.setattr(torch, "baddbmm", fn)
        mp.setattr(torch.Tensor, "baddbmm", method)
        with torch.no_grad():
            out = build()(input_ids=_ids(), use_cache=False, output_attentions=True,
                          output_hidden_states=True)
    finally:
        mp.undo()
    assert len(calls) == 3
    for L in range(3):
        for role in ("resid_pre", "attn.q", "attn.pattern", "resid_post"):
            assert f"blocks.{L}.{role}" in names
        _close("q", tapped.taps[f"blocks.{L}.attn.q"], calls[L][0])
        if f"blocks.{L}.attn.k" in names or family == "Bloom":  # GPT-2's k: (.., dim, pos)
            _close("k", tapped.taps[f"blocks.{L}.attn.k"], calls[L][1].transpose(-1, -2))
        _close("pattern", tapped.taps[f"blocks.{L}.attn.pattern"], out.attentions[L])
        _close("resid_pre", tapped.taps[f"blocks.{L}.resid_pre"], out.hidden_states[L])
        if L < 2:
            _close("resid_post", tapped.taps[f"blocks.{L}.resid_post"], out.hidden_states[L + 1])


class _Block(nn.Module):
    def __init__(self, d: int = 32, heads: int = 2) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.o = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.proj = nn.Linear(d, 64), nn.Linear(64, d)
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        q, k, v = (t.view(B, T, self.heads, D // self.heads).transpose(1, 2)
                   for t in self.qkv(self.ln_1(x)).split(D, -1))
        z = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(z.transpose(1, 2).reshape(B, T, D))
        return x + self.proj(F.gelu(self.fc(self.ln_2(x))))


class _Stack(nn.Module):
    def __init__(self, order: list[int], shared: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(100, 32)
        b = _Block()
        self.blocks = nn.ModuleList([b, b, b] if shared else [_Block() for _ in range(3)])
        self.ln_f, self.head = nn.LayerNorm(32), nn.Linear(32, 100, bias=False)
        self.order = order

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(input_ids)
        for i in self.order:
            x = self.blocks[i](x)
        return self.head(self.ln_f(x))


def test_blocks_run_out_of_index_order_name_the_final_norm_after_the_last_to_run() -> None:
    model = _Stack([2, 0, 1]).eval()
    tapped = _tap_all(model, input_ids=_ids())
    ref: dict[str, torch.Tensor] = {}
    for i, b in enumerate(model.blocks):
        b.register_forward_pre_hook(lambda m, a, i=i: ref.setdefault(f"blocks.{i}.resid_pre",
                                                                     a[0].clone()))
        b.register_forward_hook(lambda m, a, o, i=i: ref.setdefault(f"blocks.{i}.resid_post",
                                                                    o.clone()))
    model.ln_f.register_forward_hook(lambda m, a, o: ref.setdefault("ln_final", o.clone()))
    with torch.no_grad():
        logits = model(_ids())
    ref["logits"] = logits
    assert {"ln_final", "logits"} <= _names(tapped)
    for name in ref:
        assert name in _names(tapped), name
        _close(name, tapped.taps[name], ref[name])


def test_a_block_run_several_times_has_no_canonical_names() -> None:
    """One module run N times (``ModuleList([b, b, b])``, ALBERT's shared layer): the calls
    cannot be told apart by index, so no canonical names (rather than mixed calls)."""
    assert not _names(_tap_all(_Stack([0, 1, 2], shared=True).eval(), input_ids=_ids()))
    config = tf.AlbertConfig(num_hidden_layers=3, hidden_size=32, embedding_size=16,
                             num_attention_heads=2, intermediate_size=64, vocab_size=100,
                             max_position_embeddings=64)
    torch.manual_seed(0)
    assert not _names(_tap_all(tf.AlbertForMaskedLM(config).eval(), input_ids=_ids()))


PARALLEL = {  # x + attn(norm(x)) + mlp(norm(x)), as two adds
    "Cohere": lambda: (tf.CohereConfig(**DECODER, **TOKENS), tf.CohereForCausalLM),
    "StableLM": lambda: (tf.StableLmConfig(**DECODER, use_parallel_residual=True, **TOKENS),
                         tf.StableLmForCausalLM),
}


@pytest.mark.parametrize("family", list(PARALLEL))
def test_parallel_block_written_as_two_adds_has_no_resid_mid(family: str) -> None:
    def build() -> nn.Module:
        config, cls = PARALLEL[family]()
        config._attn_implementation = "sdpa"
        torch.manual_seed(0)
        return cls(config).eval()

    tapped = _tap_all(build(), input_ids=_ids(), use_cache=False)
    names = _names(tapped)
    assert not [n for n in names if "resid_mid" in n]
    model = build()
    ref: dict[str, torch.Tensor] = {}
    for L, layer in enumerate(model.model.layers):
        layer.self_attn.o_proj.register_forward_hook(
            lambda m, a, o, L=L: ref.setdefault(f"blocks.{L}.attn_out", o.clone()))
        layer.mlp.register_forward_hook(
            lambda m, a, o, L=L: ref.setdefault(f"blocks.{L}.mlp_out", o.clone()))
    with torch.no_grad():
        out = model(input_ids=_ids(), use_cache=False, output_hidden_states=True)
    ref.update({f"blocks.{L}.resid_pre": out.hidden_states[L] for L in range(2)})
    ref["blocks.0.resid_post"] = out.hidden_states[1]
    for name in ref:
        assert name in names, name
        _close(name, tapped.taps[name], ref[name])

