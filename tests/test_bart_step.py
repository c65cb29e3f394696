"""BART (an encoder and a decoder; ``tracer="dynamo"``) on a generation step: a decoder-only
call given the encoder's outputs and a KV cache, against forward hooks that clone on an
untapped copy.

The encoder does not run on a step, so its sites have no value in it: ``tapped.taps`` and a
``run_with_cache`` cache say so (``SiteNotRunError``, naming the canonical name asked), never
the prefill's value presented as the step's; the next full forward has the encoder's values
of its own input.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch

import fxprobe

transformers = pytest.importorskip("transformers")

ENCODER = [f"encoder.blocks.{i}.resid_post" for i in range(2)]
DECODER = [f"decoder.blocks.{i}.resid_post" for i in range(2)]


def _bart() -> torch.nn.Module:
    config = transformers.BartConfig(
        vocab_size=100, d_model=16, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
        decoder_ffn_dim=32, max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers.BartForConditionalGeneration(config).eval()


def _hooked(model: Any, **kwargs: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    """``model(**kwargs)`` and each layer's output (BART's resid_post: the layer's final
    LayerNorm), cloned, by canonical name, for the layers that ran."""
    seen: dict[str, torch.Tensor] = {}
    handles = []
    for stack in ("encoder", "decoder"):
        for i, layer in enumerate(getattr(model.model, stack).layers):
            def hook(m: Any, args: Any, out: torch.Tensor, name: str = f"{stack}.blocks.{i}"
                     ) -> None:
                seen[f"{name}.resid_post"] = out.detach().clone()
            handles.append(layer.final_layer_norm.register_forward_hook(hook))
    try:
        with torch.no_grad():
            return model(**kwargs), seen
    finally:
        for h in handles:
            h.remove()


def _step(out: Any, token: torch.Tensor, cache: Any) -> dict[str, Any]:
    return {"decoder_input_ids": token, "encoder_outputs": (out.encoder_last_hidden_state,),
            "cache": cache, "use_cache": True}


def _absent(lookup: Any, name: str) -> None:
    with pytest.raises(fxprobe.SiteNotRunError, match=f"'{name}'.*did not") as e:
        lookup[name]
    assert "model.encoder.layers" in str(e.value)


def test_a_generation_step_has_no_encoder_values() -> None:
    model = _bart()
    reference = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tapped = fxprobe.tap(model, ops=ENCODER + DECODER, tracer="dynamo")
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(4, 100, (1, 7), generator=gen)
    dec = torch.randint(4, 100, (1, 3), generator=gen)
    prefill = {"input_ids": ids, "decoder_input_ids": dec, "use_cache": True}
    want, seen = _hooked(reference, **prefill)
    with torch.no_grad():
        out = tapped(**prefill)
    torch.testing.assert_close(out.logits, want.logits)
    for name in ENCODER + DECODER:
        torch.testing.assert_close(tapped.taps[name], seen[name])

    token = out.logits[:, -1:].argmax(-1)
    step_want, step_seen = _hooked(reference, **_step(want, token, want.past_key_values))
    assert set(step_seen) == set(DECODER)  # the encoder did not run
    with torch.no_grad():
        step = tapped(**_step(out, token, out.past_key_values))
    torch.testing.assert_close(step.logits, step_want.logits)
    taps = tapped.taps
    for name in DECODER:
        torch.testing.assert_close(taps[name], step_seen[name])
    for name in ENCODER:
        assert name not in taps and taps.get(name) is None
        with pytest.raises(fxprobe.SiteNotRunError, match=f"'{name}'.*no value"):
            taps[name]
    assert len(taps) == len(DECODER)

    whole = torch.cat([dec, token], dim=1)  # a step without a cache, kept whole
    kwargs = {"decoder_input_ids": whole, "encoder_outputs": (out.encoder_last_hidden_state,)}
    cache_want, cache_seen = _hooked(reference, **kwargs)
    with torch.no_grad():
        got, cache = tapped.run_with_cache(**kwargs)
    torch.testing.assert_close(got.logits, cache_want.logits)
    for name in DECODER:
        torch.testing.assert_close(cache[name], cache_seen[name])
    for name in ENCODER:
        _absent(cache, name)
        assert name not in cache

    ids2 = torch.randint(4, 100, (1, 5), generator=gen)  # a full forward: its own encoder's
    again = {"input_ids": ids2, "decoder_input_ids": dec}
    _, seen2 = _hooked(reference, **again)
    with torch.no_grad():
        tapped(**again)
    for name in ENCODER + DECODER:
        torch.testing.assert_close(tapped.taps[name], seen2[name])
    tapped.remove()
