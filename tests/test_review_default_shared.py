"""Review of shared blocks (``FXPROBE_DYNAMO_REGIONS=shared``) as every Hugging Face decoder
would get them by default: sequences of calls against independent references (the untapped
model's eager output, forward hooks that clone or edit on an untapped copy). These probes found
no wrong value; they stay as regression tests of sequences not covered elsewhere."""

from __future__ import annotations

import copy

import pytest
import torch
from reference import hooked
from torch import nn

import fxprobe

transformers = pytest.importorskip("transformers")


def _llama(layers: int = 3) -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(num_hidden_layers=layers, hidden_size=32,
                                   intermediate_size=64, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=100)
    return transformers.LlamaForCausalLM(cfg).eval()


def _ids(b: int, s: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 100, (b, s), generator=torch.Generator().manual_seed(seed))


def _out(fn):
    """A hook's edit of a module's output (the first element of a tuple) by ``fn(site, v)``."""
    def edit(o):
        return (fn(None, o[0]), *o[1:]) if isinstance(o, tuple) else fn(None, o)
    return edit


def _half(s, v):
    return v * 0.5 + 0.1


def _minus(s, v):
    return v - 0.2


def _double(s, v):
    return v * 2


KEEP = ("model.layers.1", "model.layers.3.mlp", "model.layers.2.self_attn.o_proj")


def _check(tapped, ref, x, edits):
    with torch.no_grad():
        want, kept = hooked(ref, lambda x=x: ref(x, use_cache=False), edits=edits, keep=KEEP)
        got = tapped(x, use_cache=False)
    assert torch.equal(got.logits, want.logits)
    assert torch.equal(tapped.taps["blocks.1.resid_post"], kept["model.layers.1"][0])
    assert torch.equal(tapped.taps["blocks.3.mlp_out"], kept["model.layers.3.mlp"][0])
    assert torch.equal(tapped.taps["model.layers.2.self_attn.o_proj"],
                       kept["model.layers.2.self_attn.o_proj"][0])


def test_edit_blocks_nested_raising_then_plain_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    """Edits of a layer's call, an op inside a layer and a sublayer's output, in blocks one
    after another and nested (the same site twice: inner applied after outer), with new
    batches and lengths; a block whose edit raises, a block the user's code leaves by a raise;
    every later plain call unedited, every kept value as a cloning hook's."""
    monkeypatch.setenv("FXPROBE_DYNAMO_REGIONS", "shared")
    model = _llama(4)
    ref = copy.deepcopy(model)
    tapped = fxprobe.tap(model, ops=["blocks.*.resid_post", "blocks.*.mlp_out",
                                     "model.layers.*.self_attn.o_proj"], tracer="dynamo")
    _check(tapped, ref, _ids(2, 5), {})
    with tapped.intervene({"blocks.1.resid_post": _half}):
        _check(tapped, ref, _ids(2, 5), {"model.layers.1": _out(_half)})
        with tapped.intervene({"model.layers.2.self_attn.o_proj": _minus}):
            both = {"model.layers.1": _out(_half),
                    "model.layers.2.self_attn.o_proj": _out(_minus)}
            _check(tapped, ref, _ids(1, 7, 1), both)
            with tapped.intervene({"blocks.1.resid_post": _double}):
                _check(tapped, ref, _ids(1, 7, 2), {
                    **both, "model.layers.1": _out(lambda s, v: _double(s, _half(s, v)))})
        _check(tapped, ref, _ids(3, 4, 3), {"model.layers.1": _out(_half)})
    _check(tapped, ref, _ids(3, 6, 4), {})

    def boom(s, v):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"), torch.no_grad(), tapped.intervene(
            {"blocks.3.mlp_out": boom, "blocks.0.resid_post": _half}):
        tapped(_ids(2, 5), use_cache=False)
    _check(tapped, ref, _ids(2, 5, 5), {})
    _check(tapped, ref, _ids(1, 3, 6), {})
    with tapped.intervene({"blocks.3.mlp_out": _double}):
        _check(tapped, ref, _ids(2, 9, 7), {"model.layers.3.mlp": _out(_double)})
    with pytest.raises(KeyError), tapped.intervene({"blocks.0.resid_post": _half}):
        raise KeyError("the user's")
    _check(tapped, ref, _ids(2, 5, 8), {})
    names = ["blocks.2.resid_post", "model.layers.1", "blocks.0.mlp_out",
             "model.layers.3.mlp.down_proj"]
    x = _ids(2, 5, 9)
    with torch.no_grad():
        out, cache = tapped.run_with_cache(x, names=names, use_cache=False)
        want, kept = hooked(ref, lambda x=x: ref(x, use_cache=False), keep=(
            "model.layers.2", "model.layers.1", "model.layers.0.mlp", "model.layers.3.mlp"))
    assert torch.equal(out.logits, want.logits)
    for name, path in zip(names, ["model.layers.2", "model.layers.1", "model.layers.0.mlp",
                                  "model.layers.3.mlp"], strict=True):
        assert torch.equal(cache[name], kept[path][0]), name


