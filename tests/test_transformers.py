"""Op-level taps inside HuggingFace transformers models through the dynamo frontend.

Tiny models from configs (random init, nothing downloaded). References: the eager model's
outputs, ``output_attentions=True`` under eager attention, forward hooks, and hand-patched
copies of the model.
"""

from __future__ import annotations

import copy
import inspect
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from reference import model_state, states_equal
from torch import nn

import fxprobe

tf = pytest.importorskip("transformers")

FAMILIES = ("gpt2", "bert", "llama", "t5")
ATTENTION = {  # attention modules in forward order, and the output_attentions fields
    "gpt2": (["transformer.h.0.attn", "transformer.h.1.attn"], ["attentions"]),
    "bert": (["encoder.layer.0.attention.self", "encoder.layer.1.attention.self"],
             ["attentions"]),
    "llama": (["model.layers.0.self_attn", "model.layers.1.self_attn"], ["attentions"]),
    "t5": (["encoder.block.0.layer.0.SelfAttention", "encoder.block.1.layer.0.SelfAttention",
            "decoder.block.0.layer.0.SelfAttention", "decoder.block.0.layer.1.EncDecAttention",
            "decoder.block.1.layer.0.SelfAttention", "decoder.block.1.layer.1.EncDecAttention"],
           ["encoder_attentions", "decoder_attentions", "cross_attentions"]),
}


def make(family: str, attn: str) -> nn.Module:
    """Two layers, hidden 32, vocabulary 100; the same weights for every ``attn``."""
    if family == "gpt2":
        config = tf.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=64,
                               bos_token_id=0, eos_token_id=0, pad_token_id=0)
        cls = tf.GPT2LMHeadModel
    elif family == "bert":
        config = tf.BertConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2,
                               intermediate_size=64, vocab_size=100, max_position_embeddings=64)
        cls = tf.BertModel
    elif family == "llama":
        config = tf.LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2,
                                num_key_value_heads=1, intermediate_size=64, vocab_size=100,
                                max_position_embeddings=64, bos_token_id=0, eos_token_id=0,
                                pad_token_id=0)
        cls = tf.LlamaForCausalLM
    else:
        config = tf.T5Config(num_layers=2, num_decoder_layers=2, d_model=32, d_ff=64,
                             num_heads=2, d_kv=16, vocab_size=100, decoder_start_token_id=0,
                             pad_token_id=0, eos_token_id=1)
        cls = tf.T5ForConditionalGeneration
    config._attn_implementation = attn
    torch.manual_seed(0)
    return cls(config).eval()


def inputs(family: str, length: int = 7, batch: int = 2, seed: int = 0) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, 100, (batch, length), generator=gen)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # left padding in the first row: the mask matters
    kw = {"input_ids": ids, "attention_mask": mask, "use_cache": False}
    if family == "t5":
        kw["decoder_input_ids"] = ids[:, : max(length - 2, 1)]
    if family == "bert":
        kw.pop("use_cache")
    return kw


def outputs_equal(a: Any, b: Any) -> bool:
    """Same ModelOutput class, same keys, every tensor bitwise equal."""
    if type(a) is not type(b) or list(a.keys()) != list(b.keys()):
        return False
    return all(
        torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
        for x, y in zip(a.values(), b.values(), strict=True))


@pytest.fixture(scope="module", params=[(f, a) for f in FAMILIES for a in ("eager", "sdpa")],
                ids=lambda p: f"{p[0]}-{p[1]}")
def tapped_family(request: pytest.FixtureRequest) -> Any:
    family, attn = request.param
    model = make(family, attn)
    before = model_state(model)
    ops = [F.softmax, torch.matmul] if attn == "eager" else [fxprobe.attention_probs]
    tapped = fxprobe.tap(model, ops=ops, tracer="dynamo")
    yield family, attn, model, tapped
    tapped.remove()
    assert states_equal(before, model_state(model))


