"""What test_canonical_blocks, test_canonical and test_canonical_layouts share."""

from __future__ import annotations

from typing import Any

import pytest
import torch

tf = pytest.importorskip("transformers")


TOKENS = dict(vocab_size=100, bos_token_id=0, eos_token_id=0, pad_token_id=0)


DECODER = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=2,
               num_key_value_heads=1, intermediate_size=64, max_position_embeddings=64)


def _close(name: str, ours: torch.Tensor, ref: torch.Tensor) -> None:
    if name.endswith((".k", ".v")) and ours.dim() == 4 and ours.shape[1] != ref.shape[1]:
        ours = ours.repeat_interleave(ref.shape[1] // ours.shape[1], dim=1)  # the kernel's
    if ours.shape != ref.shape:
        assert ours.numel() == ref.numel(), f"{name}: {tuple(ours.shape)} vs {tuple(ref.shape)}"
        ours = ours.reshape(ref.shape)
    if name.endswith(".scores"):  # masked entries: -inf beside SDPA, the dtype's min in eager
        keep = ref > torch.finfo(ref.dtype).min / 2
        ours, ref = ours[keep], ref[keep]
    torch.testing.assert_close(ours, ref, atol=2e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")


def _heads(config: Any) -> tuple[int, int, int]:
    """(heads, key/value heads, head dim) as the config declares them."""
    heads = getattr(config, "num_heads", None) if isinstance(config, tf.T5Config) else None
    heads = heads or config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    if isinstance(config, tf.FalconConfig) and not config.new_decoder_architecture:
        kv = 1 if config.multi_query else heads
    dim = getattr(config, "head_dim", None) or getattr(config, "d_kv", None) or \
        config.hidden_size // heads
    return heads, kv, dim


_GPT2_ROLES = {"embed", "pos_embed", "resid_pre", "attn.q", "attn.k", "attn.v", "attn.scores",
               "attn.pattern", "attn.z", "attn_out", "resid_mid", "mlp.pre", "mlp.post",
               "mlp_out", "resid_post", "ln_final", "logits"}
ROLES = {"Bloom": _GPT2_ROLES - {"pos_embed"}, "GPT-2-reorder": _GPT2_ROLES,
         "Falcon-alibi": _GPT2_ROLES - {"pos_embed", "resid_mid"},
         "Cohere": _GPT2_ROLES - {"pos_embed", "resid_mid"},
         "Granite": _GPT2_ROLES - {"pos_embed"}}


def check_documented_shapes(family: str, model: Any, tapped: Any, kw: dict[str, Any]) -> None:
    """Every canonical value of ``tapped`` (after a forward on ``kw``) has the shape
    docs/transformers.md gives its role; the families of ``ROLES`` have exactly those roles."""
    heads, kv, dim = _heads(model.config)
    width = model.config.hidden_size if not isinstance(model.config, tf.T5Config) \
        else model.config.d_model
    batch = kw["input_ids"].shape[0]
    found = {c for s in tapped.sites for c in s.canonical}
    assert any(".attn.q" in n for n in found) and any(".attn.z" in n for n in found)
    for name in sorted(found):
        value = tapped.taps[name]
        role = name.split(".", 2)[-1] if ".blocks." in f".{name}" else name
        role = role.split(".", 1)[1] if role[:1].isdigit() else role
        t = (kw["decoder_input_ids"] if name.startswith("decoder.") or name == "logits"
             and "decoder_input_ids" in kw else kw["input_ids"]).shape[1]
        src = kw["input_ids"].shape[1] if role.startswith("cross_attn.") else t
        expected = {
            "attn.q": (batch, heads, t, dim), "attn.k": (batch, kv, t, dim),
            "attn.v": (batch, kv, t, dim), "attn.scores": (batch, heads, t, t),
            "attn.pattern": (batch, heads, t, t), "attn.z": (batch, t, heads, dim),
            "cross_attn.q": (batch, heads, t, dim), "cross_attn.k": (batch, heads, src, dim),
            "cross_attn.v": (batch, heads, src, dim),
            "cross_attn.scores": (batch, heads, t, src),
            "cross_attn.pattern": (batch, heads, t, src),
            "cross_attn.z": (batch, t, heads, dim), "logits": (batch, t, 100),
        }.get(role)
        if role in ("mlp.pre", "mlp.post"):
            expected = (*((batch * t,) if family == "OPT" else (batch, t)), value.shape[-1])
        elif role == "pos_embed":
            expected = ((1 if family in ("GPT-2", "GPT-2-reorder", "BERT") else batch), t,
                        width)
        elif expected is None:  # the stream and what is added to it
            expected = (batch * t, width) if family == "OPT" and role == "mlp_out" \
                else (batch, t, width)
        assert tuple(value.shape) == expected, f"{family} {name}: {tuple(value.shape)}"
    if family in ROLES:  # what docs/transformers.md says these families have
        roles = {n.split(".", 2)[2] if n.startswith("blocks.") else n for n in found}
        assert roles == ROLES[family], family


