"""A layer's call keeps its name (``model.layers.0``) in every graph dynamo captures of a
model: the graph of a call without a cache, whose layers are marked, and that of a call with
one, traced layer by layer. The name was located at the marked layer's first op, so the
second graph named the same call ``model.layers.0_1``: an edit of ``model.layers.0`` entered
after a first call without a cache was silently not applied to calls with one
(``generate()`` included), found by ``tests/test_life.py`` in its long mode."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import transformers as tf
from canonical_support import DECODER, TOKENS
from reference import hooked
from torch import nn

import fxprobe


def _llama() -> nn.Module:
    torch.manual_seed(0)
    config = tf.LlamaConfig(**DECODER, **TOKENS)
    config._attn_implementation = "eager"
    return tf.LlamaForCausalLM(config).eval()


def _negate_first(out: torch.Tensor) -> torch.Tensor:
    out = out * -1.0
    out[:, 0] = 0
    return out


@pytest.mark.parametrize("first_cache", [False, True])
def test_an_edit_of_a_layer_call_applies_with_and_without_a_cache(
        first_cache: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FXPROBE_DYNAMO_REGIONS", "marked")
    model = _llama()
    twin = copy.deepcopy(model)
    tapped = fxprobe.tap(model, ops=["blocks.1.resid_post", "logits"], tracer="dynamo")
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        tapped(torch.randint(2, 100, (1, 5), generator=gen), use_cache=first_cache)
    ids = torch.randint(2, 100, (1, 4), generator=gen)
    edits = {"model.layers.0": _negate_first}
    for use_cache in (not first_cache, first_cache, not first_cache):
        with torch.no_grad():
            ref, _ = hooked(twin, lambda u=use_cache: twin(ids, use_cache=u), edits)
            with tapped.intervene({"model.layers.0": lambda s, v: _negate_first(v)}):
                out = tapped(ids, use_cache=use_cache)
        torch.testing.assert_close(out.logits, ref.logits)
    kw: dict[str, Any] = dict(attention_mask=torch.ones_like(ids), max_new_tokens=2,
                              do_sample=False)
    with torch.no_grad():
        ref_tokens, _ = hooked(twin, lambda: twin.generate(ids, **kw), edits)
        with tapped.intervene({"model.layers.0": lambda s, v: _negate_first(v)}):
            tokens = tapped.generate(ids, **kw)
    assert torch.equal(tokens, ref_tokens)
    with torch.no_grad():  # the call's value, by its one name, in both graphs
        for use_cache in (False, True):
            _, kept = hooked(twin, lambda u=use_cache: twin(ids, use_cache=u),
                             keep=("model.layers.0",))
            _, cache = tapped.run_with_cache(ids, names=["model.layers.0"],
                                             use_cache=use_cache)
            torch.testing.assert_close(cache["model.layers.0"], kept["model.layers.0"][0])
    region = tapped._lifecycle().program.dynamo[""]  # every graph's sites, by name
    layer_calls = [n for n in region.sites if n.startswith("model.layers.")
                   and n.count(".") == 2]
    assert sorted(layer_calls) == ["model.layers.0", "model.layers.1"]
