"""A decoder step with a KV cache and one new position (T5, dynamo): the step's graph gives
every canonical name the cached prefill's graph gives, to the node that plays the role there.
Self-attention keys and values are what the kernel reads (the cache with the new position);
the cross-attention's are the encoder's keys and values the kernel reads from the cache (graph
inputs of the step). Driven through a sequence: no cache, a cached prefill, two one-position
steps, a new prompt. References: hooks that clone on an untapped copy, transformers' eager
attention (``output_attentions``), and the eager kernel written out with the edit inside it."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import fxprobe
from fxprobe.core.errors import SiteNotRunError

tf = pytest.importorskip("transformers")
t5 = pytest.importorskip("transformers.models.t5.modeling_t5")

_ENC, _DEC = torch.tensor([[5, 6, 7, 8, 9]]), torch.tensor([[0, 3, 4]])
_PROMPT, _START = torch.tensor([[9, 4, 3, 2]]), torch.tensor([[0, 8]])
_STEPS = (torch.tensor([[6]]), torch.tensor([[7]]))
_LABELS = ("no cache", "prefill", "step 1", "step 2", "new prompt")
_B = "decoder.blocks.1."


def _t5(attn: str = "sdpa") -> torch.nn.Module:
    torch.manual_seed(0)
    model = tf.T5ForConditionalGeneration(tf.T5Config(
        vocab_size=50, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_decoder_layers=2,
        num_heads=4, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
        dropout_rate=0.0)).eval()
    model.set_attn_implementation(attn)
    return model


def _sequence(call: Callable[..., Any], **extra: Any) -> Iterator[Any]:
    """The calls, in order, each step reading the cache the call before it returned."""
    yield call(input_ids=_ENC, decoder_input_ids=_DEC, use_cache=False, **extra)
    out = call(input_ids=_ENC, decoder_input_ids=_DEC, use_cache=True, **extra)
    yield out
    for ids in _STEPS:
        out = call(input_ids=_ENC, decoder_input_ids=ids, past_key_values=out.past_key_values,
                   use_cache=True, **extra)
        yield out
    yield call(input_ids=_PROMPT, decoder_input_ids=_START, use_cache=True, **extra)


def _heads(x: torch.Tensor) -> torch.Tensor:
    """A projection's output (batch, positions, 32) as (batch, heads, positions, 8)."""
    return x.view(x.shape[0], x.shape[1], 4, 8).transpose(1, 2).clone()


def _given(tapped: Any, names: set[str]) -> set[str]:
    """The names among ``names`` whose site ran in the last forward."""
    found = set()
    for name in names:
        try:
            tapped.taps[name]
        except SiteNotRunError:
            continue
        found.add(name)
    return found


@pytest.fixture(scope="module")
def tapped() -> Any:
    """T5 tapped at every canonical name (the graphs ``tap()`` built serve per-call blocks on
    them): one set of compiled graphs for both tests (the point versions of unselected sites
    are tests/test_review_canonical_graphs.py's)."""
    torch._dynamo.reset()
    return fxprobe.tap(_t5(), ops=["decoder.*", "encoder.*", "logits"], tracer="dynamo")


@torch.no_grad()
def test_a_step_gives_every_name_the_prefill_gives_with_the_values_hooks_read(
        tapped: Any) -> None:
    ref = _t5("eager")  # the same weights; its eager attention returns the patterns
    block = ref.decoder.block[1]
    seen: dict[str, torch.Tensor] = {}

    def keep(name: str, fn: Callable[[Any], torch.Tensor]) -> Callable[..., None]:
        return lambda mod, args, out: seen.__setitem__(name, fn(out))

    self_attn, cross = block.layer[0].SelfAttention, block.layer[1].EncDecAttention
    for name, mod in (("q", self_attn.q), ("k", self_attn.k), ("v", self_attn.v),
                      ("cross_v", cross.v)):
        mod.register_forward_hook(keep(name, _heads))
    block.register_forward_hook(keep("resid_post", lambda out: out[0].clone()))
    want = []
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    for i, out in enumerate(_sequence(ref, output_attentions=True)):
        if _LABELS[i] in ("prefill", "new prompt"):
            keys, values = [], []
        # With a cache, the kernel reads every position since the prompt; without, this call's.
        keys, values = [*keys, seen["k"]], [*values, seen["v"]]
        want.append({
            "logits": out.logits, _B + "attn.q": seen["q"], _B + "attn.k": torch.cat(keys, 2),
            _B + "attn.v": torch.cat(values, 2), _B + "resid_post": seen["resid_post"],
            # the step runs no projection of the encoder: the cached values, from the prefill
            _B + "cross_attn.v": seen["cross_v"],
            _B + "attn.pattern": out.decoder_attentions[1],
            _B + "cross_attn.pattern": out.cross_attentions[1]})
    names: set[str] = set()
    for i, out in enumerate(_sequence(tapped)):
        label = _LABELS[i]
        # The names this call's graph gave its own nodes (``Frame.aliases``, docs/design.md).
        own = set(tapped.taps._frame.aliases)
        if label == "prefill":
            names = {c for s in tapped.sites for c in s.canonical}
            assert {_B + "cross_attn.v", _B + "attn.v", "encoder.blocks.0.attn.v"} <= names
            assert own == names
        if names:  # (a) the one-position steps give every name the prefill gives
            assert own == names, (label, sorted(names - own), sorted(own - names))
            assert _given(tapped, names) == names, label  # and each name reads this call's
        for name, expected in want[i].items():  # (b) at the node that plays the role there
            got = out.logits if name == "logits" else tapped.taps[name]
            torch.testing.assert_close(got, expected, msg=f"{label}: {name}")
        if label.startswith("step"):  # the encoder's keys and values the kernel reads: cached
            cache = out.past_key_values.cross_attention_cache.layers[1]
            assert torch.equal(tapped.taps[_B + "cross_attn.v"], cache.values), label
            assert torch.equal(tapped.taps[_B + "cross_attn.k"], cache.keys), label