def test_modes_switched_between_taps_of_one_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """Shared, marked, shared again: three taps of one model alive at once, called in turn
    with edits at different sites and new shapes, each as hooks on the untapped model."""
    model = _llama(3)
    ref = copy.deepcopy(model)
    taps = []
    for mode in ["shared", "1", "shared"]:
        monkeypatch.setenv("FXPROBE_DYNAMO_REGIONS", mode)
        taps.append(fxprobe.tap(model, ops=["blocks.*.resid_post", "blocks.*.mlp_out"],
                                tracer="dynamo"))
    for rnd in range(2):
        for i, tapped in enumerate(taps):
            x = _ids(2, 4 + i + rnd, i)
            site, path = [("blocks.1.resid_post", "model.layers.1"),
                          ("blocks.2.mlp_out", "model.layers.2.mlp")][(i + rnd) % 2]
            with torch.no_grad():
                with tapped.intervene({site: _half}):
                    got = tapped(x, use_cache=False)
                want, kept = hooked(ref, lambda x=x: ref(x, use_cache=False),
                                    keep=("model.layers.0", "model.layers.2.mlp"),
                                    edits={path: _out(_half)})
            assert torch.equal(got.logits, want.logits), (rnd, i)
            assert torch.equal(tapped.taps["blocks.0.resid_post"], kept["model.layers.0"][0])
            assert torch.equal(tapped.taps["blocks.2.mlp_out"], kept["model.layers.2.mlp"][0])
            with torch.no_grad():
                assert torch.equal(tapped(x, use_cache=False).logits,
                                   ref(x, use_cache=False).logits), (rnd, i)


def test_grads_with_edits_then_other_dtypes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Train mode: the loss and every parameter's gradient as the eager model's, plain and with
    edits of a layer's call and of an op inside a layer; then float64 and bfloat16 calls
    (plain and edited) as hooks on the untapped model."""
    monkeypatch.setenv("FXPROBE_DYNAMO_REGIONS", "shared")
    model = _llama(3)
    ref = copy.deepcopy(model)
    tapped = fxprobe.tap(model, ops=["blocks.*.resid_post", "blocks.*.mlp_out"],
                         tracer="dynamo")
    model.train()
    ref.train()
    x = _ids(2, 5)
    for edits in [{}, {"blocks.1.resid_post": _half, "blocks.0.mlp_out": _half}]:
        model.zero_grad()
        ref.zero_grad()
        if edits:
            with tapped.intervene(edits):
                got = tapped(x, labels=x, use_cache=False)
        else:
            got = tapped(x, labels=x, use_cache=False)
        got.loss.backward()
        paths = {"blocks.1.resid_post": "model.layers.1", "blocks.0.mlp_out": "model.layers.0.mlp"}
        want, _ = hooked(ref, lambda: ref(x, labels=x, use_cache=False),
                         edits={paths[k]: _out(fn) for k, fn in edits.items()})
        want.loss.backward()
        assert torch.equal(got.loss, want.loss)
        for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(),
                                     strict=True):
            assert p.grad is not None, name
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)
    model.eval()
    ref.eval()
    for dtype in [torch.float64, torch.bfloat16]:
        model.to(dtype)
        ref.to(dtype)
        x = _ids(2, 5, 9)
        with torch.no_grad():
            got = tapped(x, use_cache=False).logits
            want, kept = hooked(ref, lambda x=x: ref(x, use_cache=False),
                                keep=("model.layers.1", "model.layers.2.mlp"))
            assert got.dtype == dtype and torch.equal(got, want.logits)
            assert torch.equal(tapped.taps["blocks.1.resid_post"], kept["model.layers.1"][0])
            assert torch.equal(tapped.taps["blocks.2.mlp_out"], kept["model.layers.2.mlp"][0])
            with tapped.intervene({"blocks.1.resid_post": _half}):
                got = tapped(x, use_cache=False).logits
            want, _ = hooked(ref, lambda x=x: ref(x, use_cache=False),
                             edits={"model.layers.1": _out(_half)})
            assert torch.equal(got, want.logits), dtype


def test_generate_with_edits_in_turn(monkeypatch: pytest.MonkeyPatch) -> None:
    """Greedy generate with a KV cache: plain, with an edit of a layer's call, with an edit of
    an op inside another layer, plain again: every step's logits as the eager model's with
    the same edits by hooks."""
    monkeypatch.setenv("FXPROBE_DYNAMO_REGIONS", "shared")
    model = _llama(3)
    ref = copy.deepcopy(model)
    tapped = fxprobe.tap(model, ops=["blocks.*.resid_post", "blocks.*.mlp_out"],
                         tracer="dynamo")
    kw = dict(max_new_tokens=5, do_sample=False, output_logits=True,
              return_dict_in_generate=True)
    x = _ids(1, 4)
    plain = ref.generate(x, **kw)
    for site, path in [(None, None), ("blocks.1.resid_post", "model.layers.1"),
                       ("blocks.0.mlp_out", "model.layers.0.mlp"), (None, None)]:
        if site is None:
            got, want = tapped.generate(x, **kw), plain
        else:
            with tapped.intervene({site: _double}):
                got = tapped.generate(x, **kw)
            want, _ = hooked(ref, lambda: ref.generate(x, **kw), edits={path: _out(_double)})
            assert not torch.equal(want.logits[0], plain.logits[0])
        assert torch.equal(got.sequences, want.sequences), site
        for a, b in zip(got.logits, want.logits, strict=True):
            assert torch.equal(a, b), site
