"""``FXPROBE_DYNAMO_REGIONS=shared`` on models whose layers return ``(output, attention
weights)`` (Bloom, Falcon): the stream around the shared layers (``resid_pre``, ``embed``,
``ln_final``, ``logits``) is named on what the model reads of each layer's tuple, with and
without a KV cache (whose entry an op reads after the layer without writing into its output,
``dynamo_blocks_cache.block_kv``). Names, values and an edit of ``blocks.0.resid_post`` as
in the unset mode, and as hooks on the untapped model."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import transformers as tf
from canonical_support import TOKENS

import fxprobe

MODELS = {
    "Bloom": lambda: tf.BloomForCausalLM(tf.BloomConfig(n_layer=2, hidden_size=32, n_head=4,
                                                        **TOKENS)),
    "Falcon": lambda: tf.FalconForCausalLM(tf.FalconConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=2, **TOKENS)),
}
LAYERS = {"Bloom": "transformer.h", "Falcon": "transformer.h"}


def _run(model: torch.nn.Module, mode: str, cache: bool,
         monkeypatch: pytest.MonkeyPatch) -> tuple[dict[str, str], dict[str, Any], Any, Any]:
    monkeypatch.setenv("FXPROBE_DYNAMO_REGIONS", mode)
    tapped = fxprobe.tap(model, ops=fxprobe.where(lambda s: True), tracer="dynamo")
    ids = torch.randint(1, 100, (2, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        tapped(ids, use_cache=cache)
        names = {c: s.name for s in tapped.known_sites() for c in s.canonical}
        values = {c: tapped.taps[n].clone() for c, n in names.items() if n in tapped.taps}
        with tapped.intervene({"blocks.0.resid_post": lambda s, v: v * 2 - 1}):
            edited = tapped(ids, use_cache=cache)
        after = tapped(ids, use_cache=cache)
    return names, values, edited.logits, after.logits


@pytest.mark.parametrize("cache", [False, True], ids=["no-cache", "cache"])
@pytest.mark.parametrize("family", sorted(MODELS))
def test_the_stream_around_tuple_layers_is_named_as_unshared(
        family: str, cache: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    model = MODELS[family]().eval()
    unset = _run(model, "1", cache, monkeypatch)
    shared = _run(model, "shared", cache, monkeypatch)
    expected = {"embed", "ln_final", "logits", "blocks.0.resid_pre", "blocks.1.resid_pre",
                "blocks.0.resid_post", "blocks.1.resid_post"}
    assert expected <= set(shared[0]), sorted(expected - set(shared[0]))
    assert set(shared[0]) == set(unset[0])
    for c, v in unset[1].items():
        torch.testing.assert_close(shared[1][c], v, msg=c)
    ids = torch.randint(1, 100, (2, 6), generator=torch.Generator().manual_seed(1))
    layer0 = model.get_submodule(f"{LAYERS[family]}.0")
    handle = layer0.register_forward_hook(lambda m, a, out: (out[0] * 2 - 1, *out[1:]))
    try:
        with torch.no_grad():
            ref = model(ids, use_cache=cache).logits
    finally:
        handle.remove()
    with torch.no_grad():
        plain = model(ids, use_cache=cache).logits
    for _, _, edited, after in (unset, shared):
        torch.testing.assert_close(edited, ref)
        torch.testing.assert_close(after, plain)
