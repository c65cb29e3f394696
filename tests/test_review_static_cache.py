"""A static KV cache over a sequence of steps of different lengths (a prompt, one-position
steps, a two-position step), then reset for a second prompt: the logits and the cache equal
the untapped model's bitwise, ``attn.k``/``.v`` equal the cache's buffer, kept history does
not move when the buffer is written again, and per-call edits of ``attn.k``/``.pattern``
equal Llama's eager attention written out with the edits inside it."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch

import fxprobe

tf = pytest.importorskip("transformers")
llama = pytest.importorskip("transformers.models.llama.modeling_llama")

from test_cache_edits import _model  # noqa: E402
from test_review_percall import _attention, _flip  # noqa: E402

_STEPS = [torch.tensor([[5, 6, 7]]), torch.tensor([[9]]), torch.tensor([[4]]),
          torch.tensor([[1, 2]])]


def _run(call: Callable[..., Any], cache: Any, steps: list[torch.Tensor],
         after: Callable[[], None] = lambda: None) -> list[tuple[torch.Tensor, list[torch.Tensor]]]:
    out, pos = [], 0
    for ids in steps:
        at = torch.arange(pos, pos + ids.shape[1])
        pos += ids.shape[1]
        logits = call(input_ids=ids, past_key_values=cache, cache_position=at).logits
        out.append((logits, [t.clone() for x in cache.layers for t in (x.keys, x.values)]))
        after()
    return out


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@torch.no_grad()
def test_a_static_cache_over_steps_and_a_reset_is_read_as_computed(attn: str) -> None:
    model = _model(attn)
    ref = copy.deepcopy(model)
    torch._dynamo.reset()
    tapped = fxprobe.tap(model, ops="blocks.*", tracer="dynamo", keep="all")
    mine = tf.StaticCache(config=model.config, max_cache_len=8)
    theirs = tf.StaticCache(config=model.config, max_cache_len=8)
    seen: list[dict[str, torch.Tensor]] = []

    def check() -> None:
        for layer in (0, 1):
            for role, buffer in (("k", mine.layers[layer].keys), ("v", mine.layers[layer].values)):
                got = tapped.taps[f"blocks.{layer}.attn.{role}"]
                assert torch.equal(got, buffer[:, :, :got.shape[2]]), (layer, role)
        seen.append({n: v.clone() for n, v in tapped.taps.items()})

    got = _run(tapped, mine, _STEPS, check)
    want = _run(ref, theirs, _STEPS)
    mine.reset()
    theirs.reset()
    got += _run(tapped, mine, _STEPS[3:], check)  # a second prompt in the same buffers
    want += _run(ref, theirs, _STEPS[3:])
    for i, ((logits, cache), (want_logits, want_cache)) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(logits, want_logits), i
        assert all(torch.equal(a, b) for a, b in zip(cache, want_cache, strict=True)), i
    # The history kept from the first prompt is what each step read, not the buffer now.
    for i, kept in enumerate(seen):
        assert all(torch.equal(tapped.history[i][n], v) for n, v in kept.items()), i


_KEYS_AND_PATTERN = {"blocks.0.attn.k": lambda v: v + 0.5, "blocks.1.attn.pattern": _flip,
                     "blocks.1.attn.k": lambda v: v + 0.5, "blocks.0.attn.v": _flip}
_PATTERN_AND_VALUES = {"blocks.1.attn.pattern": _flip, "blocks.1.attn.v": _flip}


@pytest.mark.parametrize(("attn", "edits"), [
    ("sdpa", _KEYS_AND_PATTERN), ("eager", _KEYS_AND_PATTERN), ("eager", _PATTERN_AND_VALUES),
    ("sdpa", _PATTERN_AND_VALUES),
], ids=["sdpa-keys", "eager-keys", "eager-values", "sdpa-values"])
@torch.no_grad()
def test_per_call_edits_of_keys_values_and_pattern_under_a_static_cache(
        attn: str, edits: dict[str, Callable[[torch.Tensor], torch.Tensor]]) -> None:
    model = _model(attn)
    ref = copy.deepcopy(model)
    ref.config._attn_implementation = "eager"
    original = llama.eager_attention_forward
    llama.eager_attention_forward = _attention(edits, {})
    try:
        want = _run(ref, tf.StaticCache(config=model.config, max_cache_len=8), _STEPS)
    finally:
        llama.eager_attention_forward = original
    torch._dynamo.reset()
    # beside SDPA, the pattern is computed only where tap() selects it
    tapped = fxprobe.tap(model, ops=["blocks.0.resid_post", "blocks.1.attn.pattern"],
                         tracer="dynamo")

    def edited(**kwargs: Any) -> Any:
        with tapped.intervene({n: (lambda s, v, f=f: f(v)) for n, f in edits.items()}):
            return tapped(**kwargs)

    got = _run(edited, tf.StaticCache(config=model.config, max_cache_len=8), _STEPS)
    for i, ((logits, cache), (want_logits, want_cache)) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(logits, want_logits, msg=f"the logits at step {i}")
        for j, (a, b) in enumerate(zip(cache, want_cache, strict=True)):
            torch.testing.assert_close(a, b, msg=f"the cache at step {i}, tensor {j}")
