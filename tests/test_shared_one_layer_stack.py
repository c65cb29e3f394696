"""Shared blocks (``FXPROBE_DYNAMO_REGIONS=shared``) on an encoder-decoder whose other stack has
one layer (T5 with a one-layer encoder, BART with a one-layer decoder): the one list of two or
more layers is not shared (``dynamo_inline.shareable``), so every canonical name is the one the
capture of every layer on its own (``0``) gives, on the same raw site, with the same value, and
the logits are the untapped model's."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import fxprobe

tf = pytest.importorskip("transformers")

_ENC, _DEC = torch.tensor([[5, 6, 7, 8, 9]]), torch.tensor([[2, 3, 4]])


def _t5() -> torch.nn.Module:
    torch.manual_seed(0)
    return tf.T5ForConditionalGeneration(tf.T5Config(
        vocab_size=50, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_decoder_layers=2,
        num_heads=4, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
        dropout_rate=0.0)).eval()


def _bart() -> torch.nn.Module:
    torch.manual_seed(0)
    return tf.BartForConditionalGeneration(tf.BartConfig(
        vocab_size=60, d_model=32, encoder_layers=2, decoder_layers=1,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
        decoder_ffn_dim=64, max_position_embeddings=64)).eval()


def _names(model: torch.nn.Module, mode: str, monkeypatch: pytest.MonkeyPatch,
           ) -> tuple[dict[str, str], dict[str, torch.Tensor], torch.Tensor]:
    monkeypatch.setenv("FXPROBE_DYNAMO_REGIONS", mode)
    tapped = fxprobe.tap(model, tracer="dynamo")
    with torch.no_grad():
        out: Any = tapped(input_ids=_ENC, decoder_input_ids=_DEC, use_cache=False)
    names = {c: s.name for s in tapped.sites for c in (s.canonical or ())}
    return names, {c: tapped.taps[c].clone() for c in names}, out.logits


@pytest.mark.parametrize("make", [_t5, _bart], ids=["t5-one-layer-encoder",
                                                     "bart-one-layer-decoder"])
def test_every_canonical_name_of_the_whole_capture(
        make: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    model = make()
    with torch.no_grad():
        want = model(input_ids=_ENC, decoder_input_ids=_DEC, use_cache=False).logits
    whole, whole_values, _ = _names(model, "0", monkeypatch)
    names, values, logits = _names(model, "shared", monkeypatch)
    assert "logits" in whole and any(n.startswith("encoder.blocks.0.") for n in whole)
    assert names == whole
    for name, value in whole_values.items():
        assert torch.equal(values[name], value), name
    assert torch.equal(logits, want)
