"""Shared blocks (``FXPROBE_DYNAMO_REGIONS=shared``) for calls with a key/value cache
(``frontends/dynamo_blocks_cache.py``): each layer's cache entry read and written around one
op per layer, the layer's code captured once for every layer. Sequences of cached calls
(a padded prefill, one-token steps on the same cache, an edit during a step, a new prompt
length with a new cache, ``generate()`` twice) against the whole capture (the variable unset)
and the untapped model; caches the shared op does not handle traced in place."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import transformers as tf
from canonical_support import DECODER, TOKENS
from torch import nn

import fxprobe
from fxprobe.frontends.dynamo_blocks import _MISS, Blocks, block_call
from fxprobe.frontends.dynamo_blocks_cache import KV

LAYERS = 2


def _llama() -> nn.Module:
    torch.manual_seed(0)
    return tf.LlamaForCausalLM(tf.LlamaConfig(
        **{**DECODER, "num_hidden_layers": LAYERS}, **TOKENS)).eval()


def _tap(model: nn.Module, mode: str | None, monkeypatch: pytest.MonkeyPatch,
         ops: Any = None) -> Any:
    if mode is None:
        monkeypatch.delenv("FXPROBE_DYNAMO_REGIONS", raising=False)
    else:
        monkeypatch.setenv("FXPROBE_DYNAMO_REGIONS", mode)
    return fxprobe.tap(model, ops=ops or fxprobe.where(lambda s: True), tracer="dynamo")


def _region(tapped: Any) -> Any:
    return tapped._lifecycle().program.dynamo[""]


def _kv_calls(tapped: Any) -> list[int]:
    """Per graph around the blocks captured so far, its calls of a shared block with the
    block's cache entry."""
    graphs = [c.gm.graph.find_nodes(op="call_function", target=block_call)
              for c in _region(tapped).captured]
    return [sum(KV in n.kwargs for n in calls) for calls in graphs if calls]


def _cache(out: Any) -> Any:
    return out.cache if hasattr(out, "cache") else out.past_key_values


def _same_cache(a: Any, b: Any, exact: bool = False) -> None:
    """Each layer's entry of cache ``a`` as of ``b``: its state, its keys and values (equal
    where ``exact``: two captures; close against the eager model)."""
    assert [type(x) for x in a.layers] == [type(x) for x in b.layers]
    for x, y in zip(a.layers, b.layers, strict=True):
        assert (x.is_initialized, x.device) == (y.is_initialized, y.device)
        for t, u in ((x.keys, y.keys), (x.values, y.values)):
            assert torch.equal(t, u) if exact else torch.testing.assert_close(t, u) is None


