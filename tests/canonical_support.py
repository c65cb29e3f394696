"""What test_canonical_blocks, test_canonical share."""

from __future__ import annotations

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

