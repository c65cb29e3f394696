"""Found by review 27, NOT fixed: fails on the current code (kept apart, not xfail).

A Qwen2 with mixed layer types (full attention in the first half of the layers, a sliding
window in the second: ``use_sliding_window=True, max_window_layers=L // 2``), shared layers by
default. After a first call without a cache (every layer shared, ``blocks.L.resid_post`` on the
layer call ``model.layers.L``), a call with a ``DynamicCache`` (``use_cache=True``) runs the
full-attention layers shared with their cache entries and the sliding ones traced in place
(``model.layers.L.add_1``). Its logits, its per-call edits of ``blocks.0.resid_post`` and
``run_with_cache(names="blocks.0.resid_post")`` equal the untapped model's, but ``tap()``'s own
taps of the full-attention layers are missing: ``tapped.taps["blocks.0.resid_post"]`` raises
``SiteNotRunError`` after that call (the layer ran; only layers 2 and 3 were recorded). With the
cache call first, every layer is traced in place and all four are recorded.
"""

from __future__ import annotations

import pytest
import torch

import fxprobe

transformers = pytest.importorskip("transformers")


def test_taps_of_shared_cache_layers_beside_sliding_layers_after_a_call_without_cache() -> None:
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        use_sliding_window=True, sliding_window=4, max_window_layers=2)
    model = transformers.Qwen2ForCausalLM(cfg).eval()
    tapped = fxprobe.tap(model, ops="blocks.*.resid_post")
    x = torch.randint(3, 64, (1, 9))
    got: dict[int, torch.Tensor] = {}
    handles = [layer.register_forward_hook(
        lambda m, a, o, i=i: got.__setitem__(i, (o[0] if isinstance(o, tuple) else o).clone()))
        for i, layer in enumerate(model.model.layers)]
    try:
        with torch.no_grad():
            want = model(x, use_cache=True).logits
    finally:
        for h in handles:
            h.remove()
    with torch.no_grad():
        tapped(x, use_cache=False)
        out = tapped(x, use_cache=True).logits
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    for i in range(4):
        torch.testing.assert_close(tapped.taps[f"blocks.{i}.resid_post"], got[i],
                                   rtol=0, atol=0, msg=f"layer {i}")
