"""A first call with a batch of one (a prompt), then batches of 2 and 3 and a new length, run
the graphs of the first call: no new capture (counted by ``tapped.dynamo_info``), values equal
to the untapped model at every shape, with and without shared blocks, over a KV cache,
generate(), a per-call edit and gradients; where the model's code branches on a batch of one,
the region says so and captures again; a torch.compile of the user's own is untouched."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import transformers as tf
from torch import nn

import fxprobe


def _llama() -> nn.Module:
    return tf.LlamaForCausalLM(tf.LlamaConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2,
        num_key_value_heads=2, vocab_size=100))


def _qwen2() -> nn.Module:
    return tf.Qwen2ForCausalLM(tf.Qwen2Config(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2,
        num_key_value_heads=2, vocab_size=100))


def _gpt2() -> nn.Module:
    return tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100,
                                            bos_token_id=0, eos_token_id=0))


MODELS: dict[str, tuple[Callable[[], nn.Module], str]] = {
    "llama": (_llama, "model.layers"), "qwen2": (_qwen2, "model.layers"),
    "gpt2": (_gpt2, "transformer.h")}


def _model(name: str) -> tuple[nn.Module, list[nn.Module]]:
    torch.manual_seed(0)
    make, layers = MODELS[name]
    model = make().eval()
    return model, list(model.get_submodule(layers))


def _first(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


def _reference(layers: list[nn.Module], call: Callable[[], Any],
               edit: Callable[[torch.Tensor], torch.Tensor] | None = None
               ) -> tuple[Any, list[torch.Tensor]]:
    """``call()`` on the untapped model, each layer's output cloned (layer 0's edited)."""
    kept: list[torch.Tensor] = []

    def hook(m: nn.Module, a: Any, out: Any) -> Any:
        if edit is not None and m is layers[0]:
            out = (edit(out[0]), *out[1:]) if isinstance(out, tuple) else edit(out)
        kept.append(_first(out).detach().clone())
        return out

    handles = [layer.register_forward_hook(hook) for layer in layers]
    try:
        return call(), kept
    finally:
        for h in handles:
            h.remove()


def _captures(tapped: Any) -> int:
    return sum(info.graphs for info in tapped.dynamo_info)


def _mask(batch: int, length: int) -> torch.Tensor:
    mask = torch.ones(batch, length, dtype=torch.long)
    if batch > 1:
        mask[1, :2] = 0  # left padding in the second row
    return mask


SHAPES = [(1, 5), (2, 5), (3, 5), (3, 7), (1, 9)]


@pytest.mark.parametrize("mode", ["marked", "shared"])
@pytest.mark.parametrize("name", list(MODELS))
@torch.no_grad()
def test_a_batch_of_one_first_then_new_batches_and_lengths_over_a_cache(
        name: str, mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FXPROBE_DYNAMO_REGIONS", mode)
    model, layers = _model(name)
    tapped = fxprobe.tap(model, ops="blocks.*.resid_post", tracer="dynamo")
    captures = None
    for batch, length in SHAPES:
        ids = torch.randint(0, 100, (batch, length))
        kwargs = dict(attention_mask=_mask(batch, length), use_cache=True)
        want, kept = _reference(layers, lambda ids=ids, kwargs=kwargs: model(ids, **kwargs))
        got = tapped(ids, **kwargs)
        torch.testing.assert_close(got.logits, want.logits, msg=f"{(batch, length)}")
        for i, value in enumerate(kept):
            torch.testing.assert_close(tapped.taps[f"blocks.{i}.resid_post"], value)
        # A step on the prefill's cache: a length of 1, captured once at the first step.
        step = torch.randint(0, 100, (batch, 1))
        mask = torch.cat([kwargs["attention_mask"], torch.ones(batch, 1, dtype=torch.long)], 1)
        want_step = model(step, past_key_values=want.past_key_values, attention_mask=mask)
        got_step = tapped(step, past_key_values=got.past_key_values, attention_mask=mask)
        torch.testing.assert_close(got_step.logits, want_step.logits)
        if captures is None:
            captures = _captures(tapped)  # the prefill's and the step's
        assert _captures(tapped) == captures, f"captured again at {(batch, length)}"


@pytest.mark.parametrize("mode", ["marked", "shared"])
@torch.no_grad()
def test_a_branch_on_a_batch_of_one_is_said_and_captured_again(
        mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a cache or a mask, transformers expands the position ids where the batch is
    not 1 (a branch on the batch): the region says the batch is kept exact; values right."""
    monkeypatch.setenv("FXPROBE_DYNAMO_REGIONS", mode)
    model, layers = _model("llama")
    tapped = fxprobe.tap(model, ops="blocks.*.resid_post", tracer="dynamo")
    for n, (batch, length) in enumerate(SHAPES):
        ids = torch.randint(0, 100, (batch, length))
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            got = tapped(ids, use_cache=False)
        said = [str(w.message) for w in seen if "kept these input sizes" in str(w.message)]
        assert said == ([] if n else [said[0]]) and (n or "'input_ids' (dim 0)" in said[0])
        want, kept = _reference(layers, lambda ids=ids: model(ids, use_cache=False))
        torch.testing.assert_close(got.logits, want.logits)
        for i, value in enumerate(kept):
            torch.testing.assert_close(tapped.taps[f"blocks.{i}.resid_post"], value)
    assert [info.graphs for info in tapped.dynamo_info] == [2 if mode == "marked" else 4]