def test_outputs_bitwise_equal_and_attention_equals_output_attentions(tapped_family: Any
                                                                      ) -> None:
    family, attn, model, tapped = tapped_family
    kw = inputs(family)
    with torch.no_grad():
        out = tapped(**kw)
        expected = model(**kw)
        # The same weights with eager attention; a separate model, because
        # output_attentions=True makes transformers install hooks on the model it runs.
        eager = make(family, "eager")
        assert all(torch.equal(p, q) for p, q in zip(
            eager.parameters(), model.parameters(), strict=True))
        reference = eager(**kw, output_attentions=True)
    assert outputs_equal(out, expected)
    paths, fields = ATTENTION[family]
    probs = [a for field in fields for a in getattr(reference, field)]
    if family == "t5":  # forward order: encoder, then per decoder layer self and cross
        enc, dec, cross = (list(getattr(reference, f)) for f in fields)
        probs = enc + [p for pair in zip(dec, cross, strict=True) for p in pair]
    suffix = "softmax" if attn == "eager" else "attention_probs"
    for path, p in zip(paths, probs, strict=True):
        got = tapped.taps[f"{path}.{suffix}"]
        if attn == "eager":
            assert torch.equal(got, p), path
            continue
        # Causal models: the two left-padded queries of row 0 may attend to no key. Eager
        # attention (a finite minimum as mask) spreads them evenly; SDPA gives them zeros.
        empty = torch.zeros(got.shape[:-1], dtype=torch.bool)
        if family in ("gpt2", "llama"):
            empty[0, :, :2] = True
        assert torch.equal(got[empty], torch.zeros_like(got[empty]))
        torch.testing.assert_close(got[~empty], p[~empty], rtol=0, atol=1e-5)
    assert all(s.how == "dynamo" for s in tapped.sites)
    assert any(s.name == f"{paths[0]}.matmul" for s in tapped.sites) or attn == "sdpa"


@pytest.fixture(scope="module")
def gpt2_sdpa() -> Any:
    model = make("gpt2", "sdpa")
    tapped = fxprobe.tap(model, ops=["transformer.h.1.ln_1", "*.attn.attention_probs"],
                         tracer="dynamo", keep="all")
    return model, tapped


def test_no_recompilation_across_sequence_lengths(gpt2_sdpa: Any) -> None:
    model, tapped = gpt2_sdpa
    seen = []
    lengths = [5, 9, 6, 12, 7]
    for i in range(20):
        kw = inputs("gpt2", length=lengths[i % 5], seed=i)
        with torch.no_grad():
            out = tapped(**kw)
            handle = model.transformer.h[1].ln_1.register_forward_hook(
                lambda m, a, o: seen.append(o.clone()))
            try:
                expected = model(**kw)
            finally:
                handle.remove()
        assert torch.equal(out.logits, expected.logits)
        assert torch.equal(tapped.taps["transformer.h.1.ln_1"], seen[-1])  # no stale guards
        if i == 1:
            after_two = tapped.dynamo_info[0].graphs
    assert tapped.dynamo_info[0].graphs == after_two


def test_generate_captures_every_step_without_recompiling(gpt2_sdpa: Any) -> None:
    model, tapped = gpt2_sdpa
    prompt = torch.randint(2, 100, (1, 6), generator=torch.Generator().manual_seed(3))
    steps: list[torch.Tensor] = []
    handle = model.transformer.h[1].ln_1.register_forward_hook(
        lambda m, a, o: steps.append(o.clone()))
    with torch.no_grad():
        try:
            expected = model.generate(prompt, max_new_tokens=6, do_sample=False)
        finally:
            handle.remove()
        for n in (4, 5):  # warm up: two prompt lengths, as dynamo specializes the first
            tapped.generate(prompt[:, :n], max_new_tokens=3, do_sample=False)
        graphs = tapped.dynamo_info[0].graphs
        before = len(tapped.history)  # keep="all": every forward so far
        tokens = tapped.generate(prompt, max_new_tokens=6, do_sample=False)
    assert torch.equal(tokens, expected)
    assert tapped.dynamo_info[0].graphs == graphs  # new lengths and steps reuse the graphs
    frames = tapped.history[before:]
    assert len(frames) == len(steps) == 6  # one frame per forward
    for frame, ref in zip(frames, steps, strict=True):
        assert torch.equal(frame["transformer.h.1.ln_1"], ref)
    shapes = [f["transformer.h.0.attn.attention_probs"].shape[-2:] for f in frames]
    assert shapes == [(6, 6)] + [(1, 7 + i) for i in range(5)]  # the KV cache grows


