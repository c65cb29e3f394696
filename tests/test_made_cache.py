"""The key/value cache a transformers model would make for a call without one is made by
fxprobe before dynamo traces the call (``frontends/dynamo_kv.py``): never while dynamo
traces, and the call computes and returns what the model does. Sequences of calls (a first
call, a new length, steps on the returned cache, ``use_cache=False``, a cache given by
position or by the deprecated keyword, train mode) against the untapped model, in every
mode of the repeated layers."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import transformers as tf
from canonical_support import DECODER, TOKENS
from torch import nn
from transformers.cache_utils import DynamicCache

import fxprobe

MODES = ["marked", "0", None]


def _llama() -> nn.Module:
    torch.manual_seed(0)
    return tf.LlamaForCausalLM(tf.LlamaConfig(**DECODER, **TOKENS)).eval()


def _tap(model: nn.Module, mode: str | None, monkeypatch: pytest.MonkeyPatch) -> Any:
    if mode is None:
        monkeypatch.delenv("FXPROBE_DYNAMO_REGIONS", raising=False)
    else:
        monkeypatch.setenv("FXPROBE_DYNAMO_REGIONS", mode)
    return fxprobe.tap(model, ops="blocks.*.resid_post", tracer="dynamo")


_MADE: list[bool] = []
"""One entry per ``DynamicCache`` made: whether dynamo was tracing when it was (a global:
dynamo drops an append to a list a closure holds while it traces the maker)."""


@pytest.fixture
def made(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    init = DynamicCache.__init__

    def counted(self: Any, *args: Any, **kwargs: Any) -> None:
        _MADE.append(torch.compiler.is_compiling())
        init(self, *args, **kwargs)

    _MADE.clear()
    monkeypatch.setattr(DynamicCache, "__init__", counted)
    return _MADE


def _same_cache(a: Any, b: Any) -> None:
    assert a is not None and b is not None
    assert len(a.layers) == len(b.layers)
    for x, y in zip(a.layers, b.layers, strict=True):
        assert type(x) is type(y) and x.is_initialized == y.is_initialized
        torch.testing.assert_close(x.keys, y.keys)
        torch.testing.assert_close(x.values, y.values)


def _ids(n: int, seed: int, batch: int = 1) -> torch.Tensor:
    return torch.randint(2, 100, (batch, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("mode", MODES)
def test_calls_without_a_cache_then_steps_on_the_one_returned(
        mode: str | None, made: list[bool], monkeypatch: pytest.MonkeyPatch) -> None:
    model, twin = _llama(), _llama()  # the reference's hooks stay off the tapped model
    tapped = _tap(model, mode, monkeypatch)
    for n, seed in ((7, 1), (5, 2)):  # a first call, then a new length
        ids = _ids(n, seed)
        with torch.no_grad():
            ref = twin(ids)
            made.clear()
            out = tapped(ids)
        assert made == [False], "the cache is made once, before dynamo traces the call"
        torch.testing.assert_close(out.logits, ref.logits)
        _same_cache(out.cache, ref.cache)
        cache, ref_cache = out.cache, ref.cache
        for step in range(2):  # steps on the cache each returned, an edit on the second
            token = _ids(1, 10 + step)
            last: list[torch.Tensor] = []
            keep = twin.model.layers[1].register_forward_hook(
                lambda m, a, o, last=last: last.append(o.detach().clone()))
            with torch.no_grad():
                if step:
                    handle = twin.model.layers[0].register_forward_hook(
                        lambda m, a, o: o * 0.5)
                    ref = twin(token, cache=ref_cache)
                    handle.remove()
                    with tapped.intervene({"blocks.0.resid_post": lambda s, v: v * 0.5}):
                        out = tapped(token, cache=cache)
                else:
                    ref, out = twin(token, cache=ref_cache), tapped(token, cache=cache)
            keep.remove()
            torch.testing.assert_close(out.logits, ref.logits)
            _same_cache(out.cache, ref.cache)
            assert out.cache is cache  # the step's own cache, filled
            torch.testing.assert_close(tapped.taps["blocks.1.resid_post"], last[0])
    ids = _ids(6, 3)
    with torch.no_grad():  # no cache asked for: none made, none returned, as the model
        ref, out = twin(ids, use_cache=False), tapped(ids, use_cache=False)
    assert out.cache is None and ref.cache is None
    torch.testing.assert_close(out.logits, ref.logits)


def test_the_values_tapped_on_a_made_cache_call_are_the_models(
        made: list[bool], monkeypatch: pytest.MonkeyPatch) -> None:
    model, twin = _llama(), _llama()
    tapped = _tap(model, "shared", monkeypatch)
    ids = _ids(7, 4)
    seen: dict[str, torch.Tensor] = {}
    for i, layer in enumerate(twin.model.layers):
        layer.register_forward_hook(lambda m, a, o, i=i: seen.__setitem__(
            f"blocks.{i}.resid_post", o.detach().clone()))
    with torch.no_grad():
        twin(ids)
    with torch.no_grad():
        tapped(ids)
    assert made[-1] is False
    assert len(tapped.taps) == len(seen)  # keyed by site; read here by canonical name
    for name, value in seen.items():
        torch.testing.assert_close(tapped.taps[name], value)


@pytest.mark.parametrize("how", ["position", "keyword", "deprecated keyword"])
def test_a_cache_the_call_gives_is_the_one_used(
        how: str, made: list[bool], monkeypatch: pytest.MonkeyPatch) -> None:
    model = _llama()
    tapped = _tap(model, None, monkeypatch)
    prompt, token = _ids(6, 5), _ids(1, 6)
    with torch.no_grad():
        ref_cache, cache = model(prompt).cache, tapped(prompt).cache
        ref = model(token, cache=ref_cache)
        made.clear()
        if how == "position":  # LlamaForCausalLM.forward(input_ids, attention_mask,
            out = tapped(token, None, None, cache)  # position_ids, cache, ...)
        elif how == "keyword":
            out = tapped(token, cache=cache)
        else:
            with warnings.catch_warnings():  # transformers: past_key_values is deprecated
                warnings.simplefilter("ignore", FutureWarning)
                out = tapped(token, past_key_values=cache)
    assert made == []
    assert out.cache is cache
    torch.testing.assert_close(out.logits, ref.logits)
    _same_cache(cache, ref.cache)


def test_train_mode_and_a_model_that_makes_another_cache_make_their_own(
        made: list[bool], monkeypatch: pytest.MonkeyPatch) -> None:
    model = _llama().train()
    tapped = _tap(model, None, monkeypatch)
    ids = _ids(5, 7)
    ref = model(ids)
    made.clear()
    out = tapped(ids)
    assert made and all(made), "train mode: the model makes its cache itself"
    torch.testing.assert_close(out.logits, ref.logits)
    out.logits.sum().backward()
    # GPT-2 may wrap its cache (cross-attention): its forward is not the two lines.
    torch.manual_seed(0)
    gpt2 = tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=2, n_embd=32, n_head=2, **TOKENS)).eval()
    tapped = _tap(gpt2, None, monkeypatch)
    with torch.no_grad():
        ref = gpt2(ids)
        made.clear()
        out = tapped(ids)
    assert made and all(made)
    torch.testing.assert_close(out.logits, ref.logits)
    _same_cache(out.past_key_values, ref.past_key_values)


def test_the_decoder_itself_called_with_cache_none(
        made: list[bool], monkeypatch: pytest.MonkeyPatch) -> None:
    """``LlamaModel`` tapped on its own, called as its ``...ForCausalLM`` calls it (``cache=None``
    given): the cache it would make is made before the capture."""
    model, twin = _llama(), _llama()
    tapped = _tap(model.model, None, monkeypatch)
    for n, seed in ((6, 8), (4, 9)):
        ids = _ids(n, seed)
        with torch.no_grad():
            ref = twin.model(ids, cache=None, use_cache=None)
            made.clear()
            out = tapped(ids, cache=None, use_cache=None)
        assert made == [False]
        torch.testing.assert_close(out.last_hidden_state, ref.last_hidden_state)
        _same_cache(out.cache, ref.cache)


def test_a_cache_given_as_none_by_position_is_made_in_its_slot(
        made: list[bool], monkeypatch: pytest.MonkeyPatch) -> None:
    model, twin = _llama(), _llama()
    tapped = _tap(model, None, monkeypatch)
    region = tapped._lifecycle().program.dynamo[""]
    ids = _ids(5, 11)
    args, kwargs = region.made_cache.call((ids, None, None, None), {})
    assert "cache" not in kwargs and isinstance(args[3], DynamicCache)  # no second value
    with torch.no_grad():
        ref = twin(ids, None, None, None)
        made.clear()
        out = tapped(ids, None, None, None)
    assert made == [False]
    torch.testing.assert_close(out.logits, ref.logits)
    _same_cache(out.cache, ref.cache)