@pytest.mark.parametrize("mode", ["marked", "shared"])
def test_an_edit_and_gradients_at_a_batch_of_one_then_two(
        mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FXPROBE_DYNAMO_REGIONS", mode)
    model, layers = _model("llama")
    tapped = fxprobe.tap(model, ops="blocks.*.resid_post", tracer="dynamo")
    captures = None
    for batch in (1, 2, 3):
        ids, mask = torch.randint(0, 100, (batch, 6)), _mask(batch, 6)
        with torch.no_grad(), tapped.intervene({"blocks.0.resid_post": lambda site, v: v * 2}):
            got = tapped(ids, attention_mask=mask)
        want, _ = _reference(layers, lambda ids=ids, mask=mask: model(ids, attention_mask=mask),
                                lambda v: v * 2)
        torch.testing.assert_close(got.logits, want.logits)
        model.zero_grad()
        model(ids, attention_mask=mask).logits.square().mean().backward()
        want_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad()
        tapped(ids, attention_mask=mask).logits.square().mean().backward()
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.grad, want_grads[n], msg=n)
        captures = _captures(tapped) if captures is None else captures  # (grad mode: 2)
        assert _captures(tapped) == captures, f"captured again at batch {batch}"


@pytest.mark.parametrize("mode", ["marked", "shared"])
@torch.no_grad()
def test_generate_with_a_batch_of_one_then_two(mode: str,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FXPROBE_DYNAMO_REGIONS", mode)
    model, _ = _model("llama")
    tapped = fxprobe.tap(model, ops="blocks.*.resid_post", tracer="dynamo")
    kwargs: dict[str, Any] = dict(max_new_tokens=3, do_sample=False, pad_token_id=0)
    captures = None
    for batch in (1, 2, 3):
        ids, mask = torch.randint(1, 100, (batch, 4)), _mask(batch, 4)
        mask[0, 0] = 0  # padded in every batch (generate() passes a mask of ones otherwise)
        want = model.generate(ids, attention_mask=mask, **kwargs)
        got = tapped.generate(ids, attention_mask=mask, **kwargs)
        assert got.tolist() == want.tolist()
        captures = _captures(tapped) if captures is None else captures
        assert _captures(tapped) == captures, f"captured again at batch {batch}"


@torch.no_grad()
def test_the_users_own_torch_compile_is_untouched() -> None:
    """Around a tapped first call with a batch of one, the user's torch.compile specializes a
    batch of one as dynamo does (a batch of 2 captures again), and the user's input tensors
    carry no mark of fxprobe's."""
    counts = {"n": 0}

    def backend(gm: Any, example: Any) -> Any:
        counts["n"] += 1
        return gm

    def own(x: torch.Tensor) -> torch.Tensor:
        return x * 2 + x.shape[0]

    def user(first: int) -> int:
        counts["n"] = 0
        torch._dynamo.reset()
        compiled = torch.compile(own, backend=backend, dynamic=True)
        for batch in (first, 2, 3):
            x = torch.randn(batch, 4)
            torch.testing.assert_close(compiled(x), own(x))
        return counts["n"]

    before = user(1)
    assert before == 2  # dynamo's own specialization of a size of 1
    model, _ = _model("llama")
    tapped = fxprobe.tap(model, ops="blocks.*.resid_post", tracer="dynamo")
    ids, mask = torch.randint(0, 100, (1, 5)), torch.ones(1, 5, dtype=torch.long)
    torch._dynamo.maybe_mark_dynamic(mask, 1)  # the user's own mark stays
    tapped(ids, attention_mask=mask)
    assert not hasattr(ids, "_dynamo_static_indices")
    assert not hasattr(ids, "_has_dynamo_dim_marking")
    assert not hasattr(mask, "_dynamo_static_indices")
    assert mask._dynamo_weak_dynamic_indices == {1} and mask._has_dynamo_dim_marking
    assert not torch.fx.experimental._config.backed_size_oblivious
    assert user(1) == before