def _steps() -> list[tuple[str, dict[str, Any]]]:
    """A padded prefill of batch 2, two one-token steps on its cache (the second with an
    edit; a new prompt length with a new cache: ``generate()`` below)."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(2, 100, (2, 7), generator=g)
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, :3] = 0
    out = [("prefill", {"input_ids": ids, "attention_mask": mask})]
    for i in range(2):
        mask = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1)
        out.append((f"step{i}", {"input_ids": torch.randint(2, 100, (2, 1), generator=g),
                                 "attention_mask": mask}))
    return out


def _half(_site: Any, v: torch.Tensor) -> torch.Tensor:
    return v * 0.5


def _drive(model: nn.Module, tapped: Any | None) -> list[tuple[Any, dict[str, Any], Any]]:
    """Run the steps on ``tapped`` (or, None, on ``model`` with a hook making the edit):
    per step the logits, the tapped values and the cache after it."""
    runs = []
    cache = None
    for name, kw in _steps():
        args = {**kw, "cache": cache} if cache is not None else dict(kw)
        with torch.no_grad():
            if tapped is None:
                handle = model.model.layers[0].register_forward_hook(
                    lambda m, a, o: _half(None, o)) if name == "step1" else None
                out = model(**args)
                if handle is not None:
                    handle.remove()
                taps: dict[str, Any] = {}
            elif name == "step1":
                with tapped.intervene({"blocks.0.resid_post": _half}):
                    out = tapped(**args)
                taps = dict(tapped.taps)
            else:
                out = tapped(**args)
                taps = dict(tapped.taps)
        cache = _cache(out)
        runs.append((out.logits, taps, cache))
    return runs


def test_cached_sequence_as_the_whole_capture_and_the_model(
        monkeypatch: pytest.MonkeyPatch) -> None:
    model = _llama()
    ref = _drive(_llama(), None)
    runs, sites = {}, {}
    for mode in ("marked", "shared"):
        tapped = _tap(model, mode, monkeypatch)
        runs[mode] = _drive(model, tapped)
        sites[mode] = {s.name: s.canonical for s in tapped.known_sites()}
        if mode == "shared":  # the layers ran as shared ops with their cache entries
            assert _kv_calls(tapped) == [LAYERS, LAYERS]  # prefill, and a step
        assert not any("forward" in m.__dict__ for m in model.modules())  # model untouched
    whole, shared = sites["marked"], sites["shared"]
    calls = {f"model.layers.{L}" for L in range(LAYERS)}  # the op of each shared block
    assert set(shared) - set(whole) == calls and set(whole) <= set(shared)
    # Every canonical name, the stream between blocks named on the calls (what each returns)
    stream = ("resid_pre", "resid_post")
    assert {n: tuple(c for c in cs if not c.endswith(stream)) for n, cs in shared.items()
            if n not in calls} == {n: tuple(c for c in cs if not c.endswith(stream))
                                   for n, cs in whole.items()}
    by_name = [{c: n for n, cs in names.items() for c in cs} for names in (whole, shared)]
    assert set(by_name[0]) == set(by_name[1]) >= {
        f"blocks.{L}.{r}" for L in range(LAYERS)
        for r in ("attn.k", "attn.v", "attn.pattern", "resid_pre", "resid_post")}
    for step, (w, s, r) in enumerate(zip(runs["marked"], runs["shared"], ref, strict=True)):
        torch.testing.assert_close(s[0], r[0], msg=f"step {step}")
        assert torch.equal(s[0], w[0]), step
        _same_cache(s[2], r[2])
        _same_cache(s[2], w[2], exact=True)
        assert set(s[1]) - set(w[1]) <= calls, step
        for name, value in w[1].items():
            # An edit of blocks.0.resid_post is made on the block's call when shared: the
            # block's own add (the site of that name when whole) holds the value before it.
            if step == 2 and "blocks.0.resid_post" in whole.get(name, ()):
                assert torch.equal(s[1][name] * 0.5, value)
            elif isinstance(value, torch.Tensor):
                assert torch.equal(s[1][name], value), (step, name)
        for c, name in by_name[0].items():
            if isinstance(w[1].get(name), torch.Tensor):
                assert torch.equal(s[1][by_name[1][c]], w[1][name]), (step, c)



def test_run_with_cache_on_a_cached_step(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _llama()
    tapped = _tap(model, "shared", monkeypatch, ops="blocks.*.resid_post")
    ids = torch.randint(2, 100, (1, 6), generator=torch.Generator().manual_seed(5))
    nxt = torch.tensor([[7]])
    got: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        out = tapped(input_ids=ids)
        out2, values = tapped.run_with_cache(input_ids=nxt, cache=_cache(out),
                                             names="blocks.*.attn.k")
        r1 = model(input_ids=ids)
        hooks = [model.model.layers[L].self_attn.k_proj.register_forward_hook(
            lambda m, a, o, L=L: got.__setitem__(f"blocks.{L}.attn.k", o.clone()))
            for L in range(LAYERS)]
        r2 = model(input_ids=nxt, cache=_cache(r1))
        for h in hooks:
            h.remove()
    torch.testing.assert_close(out2.logits, r2.logits)
    _same_cache(_cache(out2), _cache(r2))
    # k after the rotary embedding, for the new token: as the model's cache holds it
    for L in range(LAYERS):
        k = values[f"blocks.{L}.attn.k"]
        assert torch.equal(k[:, :, -1:], _cache(r2).layers[L].keys[:, :, -1:]), L
        assert got[f"blocks.{L}.attn.k"].shape[1] == 1


def test_generate_twice_and_the_block_captured_once(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _llama()
    tapped = _tap(model, "shared", monkeypatch, ops="blocks.*.resid_post")
    looked_up = []  # whether each layer call ran its graph without dynamo's frame (warm)
    cached = Blocks.cached

    def counted(self: Blocks, *args: Any) -> Any:
        out = cached(self, *args)
        looked_up.append(out is not _MISS)
        return out
    monkeypatch.setattr(Blocks, "cached", counted)
    g = torch.Generator().manual_seed(9)
    for length in (5, 8):  # a second generate(): a new cache, a new prompt length
        prompt = torch.randint(2, 100, (1, length), generator=g)
        with torch.no_grad():
            expected = model.generate(prompt, max_new_tokens=4, do_sample=False)
            tokens = tapped.generate(prompt, max_new_tokens=4, do_sample=False)
        assert torch.equal(tokens, expected), length
    assert _kv_calls(tapped) == [LAYERS, LAYERS]  # every prompt, then every step
    # Warm steps look the layer's graph up by dynamo's guards (dynamo_blocks.Blocks.cached):
    # the tokens above are equal with it.
    assert sum(looked_up) >= len(looked_up) - 4 * LAYERS, looked_up
    # The layer's code: one graph before its entry holds keys, one after, for every layer.
    blocks = [c for c in _region(tapped).captured
              if not c.gm.graph.find_nodes(op="call_function", target=block_call)]
    assert len(blocks) == 2, [c.frame for c in blocks]
    assert all(len(c.versions) == LAYERS for c in blocks)


def test_caches_the_op_does_not_hold_are_traced_in_place(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A sliding-window cache layer (Mistral with ``sliding_window``) and a ``StaticCache``:
    the layers are traced in place, values as the model's."""
    torch.manual_seed(0)
    model = tf.MistralForCausalLM(tf.MistralConfig(
        **{**DECODER, "num_hidden_layers": 2}, sliding_window=4, **TOKENS)).eval()
    tapped = _tap(model, "shared", monkeypatch, ops="blocks.*.resid_post")
    ids = torch.randint(2, 100, (1, 6), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        out = tapped(input_ids=ids)
        ref = model(input_ids=ids)
        assert type(_cache(ref).layers[0]).__name__ == "DynamicSlidingWindowLayer"
        torch.testing.assert_close(out.logits, ref.logits)
        out2 = tapped(input_ids=torch.tensor([[4]]), cache=_cache(out))
        ref2 = model(input_ids=torch.tensor([[4]]), cache=_cache(ref))
        torch.testing.assert_close(out2.logits, ref2.logits)
        assert not any(_kv_calls(tapped))
        static = tf.StaticCache(config=model.config, max_cache_len=16)
        static_ref = tf.StaticCache(config=model.config, max_cache_len=16)
        out3 = tapped(input_ids=ids, cache=static)
        ref3 = model(input_ids=ids, cache=static_ref)
    torch.testing.assert_close(out3.logits, ref3.logits)
    for a, b in zip(static.layers, static_ref.layers, strict=True):
        assert torch.equal(a.keys, b.keys)
    assert not any(_kv_calls(tapped))


def test_gpt2_whose_blocks_take_the_cache_by_position(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    model = tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=64,
                                             **TOKENS)).eval()
    tapped = _tap(model, "shared", monkeypatch, ops="blocks.*.resid_post")
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(2, 100, (1, 5), generator=g)
    with torch.no_grad():
        expected = model.generate(prompt, max_new_tokens=4, do_sample=False)
        tokens = tapped.generate(prompt, max_new_tokens=4, do_sample=False)
    assert torch.equal(tokens, expected)
    assert _kv_calls(tapped) == [2, 2]
    with torch.no_grad():
        ids = torch.randint(2, 100, (1, 6), generator=g)
        out, ref = tapped(input_ids=ids), model(input_ids=ids)
        step = torch.tensor([[3]])
        out2, ref2 = tapped(input_ids=step, cache=_cache(out)), model(input_ids=step,
                                                                       cache=_cache(ref))
    torch.testing.assert_close(out2.logits, ref2.logits)
    _same_cache(_cache(out2), _cache(ref2))
    assert all(n == 2 for n in _kv_calls(tapped))


