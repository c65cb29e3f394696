"""Shared blocks whose own graphs keep no site (``FXPROBE_DYNAMO_REGIONS=shared`` with only
the stream selected, ``blocks.*.resid_post``, named in the graph around the blocks): every
layer runs one untapped function of the block's graph, each under its own names
(``DynamoRegion._untapped``); an edit inside a layer later builds that layer's graph with its
points. And a block attribute that only happens to equal a layer's place (layer 2's
``num_key_value_groups`` of 2) does not set that layer apart (``dynamo_blocks._places``).
Values against the untapped model with hooks that edit or clone."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import transformers as tf
from canonical_support import DECODER, TOKENS
from reference import hooked
from torch import nn

import fxprobe

LAYERS = 4


def _llama(cache: bool = False) -> nn.Module:
    torch.manual_seed(0)
    return tf.LlamaForCausalLM(tf.LlamaConfig(
        **{**DECODER, "num_hidden_layers": LAYERS}, **TOKENS, use_cache=cache)).eval()


def _tap(model: nn.Module, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv("FXPROBE_DYNAMO_REGIONS", "shared")
    return fxprobe.tap(model, ops="blocks.*.resid_post", tracer="dynamo")


def _region(tapped: Any) -> Any:
    return tapped._lifecycle().program.dynamo[""]


def _eager(model: nn.Module, ids: torch.Tensor, edits: dict[str, Any] | None = None,
           keep: tuple[str, ...] = ()) -> tuple[Any, dict[str, torch.Tensor]]:
    """The untapped model's output with forward hooks editing (``edits``) and cloning
    (``keep``) the outputs of the named modules (each called once)."""
    with torch.no_grad():
        out, kept = hooked(model, lambda: model(ids), edits, keep)
    return out, {n: v for n, (v,) in kept.items()}


def test_every_layer_runs_one_function_under_its_own_names(
        monkeypatch: pytest.MonkeyPatch) -> None:
    model = _llama()
    tapped = _tap(model, monkeypatch)
    ids = torch.randint(1, 100, (2, 7))
    with torch.no_grad():
        out = tapped(ids)
    ref, kept = _eager(model, ids, keep=tuple(f"model.layers.{i}" for i in range(LAYERS)))
    torch.testing.assert_close(out.logits, ref.logits)
    names = {c: s.name for s in tapped.known_sites() for c in s.canonical}
    for i in range(LAYERS):
        torch.testing.assert_close(tapped.taps[names[f"blocks.{i}.resid_post"]],
                                   kept[f"model.layers.{i}"])
    versions = [v for c in _region(tapped).captured if c.captured_prefix
                for v in c.named_for.values()]  # the block's graph (not the one around)
    assert sorted(v.prefix for v in versions) == [f"model.layers.{i}" for i in range(LAYERS)]
    assert len({id(v.fn) for v in versions}) == 1  # one function for every layer
    for v in versions:  # each graph names its own layer's ops, no other layer's
        named = {s.name for n in v.graph.nodes for s in n.meta.get("fxprobe_sites", ())}
        assert named and all(n.startswith(v.prefix + ".") for n in named), (v.prefix, named)
        assert not v.names  # nothing kept inside: the stream is kept around the blocks


def test_edits_and_reads_inside_layers_after_untapped_forwards(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A forward, a block editing inside layer 2, a forward after it, a second block on
    layer 3 at a new length, ``run_with_cache`` of layers 1 and 3 inside: each as hooks."""
    model = _llama()
    tapped = _tap(model, monkeypatch)
    ids = torch.randint(1, 100, (2, 7))
    down = [f"model.layers.{i}.mlp.down_proj" for i in range(LAYERS)]
    with torch.no_grad():
        tapped(ids)
        with tapped.intervene({down[2]: lambda s, v: v * 2 + 1}):
            edited = tapped(ids)
        after = tapped(ids)
        longer = torch.randint(1, 100, (2, 11))
        with tapped.intervene({down[3]: lambda s, v: -v}):
            edited3 = tapped(longer)
        out, cache = tapped.run_with_cache(ids, names=[down[1], down[3]])
    ref2, _ = _eager(model, ids, {down[2]: lambda v: v * 2 + 1})
    torch.testing.assert_close(edited.logits, ref2.logits)
    plain, kept = _eager(model, ids, keep=(down[1], down[3]))
    assert not torch.allclose(edited.logits, plain.logits)
    torch.testing.assert_close(after.logits, plain.logits)
    ref3, _ = _eager(model, longer, {down[3]: lambda v: -v})
    torch.testing.assert_close(edited3.logits, ref3.logits)
    torch.testing.assert_close(out.logits, plain.logits)
    for name in (down[1], down[3]):
        torch.testing.assert_close(cache[name], kept[name])


def test_an_attribute_equal_to_one_layers_place_does_not_set_it_apart(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Layer 2's attention has ``num_key_value_groups`` 2: the layers' outputs are still made
    once on fake tensors for all of them, and prefill and a step equal the model's."""
    model = _llama(cache=True)
    assert model.model.layers[2].self_attn.num_key_value_groups == 2
    tapped = _tap(model, monkeypatch)
    ids = torch.randint(1, 100, (1, 6))
    with torch.no_grad():
        out = tapped(ids, use_cache=True)
        shared = _region(tapped).shared_kv
        assert len(shared.made) == 1, len(shared.made)
        step = tapped(torch.tensor([[5]]), cache=out.cache, use_cache=True)
        ref = model(ids, use_cache=True)
        ref_step = model(torch.tensor([[5]]), cache=ref.cache, use_cache=True)
    torch.testing.assert_close(out.logits, ref.logits)
    torch.testing.assert_close(step.logits, ref_step.logits)