def test_kwargs_past_key_values_and_return_dict_pass_through(gpt2_sdpa: Any) -> None:
    model, tapped = gpt2_sdpa
    kw = inputs("gpt2")
    kw["use_cache"] = True
    with torch.no_grad():
        out = tapped(**kw)
        expected = model(**kw)
        as_tuple = tapped(**kw, return_dict=False)
    assert type(out) is type(expected) and torch.equal(out.logits, expected.logits)
    got_cache, ref_cache = out.past_key_values, expected.past_key_values
    assert type(got_cache) is type(ref_cache)
    for a, b in zip(got_cache.layers, ref_cache.layers, strict=True):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    assert isinstance(as_tuple, tuple) and torch.equal(as_tuple[0], expected.logits)
    step = {"input_ids": kw["input_ids"][:, -1:], "use_cache": True,
            "attention_mask": torch.cat([kw["attention_mask"], torch.ones(2, 1).long()], 1)}
    with torch.no_grad():
        nxt = tapped(**step, past_key_values=copy.deepcopy(ref_cache))
        nxt_ref = model(**step, past_key_values=copy.deepcopy(ref_cache))
    assert torch.equal(nxt.logits, nxt_ref.logits)
    assert tapped.taps["transformer.h.0.attn.attention_probs"].shape[-2:] == (1, 8)


def test_zero_an_attention_probability_and_patch_one_head() -> None:
    model = make("gpt2", "eager")
    kw = inputs("gpt2")

    def fn(site: fxprobe.Site, value: torch.Tensor) -> torch.Tensor | None:
        value = value.clone()
        if site.name == "transformer.h.0.attn.softmax":
            value[:, 1, 4, 3] = 0.0  # head 1: query 4 no longer attends to key 3
        else:  # transformer.h.1.attn.matmul_1: head 0's output (batch, head, seq, dim)
            value[:, 0] = 0.0
        return value

    tapped = fxprobe.tap(model, ops=["transformer.h.0.attn.softmax",
                                     "transformer.h.1.attn.matmul_1"], tracer="dynamo", fn=fn)
    # The hand-patched reference: F.softmax patched for its first call; head 0's 16 features
    # zeroed at the input of layer 1's output projection (c_proj sees the heads merged).
    patched = copy.deepcopy(model)
    real_softmax, calls = F.softmax, []

    def softmax_patched(*args: Any, **kw: Any) -> torch.Tensor:
        out = real_softmax(*args, **kw)
        calls.append(1)
        if len(calls) == 1:
            out = out.clone()
            out[:, 1, 4, 3] = 0.0
        return out

    def zero_head(m: nn.Module, args: Any) -> Any:
        h = args[0].clone()
        h[..., :16] = 0.0
        return (h,)

    patched.transformer.h[1].attn.c_proj.register_forward_pre_hook(zero_head)
    with torch.no_grad():
        out = tapped(**kw)
        try:
            torch.nn.functional.softmax = softmax_patched
            expected = patched(**kw)
        finally:
            torch.nn.functional.softmax = real_softmax
        plain = model(**kw)
    assert len(calls) == 2
    assert torch.equal(out.logits, expected.logits)
    assert not torch.equal(out.logits, plain.logits)


def test_grads_of_attention_probabilities() -> None:
    model = make("llama", "eager")
    kw = inputs("llama")
    tapped = fxprobe.tap(model, ops=["*.self_attn.softmax"], tracer="dynamo", grad=True)
    tapped(**kw).logits.square().sum().backward()
    reference = copy.deepcopy(model)
    ref = reference(**kw, output_attentions=True)
    for a in ref.attentions:
        a.retain_grad()
    ref.logits.square().sum().backward()
    for i, a in enumerate(ref.attentions):
        assert a.grad is not None and a.grad.abs().sum() > 0
        assert torch.equal(tapped.grads[f"model.layers.{i}.self_attn.softmax"], a.grad)
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert p.grad is not None and torch.equal(p.grad, q.grad)