def _ramp(v: torch.Tensor) -> torch.Tensor:
    """An edit that depends on the position: the positions must line up."""
    return v * 1.5 + torch.arange(v.shape[2], dtype=v.dtype)[:, None] * 0.25


def _shift(v: torch.Tensor) -> torch.Tensor:
    return v - 0.75


_EDITS: tuple[dict[str, Callable[[torch.Tensor], torch.Tensor]], ...] = (
    {}, {}, {"attn.v": _ramp, "cross_attn.v": _shift}, {"cross_attn.v": _ramp},
    {"attn.v": _shift, "cross_attn.v": _ramp})
"""Per call of the sequence, the edits of block 1's values: none before the steps; both at
the first step, one at the second, both at the new prompt's prefill."""


def _snapshot(cache: Any) -> dict[str, torch.Tensor]:
    """The tensors of an encoder-decoder cache as they are now (a step writes into it)."""
    if cache is None:
        return {}
    return {f"{part} {i} {what}": getattr(layer, what).clone()
            for part in ("self_attention_cache", "cross_attention_cache")
            for i, layer in enumerate(getattr(cache, part).layers)
            for what in ("keys", "values")}


@contextlib.contextmanager
def _edited_kernel(ref: torch.nn.Module, edits: dict[str, Callable[[torch.Tensor], torch.Tensor]]
                   ) -> Iterator[None]:
    """T5's eager attention with ``edits`` of block 1's values (``attn.v``, ``cross_attn.v``)
    inside the kernel of ``ref``: after the cache was written, before the kernel reads them."""
    layer = ref.decoder.block[1].layer
    roles = {id(layer[0].SelfAttention): "attn.v", id(layer[1].EncDecAttention): "cross_attn.v"}
    original = t5.eager_attention_forward

    def attend(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               *args: Any, **kwargs: Any) -> Any:
        role = roles.get(id(module))
        if role in edits:
            value = edits[role](value)
        return original(module, query, key, value, *args, **kwargs)

    t5.eager_attention_forward = attend
    try:
        yield
    finally:
        t5.eager_attention_forward = original


@torch.no_grad()
def test_an_edit_of_the_values_at_a_step_is_what_the_kernel_reads_and_the_cache_keeps_none(
        tapped: Any) -> None:
    """(c) An edit of ``attn.v`` and ``cross_attn.v`` at a step applies once, to the values
    the kernel reads (the cache with the new position; the encoder's values from the cache),
    as inside the eager kernel; the cache keeps what the model computed, so the next step
    reads it unedited. Reference: T5's eager attention written out with the edit inside."""
    ref = _t5("eager")
    calls = iter(_EDITS)

    def stepwise(**kwargs: Any) -> Any:
        with _edited_kernel(ref, next(calls)):
            return ref(**kwargs)

    want = [(o.logits, _snapshot(o.past_key_values)) for o in _sequence(stepwise)]
    edits = iter(_EDITS)

    def edited(**kwargs: Any) -> Any:
        table = {_B + name: (lambda site, v, fn=fn: fn(v)) for name, fn in next(edits).items()}
        if not table:
            return tapped(**kwargs)
        with tapped.intervene(table):
            return tapped(**kwargs)

    for label, out, (logits, cache) in zip(_LABELS, _sequence(edited), want, strict=True):
        torch.testing.assert_close(out.logits, logits, msg=label)
        got = _snapshot(out.past_key_values)
        assert got.keys() == cache.keys(), label
        for key, expected in cache.items():  # the cache holds what the model computed
            torch.testing.assert_close(got[key], expected, msg=f"{label}: {key}")
    # And off: a call without a block after the edited ones reads the model as it is.
    plain = _t5()
    again = tapped(input_ids=_PROMPT, decoder_input_ids=_START, use_cache=True)
    torch.testing.assert_close(again.logits, plain(input_ids=_PROMPT, decoder_input_ids=_START,
                                                   use_cache=True).logits)


@torch.no_grad()
def test_generate_edits_the_decoders_values_at_every_step(tapped: Any) -> None:
    """generate() runs the decoder alone (the encoder's output given), a graph with one stack,
    which cross-attends: ``decoder.``, as where both stacks run (it was ``blocks.L``: an edit
    of ``decoder.blocks.1.cross_attn.v`` missed every forward of generate())."""
    edits = {"attn.v": _shift, "cross_attn.v": _ramp}
    ref = _t5("eager")
    kwargs: dict[str, Any] = dict(max_new_tokens=3, do_sample=False, output_logits=True,
                                  return_dict_in_generate=True)

    def cache() -> Any:  # one that grows to the decoder's depth (the encoder has 1 layer)
        return tf.EncoderDecoderCache(tf.DynamicCache(), tf.DynamicCache())

    with _edited_kernel(ref, edits):
        want = ref.generate(_ENC, past_key_values=cache(), **kwargs)
    # A forward of both stacks first (generate() runs the encoder outside the graphs, so its
    # forwards alone find no encoder.* site that the fixture selects).
    tapped(input_ids=_ENC, decoder_input_ids=_DEC)
    with tapped.intervene({_B + n: (lambda site, v, fn=fn: fn(v)) for n, fn in edits.items()}):
        got = tapped.generate(_ENC, past_key_values=cache(), **kwargs)
    assert got.sequences.tolist() == want.sequences.tolist()
    for i, (a, b) in enumerate(zip(got.logits, want.logits, strict=True)):
        torch.testing.assert_close(a, b, msg=f"token {i}")
