"""Canonical names resolved per captured graph, driven through sequences of calls of several
kinds (no cache, a cache, ``generate()``): each call edits and reads the site its own graph gave
the name, and a name its graph gives no node (the canonical pass recognises only part of some
graphs) still names the site the other graphs gave it. References: an untapped copy with
forward hooks, run through the same sequence."""

from __future__ import annotations

import copy

import pytest
import torch

import fxprobe

tf = pytest.importorskip("transformers")

_IDS = torch.tensor([[5, 6, 7, 8]])


def _gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    config = tf.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=50,
                           bos_token_id=0, eos_token_id=0)
    return tf.GPT2LMHeadModel(config).eval()


def _llama() -> torch.nn.Module:
    torch.manual_seed(0)
    return tf.LlamaForCausalLM(tf.LlamaConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=48, vocab_size=50, bos_token_id=0, eos_token_id=0)).eval()


def _generate(model: torch.nn.Module) -> torch.Tensor:
    return model.generate(_IDS, max_new_tokens=3, do_sample=False, pad_token_id=0)


@pytest.mark.parametrize("build", [_gpt2, _llama], ids=["gpt2", "llama"])
@torch.no_grad()
def test_an_edit_of_the_logits_applies_at_every_step_of_generate(build: object) -> None:
    """generate()'s first forward keeps only the last position's logits, a graph in which the
    canonical pass names no ``logits``: the site the plain forward named keeps the name, and
    the edit applies there too (it was dropped at the first token)."""
    model = build()  # type: ignore[operator]
    bias = torch.zeros(50)
    bias[7] = 100.0
    ref = copy.deepcopy(model)
    ref.lm_head.register_forward_hook(lambda mod, args, out: out + bias)
    want = _generate(ref)
    assert want[0, 4:].tolist() == [7, 7, 7]
    torch._dynamo.reset()
    tapped = fxprobe.tap(model, ops="blocks.0.resid_post", tracer="dynamo")
    tapped(input_ids=_IDS)  # the plain forward names the logits
    _generate(tapped)  # a generate() without the block
    with tapped.intervene({"logits": lambda site, v: v + bias}):
        got = _generate(tapped)
    assert got.tolist() == want.tolist()
    assert _generate(tapped).tolist() == _generate(copy.deepcopy(model)).tolist()  # and off


def _t5() -> torch.nn.Module:
    torch.manual_seed(0)
    return tf.T5ForConditionalGeneration(tf.T5Config(
        vocab_size=50, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
        num_heads=4, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
        dropout_rate=0.0)).eval()


@torch.no_grad()
def test_t5_an_edit_of_the_values_applies_at_a_cached_decoder_step() -> None:
    model = _t5()
    ref = copy.deepcopy(model)
    layer = ref.decoder.block[1].layer
    # The reference: the value projections steered; a cache then keeps the steered values,
    # which reads as the kernel reading every position steered once.
    for attention in (layer[0].SelfAttention, layer[1].EncDecAttention):
        attention.v.register_forward_hook(lambda mod, args, out: out + 0.5)
    enc, dec, nxt = torch.tensor([[5, 6, 7, 8, 9]]), torch.tensor([[0, 3, 4]]), torch.tensor([[6]])

    def steps(call: object) -> list[torch.Tensor]:
        out = [call(input_ids=enc, decoder_input_ids=dec, use_cache=False)]  # type: ignore[operator]
        first = call(input_ids=enc, decoder_input_ids=dec, use_cache=True)  # type: ignore[operator]
        out += [first, call(input_ids=enc, decoder_input_ids=nxt,  # type: ignore[operator]
                            past_key_values=first.past_key_values, use_cache=True)]
        return [o.logits for o in out]

    want = steps(ref)
    torch._dynamo.reset()
    tapped = fxprobe.tap(model, ops=torch.nn.Embedding, tracer="dynamo")

    def edited(**kwargs: object) -> object:
        with tapped.intervene({"decoder.blocks.1.*attn.v": lambda site, v: v + 0.5}):
            return tapped(**kwargs)

    for i, (got, expected) in enumerate(zip(steps(edited), want, strict=True)):
        torch.testing.assert_close(got, expected, msg=f"call {i}")


@torch.no_grad()
def test_llama_an_edit_of_the_kernels_values_applies_once_in_every_graph_of_generate() -> None:
    """After calls of every kind (no cache, a cache, a step), an edit of ``blocks.1.attn.v``
    around generate() applies once per forward, at the site each graph gives the name: never
    also at a site another graph gave it (a graph that names it elsewhere keeps it there).
    The reference: the eager kernel written out with the edit inside it."""
    from test_review_percall import _attention

    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    model = _llama()
    model.config._attn_implementation = "eager"
    steer = {"blocks.1.attn.v": lambda v: v + 0.5}
    ref = copy.deepcopy(model)
    original = llama.eager_attention_forward
    llama.eager_attention_forward = _attention(steer, {})
    try:
        want = ref.generate(_IDS, max_new_tokens=2, do_sample=False, pad_token_id=0,
                            output_logits=True, return_dict_in_generate=True)
    finally:
        llama.eager_attention_forward = original
    torch._dynamo.reset()
    tapped = fxprobe.tap(model, ops="blocks.1.attn.[kv]", tracer="dynamo", keep="all")
    tapped(input_ids=_IDS, use_cache=False)
    past = tapped(input_ids=_IDS, use_cache=True).past_key_values
    tapped(input_ids=torch.tensor([[9]]), past_key_values=past)
    with tapped.intervene({"blocks.1.attn.v": lambda site, v: steer["blocks.1.attn.v"](v)}):
        got = tapped.generate(_IDS, max_new_tokens=2, do_sample=False, pad_token_id=0,
                              output_logits=True, return_dict_in_generate=True)
    assert got.sequences.tolist() == want.sequences.tolist()
    for i, (a, b) in enumerate(zip(got.logits, want.logits, strict=True)):
        torch.testing.assert_close(a, b, msg=f"token {i}")
    # Each kept forward of generate() reads the values its kernel read: the whole cache,
    # edited, as many positions as that forward's cache held.
    for i, frame in enumerate(tapped.history[-2:]):
        assert frame["blocks.1.attn.v"].shape[2] == _IDS.shape[1] + i, f"forward {i}"