def test_transformers_doc_examples_run() -> None:
    import pathlib
    import re

    doc = pathlib.Path(__file__).resolve().parent.parent / "docs" / "transformers.md"
    blocks = re.findall(r"```python\n(.*?)```", doc.read_text(), flags=re.S)
    assert len(blocks) >= 4
    scope: dict[str, Any] = {"__name__": "__docs__"}
    for i, code in enumerate(blocks):
        try:
            exec(compile(code, f"{doc.name}[{i}]", "exec"), scope)
        except Exception as e:  # name the block that failed
            raise AssertionError(f"{doc.name} example {i} failed: {e!r}\n{code}") from e
    assert list(scope["tapped"].taps) == ["transformer.h.0.attn.softmax",
                                          "transformer.h.1.attn.softmax"]


def test_the_default_tracer_reaches_gpt2s_attention_softmax() -> None:
    model = make("gpt2", "eager")
    kw = inputs("gpt2")
    tapped = fxprobe.tap(model, ops=F.softmax)  # tracer="auto": fx fails, dynamo captures
    with torch.no_grad():
        out = tapped(**kw)
        expected = model(**kw)
        reference = make("gpt2", "eager")(**kw, output_attentions=True)
    assert outputs_equal(out, expected)
    assert list(tapped.taps) == ["transformer.h.0.attn.softmax", "transformer.h.1.attn.softmax"]
    for i, probs in enumerate(reference.attentions):
        assert torch.equal(tapped.taps[f"transformer.h.{i}.attn.softmax"], probs)
    assert {s.how for s in tapped.sites} == {"dynamo"}
    assert tapped.fallbacks == () and tapped.dynamo_info[0].graphs >= 1


MODULES = ["transformer.h.0.mlp", "transformer.h.1", "transformer.h.0.ln_1",
           "transformer.h.1.attn.c_attn", "transformer.h.1.mlp.act"]