def test_calls_with_and_without_a_cache_in_turn(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a cache, with one (a prefill and a step), without again at a new length: each
    layer's output (``blocks.L.resid_post``, on the layer's call) as a hook that clones."""
    model = _llama()
    tapped = _tap(model, "shared", monkeypatch, ops="blocks.*.resid_post")
    g = torch.Generator().manual_seed(4)
    calls: list[dict[str, Any]] = [
        {"input_ids": torch.randint(2, 100, (1, 6), generator=g), "use_cache": False},
        {"input_ids": torch.randint(2, 100, (1, 6), generator=g)},
        {"input_ids": torch.randint(2, 100, (1, 1), generator=g)},
        {"input_ids": torch.randint(2, 100, (1, 9), generator=g), "use_cache": False}]
    cache = ref_cache = None
    for i, kw in enumerate(calls):
        got: dict[int, torch.Tensor] = {}
        hooks = [model.model.layers[L].register_forward_hook(
            lambda m, a, o, L=L, got=got: got.__setitem__(L, o.clone()))
            for L in range(LAYERS)]
        with torch.no_grad():
            ref = model(**kw, **({"cache": ref_cache} if i == 2 else {}))
        for h in hooks:
            h.remove()
        with torch.no_grad():
            out = tapped(**kw, **({"cache": cache} if i == 2 else {}))
        torch.testing.assert_close(out.logits, ref.logits)
        names = {c: s.name for s in tapped.known_sites() for c in s.canonical}
        for L in range(LAYERS):
            assert torch.equal(tapped.taps[names[f"blocks.{L}.resid_post"]], got[L]), (i, L)
        if i == 1:
            cache, ref_cache = _cache(out), _cache(ref)
        if i == 2:
            _same_cache(_cache(out), _cache(ref))
    assert _kv_calls(tapped) == [0, LAYERS, LAYERS]  # without (any length), prefill, step
