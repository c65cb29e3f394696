"""An edit of an attention kernel's keys or values (``blocks.L.attn.k/v``) while a KV cache
grows, step after step: it applies to what the kernel reads at each step, once, and the cache
keeps what the model computed (a flip applied twice would undo itself, a steering vector would
add up). The reference: the eager attention kernel written out with the edit inside it
(``test_review_percall._attention``), on an untapped copy."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch

import fxprobe

tf = pytest.importorskip("transformers")
llama = pytest.importorskip("transformers.models.llama.modeling_llama")

from test_review_percall import _attention, _flip  # noqa: E402


def _steer(value: torch.Tensor) -> torch.Tensor:
    return value + 0.5


def _model(attn: str = "eager") -> Any:
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=48, vocab_size=50, bos_token_id=0, eos_token_id=0)).eval()
    model.config._attn_implementation = attn
    return model


_STEPS = [torch.tensor([[5, 6, 7, 8]]), torch.tensor([[9]]), torch.tensor([[4, 2]])]


def _reference(model: Any, edits: dict[str, Callable[[torch.Tensor], torch.Tensor]]
               ) -> list[tuple[torch.Tensor, list[torch.Tensor]]]:
    """Each step's logits and its cache's values of every layer, the edits in the kernel."""
    ref = copy.deepcopy(model)
    ref.config._attn_implementation = "eager"
    original = llama.eager_attention_forward
    llama.eager_attention_forward = _attention(edits, {})
    out: list[tuple[torch.Tensor, list[torch.Tensor]]] = []
    try:
        past = None
        for ids in _STEPS:
            step = ref(input_ids=ids, past_key_values=past, use_cache=True)
            past = step.past_key_values
            out.append((step.logits, [x.values.clone() for x in past.layers]))
    finally:
        llama.eager_attention_forward = original
    return out


def _cache(past: Any) -> list[torch.Tensor]:
    return [x.values.clone() for x in past.layers]


@torch.no_grad()
def test_edits_of_the_kernels_keys_and_values_apply_once_per_step() -> None:
    model = _model()
    edits = {"blocks.1.attn.v": _flip, "blocks.0.attn.k": _steer}
    want = _reference(model, edits)
    torch._dynamo.reset()
    tapped = fxprobe.tap(model, ops="blocks.0.resid_post", tracer="dynamo")
    past = None
    for i, ids in enumerate(_STEPS):
        with tapped.intervene({n: (lambda s, v, f=f: f(v)) for n, f in edits.items()}):
            out = tapped(input_ids=ids, past_key_values=past, use_cache=True)
        past = out.past_key_values
        torch.testing.assert_close(out.logits, want[i][0], msg=f"step {i}")
        # The cache holds what the model computed (the next step reads it unedited).
        for layer, (got, kept) in enumerate(zip(_cache(past), want[i][1], strict=True)):
            torch.testing.assert_close(got, kept, msg=f"step {i} layer {layer}")


@torch.no_grad()
def test_an_edit_at_tap_applies_once_per_step_beside_sdpa() -> None:
    model = _model("sdpa")
    name = "blocks.1.attn.v"
    want = _reference(model, {name: _steer})
    torch._dynamo.reset()
    tapped = fxprobe.tap(model, ops=name, tracer="dynamo", fn=lambda s, v: _steer(v))
    past = None
    for i, ids in enumerate(_STEPS[:2]):
        out = tapped(input_ids=ids, past_key_values=past, use_cache=True)
        past = out.past_key_values
        torch.testing.assert_close(out.logits, want[i][0], msg=f"step {i}")
        for layer, (got, kept) in enumerate(zip(_cache(past), want[i][1], strict=True)):
            torch.testing.assert_close(got, kept, msg=f"step {i} layer {layer}")
        torch.testing.assert_close(tapped.taps[name], want[i][1][1] + 0.5, msg=f"step {i}")


def _gpt2() -> Any:
    torch.manual_seed(0)
    return tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100)).eval()


def _steer_v(s: Any, v: torch.Tensor) -> torch.Tensor:
    return v + 0.5


_GPT2_STEPS = [torch.tensor([[5, 6, 7, 8]]), torch.tensor([[9]]), torch.tensor([[3, 1]])]


@torch.no_grad()
def test_gpt2_keeps_its_cache_as_computed_under_an_edit_of_its_values() -> None:
    model = _gpt2()
    ref = copy.deepcopy(model)
    torch._dynamo.reset()
    tapped = fxprobe.tap(model, ops="blocks.1.resid_post", tracer="dynamo")
    past, plain, seen = None, None, []
    for ids in _GPT2_STEPS[:2]:
        with tapped.intervene({"blocks.1.attn.v": _steer_v}):
            out = tapped(input_ids=ids, past_key_values=past, use_cache=True)
        expected = ref(input_ids=ids, past_key_values=plain, use_cache=True)
        past, plain = out.past_key_values, expected.past_key_values
        seen.append(ids)
        # The edit is in layer 1's kernel: the caches (which the layers compute before their
        # kernels) equal the untapped model's, step after step.
        for layer in range(2):
            torch.testing.assert_close(past.layers[layer].values, plain.layers[layer].values)
            torch.testing.assert_close(past.layers[layer].keys, plain.layers[layer].keys)
        assert not torch.allclose(out.logits, expected.logits)  # and the edit applied


@torch.no_grad()
def test_gpt2_an_edit_of_its_values_with_and_without_a_cache_applies_once() -> None:
    model = _gpt2()
    torch._dynamo.reset()
    tapped = fxprobe.tap(model, ops="blocks.1.resid_post", tracer="dynamo")
    ids = torch.cat(_GPT2_STEPS[:2], dim=1)
    with tapped.intervene({"blocks.1.attn.v": _steer_v}):
        whole = tapped(input_ids=ids, use_cache=False).logits  # the graph without a cache
        first = tapped(input_ids=_GPT2_STEPS[0], use_cache=True)
        out = tapped(input_ids=_GPT2_STEPS[1], past_key_values=first.past_key_values)
    # Once per step: as the whole sequence, edited once, without a cache.
    torch.testing.assert_close(out.logits, whole[:, -1:], atol=1e-5, rtol=1e-4)


@torch.no_grad()
def test_an_edit_of_the_values_of_a_static_cache_applies_once_per_step() -> None:
    model = _model()
    steps = _STEPS[:2]

    def run(call: Callable[..., Any]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        cache = tf.StaticCache(config=model.config, max_cache_len=8)
        out, pos = [], 0
        for ids in steps:
            at = torch.arange(pos, pos + ids.shape[1])
            pos += ids.shape[1]
            logits = call(input_ids=ids, past_key_values=cache, cache_position=at).logits
            out.append((logits, cache.layers[1].values.clone()))
        return out

    ref = copy.deepcopy(model)
    original = llama.eager_attention_forward
    llama.eager_attention_forward = _attention({"blocks.1.attn.v": _steer}, {})
    try:
        want = run(ref)
    finally:
        llama.eager_attention_forward = original
    torch._dynamo.reset()
    tapped = fxprobe.tap(model, ops="blocks.0.resid_post", tracer="dynamo")

    def edited(**kwargs: Any) -> Any:
        with tapped.intervene({"blocks.1.*attn.v": lambda s, v: _steer(v)}):
            return tapped(**kwargs)

    for i, ((logits, cache), (want_logits, want_cache)) in enumerate(
            zip(run(edited), want, strict=True)):
        torch.testing.assert_close(cache, want_cache, msg=f"the cache at step {i}")
        torch.testing.assert_close(logits, want_logits, msg=f"the logits at step {i}")