@pytest.mark.parametrize("tracer", ["dynamo", "auto"])
def test_module_calls_are_sites_under_dynamo_and_equal_hooks(tracer: str) -> None:
    model = make("gpt2", "eager")
    kw = inputs("gpt2")
    mlp = type(model.transformer.h[0].mlp)  # GPT2MLP
    ops = [mlp, *MODULES[1:]]
    tapped = fxprobe.tap(model, ops=ops, tracer=tracer, capture="both")
    if tracer == "auto":  # before the first forward: what fx and hooks know
        assert ("transformer.h.1", "hook") in [(s.name, s.how) for s in tapped.sites]
        assert "dynamo" not in {s.how for s in tapped.sites}
    outs: dict[str, torch.Tensor] = {}
    ins: dict[str, torch.Tensor] = {}
    paths = MODULES + ["transformer.h.1.mlp"]
    handles = []
    for path in paths:
        m = model.get_submodule(path)
        handles.append(m.register_forward_pre_hook(
            lambda m, a, p=path: ins.__setitem__(p, a[0].clone()) or None))
        handles.append(m.register_forward_hook(
            lambda m, a, o, p=path: outs.__setitem__(p, o.clone()) or None))
    with torch.no_grad():
        out = tapped(**kw)
        try:
            expected = model(**kw)
        finally:
            for h in handles:
                h.remove()
    assert outputs_equal(out, expected)
    assert sorted(s.name for s in tapped.sites) == sorted(paths)  # named as fx names them
    assert {s.how for s in tapped.sites} == {"dynamo"}
    for path in paths:
        got = tapped.taps[path]
        assert torch.equal(got.output, outs[path]), path
        assert torch.equal(got.inputs[0], ins[path]), path
    # A call of a module whose value is one tensor has a site; dropout of the attention
    # weights is not called under eager attention, and the first input of a block is the
    # hidden state whatever else it reads.
    assert len(tapped.taps["transformer.h.0.ln_1"].inputs) == 1  # not the weight and bias


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_generate_on_a_left_padded_batch_equals_the_models(family: str, attn: str) -> None:
    # transformers' generate() builds position_ids from the attention mask only for a forward
    # whose signature accepts them: the tapped module must show the model's.
    model = make(family, attn)
    tapped = fxprobe.tap(model, ops=F.softmax if attn == "eager" else fxprobe.attention_probs)
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(2, 100, (2, 6), generator=gen)
    mask = torch.ones_like(ids)
    ids[0, :3], mask[0, :3] = 0, 0  # the first row left-padded
    for sample in (False, True):
        kw = {"attention_mask": mask, "max_new_tokens": 4, "do_sample": sample,
              "output_scores": True, "return_dict_in_generate": True}
        with torch.no_grad():
            torch.manual_seed(1)
            expected = model.generate(ids, **kw)
            torch.manual_seed(1)
            got = tapped.generate(ids, **kw)
        assert torch.equal(got.sequences, expected.sequences), sample
        torch.testing.assert_close(got.scores, expected.scores)
    assert len(tapped.taps) == 2  # the last step's attention probabilities, both layers
    # What callers inspect is the model's.
    assert inspect.signature(tapped.forward) == inspect.signature(model.forward)
    assert tapped.config is model.config and tapped.generation_config is model.generation_config
    assert (tapped.can_generate(), tapped.main_input_name, tapped._supports_sdpa) == (
        model.can_generate(), model.main_input_name, model._supports_sdpa)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_an_edited_attention_pattern_under_sdpa_drives_the_output(family: str) -> None:
    model = make(family, "sdpa")
    kw = inputs(family)
    site = f"{ATTENTION[family][0][0]}.attention_probs"  # layer 0

    def edit(p: torch.Tensor) -> torch.Tensor:
        p = p.clone()
        p[:, 1, 4] = 0.0
        p[:, 1, 4, 3] = 1.0  # head 1: query 4 attends to key 3 alone
        return p

    edited = fxprobe.tap(model, ops=fxprobe.attention_probs, tracer="dynamo",
                         fn=lambda s, v: edit(v) if s.name == site else None)
    # The reference: the same weights with eager attention, whose first softmax (layer 0's
    # pattern) gets the same edit by hand.
    eager = make(family, "eager")
    real_softmax, calls = F.softmax, []

    def softmax_patched(*args: Any, **kwargs: Any) -> torch.Tensor:
        out = real_softmax(*args, **kwargs)
        calls.append(1)
        return edit(out) if len(calls) == 1 else out

    with torch.no_grad():
        out = edited(**kw).logits
        plain = model(**kw).logits
        try:
            torch.nn.functional.softmax = softmax_patched
            expected = eager(**kw).logits
        finally:
            torch.nn.functional.softmax = real_softmax
    assert len(calls) == 2 and edited.taps.replaced == {site}
    # Not at the padded positions, which attend to no key: SDPA gives them zeros, eager
    # attention an even spread.
    valid = kw["attention_mask"].bool()
    torch.testing.assert_close(out[valid], expected[valid])
    assert not torch.allclose(out, plain, atol=1e-3)
    # A pattern fn= leaves alone: SDPA's own output, bitwise.
    kept = fxprobe.tap(model, ops=fxprobe.attention_probs, tracer="dynamo", fn=lambda s, v: None)
    with torch.no_grad():
        assert torch.equal(kept(**kw).logits, plain) and kept.taps.replaced == set()


@torch.no_grad()
def test_generate_history_is_one_frame_per_forward_across_calls(gpt2_sdpa: Any) -> None:
    """The documented rule: ``keep="all"`` keeps every forward, so a second generate() call
    appends its steps; its frames are the last ``steps`` ones (``keep=N`` bounds them)."""
    model, _ = gpt2_sdpa
    tapped = fxprobe.tap(model, ops=fxprobe.attention_probs, tracer="dynamo", keep="all")
    ids = torch.randint(2, 100, (1, 5))
    tapped.generate(ids, max_new_tokens=3, do_sample=False)
    tapped.generate(ids[:, :4], max_new_tokens=2, do_sample=False)
    keys = [f["transformer.h.0.attn.attention_probs"].shape[-2:] for f in tapped.history]
    assert keys == [(5, 5), (1, 6), (1, 7), (4, 4), (1, 5)]
