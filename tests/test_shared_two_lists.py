"""``FXPROBE_DYNAMO_REGIONS=shared`` on a model with two lists of blocks of one class (T5's
encoder and decoder stacks, both of ``T5Block``): not shared, marked as without the variable,
so every canonical name keeps its stack (``encoder.blocks.0.attn.k``, never a bare
``blocks.0.attn.k`` for the encoder's layer), with the values of the unset mode."""

from __future__ import annotations

import pytest
import torch
import transformers as tf

import fxprobe


def _t5() -> torch.nn.Module:
    torch.manual_seed(0)
    return tf.T5ForConditionalGeneration(tf.T5Config(
        vocab_size=100, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
        decoder_start_token_id=0, pad_token_id=0)).eval()


def test_two_lists_of_one_class_keep_their_stacks_names(
        monkeypatch: pytest.MonkeyPatch) -> None:
    model = _t5()
    ids, dec = torch.randint(1, 100, (2, 5)), torch.randint(1, 100, (2, 4))
    names: dict[str, dict[str, str]] = {}
    taps: dict[str, dict[str, torch.Tensor]] = {}
    for mode in ("1", "shared"):
        monkeypatch.setenv("FXPROBE_DYNAMO_REGIONS", mode)
        tapped = fxprobe.tap(model, ops=["encoder.blocks.*.attn.k", "decoder.blocks.*.resid_post",
                                         "decoder.blocks.1.cross_attn.pattern"],
                             tracer="dynamo")
        with torch.no_grad():
            out = tapped(input_ids=ids, decoder_input_ids=dec, use_cache=False)
            again = tapped(input_ids=ids[:1], decoder_input_ids=dec[:1], use_cache=False)
        names[mode] = {c: s.name for s in tapped.known_sites() for c in s.canonical}
        taps[mode] = {c: tapped.taps[n] for c, n in names[mode].items() if n in tapped.taps}
        with torch.no_grad():
            ref = model(input_ids=ids, decoder_input_ids=dec, use_cache=False)
            ref1 = model(input_ids=ids[:1], decoder_input_ids=dec[:1], use_cache=False)
        torch.testing.assert_close(out.logits, ref.logits)
        torch.testing.assert_close(again.logits, ref1.logits)
    assert names["shared"] == names["1"]
    assert not [c for c in names["shared"] if c.startswith("blocks.")]
    assert taps["shared"].keys() == taps["1"].keys() and "encoder.blocks.1.attn.k" in taps["1"]
    for c, v in taps["1"].items():
        torch.testing.assert_close(taps["shared"][c], v)
