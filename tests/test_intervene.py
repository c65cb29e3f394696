"""Per-call interventions (``tapped.intervene``) and caching (``tapped.run_with_cache``).

References: forward hooks on the eager model that make the same edit or clone the value, and
hand-computed values for a small plain model with in-place ops. Re-capture is counted on the
tapped module's dynamo captures and on torch dynamo's own frame counter.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxprobe

tf = pytest.importorskip("transformers")


def _gpt2(attn: str = "eager") -> nn.Module:
    config = tf.GPT2Config(n_layer=3, n_embd=32, n_head=2, vocab_size=100, n_positions=64,
                           bos_token_id=0, eos_token_id=0)
    config._attn_implementation = attn
    torch.manual_seed(0)
    return tf.GPT2LMHeadModel(config).eval()


def _zero_pos(pos: int) -> Any:
    def fn(site: fxprobe.Site | None, value: torch.Tensor) -> torch.Tensor:
        value = value.clone()
        value[:, pos] = 0
        return value
    return fn


def _hooked(model: nn.Module, edits: dict[str, Any], ids: torch.Tensor) -> torch.Tensor:
    """The model's logits with forward hooks making ``edits`` on module outputs."""
    handles = []
    for path, fn in edits.items():
        def hook(m: nn.Module, args: Any, out: Any, fn: Any = fn) -> Any:
            if isinstance(out, tuple):
                return (fn(None, out[0]), *out[1:])
            return fn(None, out)
        handles.append(model.get_submodule(path).register_forward_hook(hook))
    try:
        return model(input_ids=ids).logits
    finally:
        for h in handles:
            h.remove()


def _captures() -> int:
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


@pytest.fixture(scope="module")
def gpt2() -> tuple[nn.Module, Any, torch.Tensor]:
    model = _gpt2()
    ids = torch.randint(2, 100, (2, 9), generator=torch.Generator().manual_seed(1))
    tapped = fxprobe.tap(model, ops="transformer.h.0.add_1", tracer="dynamo")
    with torch.no_grad():
        tapped(input_ids=ids)
    return model, tapped, ids


@torch.no_grad()
def test_intervene_equals_a_hook_inside_the_block_only_and_captures_nothing_again(
        gpt2: Any) -> None:
    model, tapped, ids = gpt2
    plain = model(input_ids=ids).logits
    graphs, frames = tapped.dynamo_info[0].graphs, _captures()
    for layer, pos in [(1, 3), (2, 0), (0, 8)]:
        ref = _hooked(model, {f"transformer.h.{layer}": _zero_pos(pos)}, ids)
        assert not torch.equal(ref, plain)
        with tapped.intervene({f"transformer.h.{layer}": _zero_pos(pos)}):
            assert torch.equal(tapped(input_ids=ids).logits, ref)
        assert torch.equal(tapped(input_ids=ids).logits, plain)
    # a glob, a module type, a function: the same contract
    ref = _hooked(model, {f"transformer.h.{i}.mlp": _zero_pos(2) for i in range(3)}, ids)
    with tapped.intervene({"transformer.h.*.mlp": _zero_pos(2)}):
        assert torch.equal(tapped(input_ids=ids).logits, ref)
    assert tapped.dynamo_info[0].graphs == graphs
    assert _captures() == frames


@torch.no_grad()
def test_run_with_cache_equals_cloning_hooks(gpt2: Any) -> None:
    model, tapped, ids = gpt2
    store: dict[str, torch.Tensor] = {}
    paths = [f"transformer.h.{i}.{m}" for i in range(3) for m in ("mlp", "attn.c_attn")]
    paths += ["transformer.ln_f", "lm_head"]
    handles = [model.get_submodule(p).register_forward_hook(
        lambda m, a, o, p=p: store.__setitem__(p, o.clone()) and None) for p in paths]
    try:
        ref = model(input_ids=ids).logits
    finally:
        for h in handles:
            h.remove()
    out, cache = tapped.run_with_cache(input_ids=ids, names=paths)
    assert torch.equal(out.logits, ref)
    assert set(cache) == set(paths)
    for p in paths:
        assert torch.equal(cache[p], store[p]), p
    everything = tapped.run_with_cache(input_ids=ids)[1]
    assert len(everything) > 100 and torch.equal(everything["lm_head"], store["lm_head"])
    with pytest.raises(fxprobe.UnknownSiteError, match="transformer.h.0.mlp"):
        cache["transformer.h.0.mlpp"]
    with pytest.raises(fxprobe.SelectorError, match="nothing.here"):
        tapped.run_with_cache(input_ids=ids, names="nothing.here*")


@torch.no_grad()
def test_nested_blocks_compose_and_an_exception_leaves_cleanly(gpt2: Any) -> None:
    model, tapped, ids = gpt2
    plain = model(input_ids=ids).logits

    def double(site: Any, value: torch.Tensor) -> torch.Tensor:
        return value * 2

    # both on one site: the outer block's function first, then the inner's
    ref = _hooked(model, {"transformer.h.0": lambda s, v: double(s, _zero_pos(1)(s, v)),
                          "transformer.h.2": _zero_pos(4)}, ids)
    with tapped.intervene({"transformer.h.0": _zero_pos(1)}):
        with tapped.intervene({"transformer.h.0": double, "transformer.h.2": _zero_pos(4)}):
            assert torch.equal(tapped(input_ids=ids).logits, ref)
            out, cache = tapped.run_with_cache(input_ids=ids, names="transformer.h.0")
            assert torch.equal(out.logits, ref)
            assert torch.equal(cache["transformer.h.0"][:, 1], torch.zeros_like(
                cache["transformer.h.0"][:, 1]))
            assert tapped.taps.replaced == {"transformer.h.0", "transformer.h.2"}
        assert torch.equal(tapped(input_ids=ids).logits,
                           _hooked(model, {"transformer.h.0": _zero_pos(1)}, ids))
    with pytest.raises(RuntimeError, match="boom"):
        with tapped.intervene({"transformer.h.1": _zero_pos(0)}):
            raise RuntimeError("boom")
    assert tapped._state.pipeline.per_call.table is None
    assert torch.equal(tapped(input_ids=ids).logits, plain)


@torch.no_grad()
def test_other_threads_are_not_intervened(gpt2: Any) -> None:
    model, tapped, ids = gpt2
    plain = model(input_ids=ids).logits
    seen: list[torch.Tensor] = []
    with tapped.intervene({"transformer.h.1": _zero_pos(0)}):
        worker = threading.Thread(target=lambda: seen.append(tapped(input_ids=ids).logits))
        worker.start()
        worker.join()
    assert torch.equal(seen[0], plain)


@torch.no_grad()
def test_bad_selectors_and_replacements_are_refused(gpt2: Any) -> None:
    model, tapped, ids = gpt2
    with pytest.raises(fxprobe.SelectorError, match="transformer.h.9"):
        tapped.intervene({"transformer.h.9": _zero_pos(0)}).__enter__()
    assert tapped._state.pipeline.per_call.table is None
    with pytest.raises(fxprobe.InterventionError, match="shape"):
        with tapped.intervene({"transformer.h.1": lambda s, v: v[:, :1]}):
            tapped(input_ids=ids)
    with pytest.raises(fxprobe.ConfigError, match="dict"):
        tapped.intervene([_zero_pos(0)])


@torch.no_grad()
def test_selectors_are_checked_after_the_first_forward_when_nothing_was_captured() -> None:
    model = _gpt2()
    ids = torch.randint(2, 100, (1, 6))
    tapped = fxprobe.tap(model, ops="transformer.h.0.add_1", tracer="dynamo")
    ref = _hooked(model, {"transformer.h.1": _zero_pos(2)}, ids)
    with tapped.intervene({"transformer.h.1": _zero_pos(2)}):  # sites unknown before
        assert torch.equal(tapped(input_ids=ids).logits, ref)
    fresh = fxprobe.tap(model, ops="transformer.h.0.add_1", tracer="dynamo")
    with pytest.raises(fxprobe.SelectorError, match="no.such"):
        with fresh.intervene({"no.such.site": _zero_pos(2)}):
            fresh(input_ids=ids)


@torch.no_grad()
def test_attention_patterns_per_call_need_them_selected_at_tap() -> None:
    model = _gpt2("sdpa")
    ids = torch.randint(2, 100, (1, 6))
    plain = fxprobe.tap(model, ops="transformer.h.0.add_1", tracer="dynamo")
    plain(input_ids=ids)
    with pytest.raises(fxprobe.InterventionError, match="attention_probs"):
        with plain.intervene({"transformer.h.0.attn.attention_probs": _zero_pos(0)}):
            pass
    tapped = fxprobe.tap(model, ops=fxprobe.attention_probs, tracer="dynamo")
    base = tapped(input_ids=ids).logits
    assert torch.equal(base, model(input_ids=ids).logits)

    def uniform(site: Any, p: torch.Tensor) -> torch.Tensor:
        keep = torch.ones_like(p).tril()
        return keep / keep.sum(-1, keepdim=True)

    with tapped.intervene({"transformer.h.1.attn.attention_probs": uniform}):
        edited = tapped(input_ids=ids).logits
    # reference: eager attention whose softmax is replaced by the same uniform pattern
    eager = _gpt2("eager")
    orig = torch.softmax
    calls = []

    def softmax(x: torch.Tensor, *a: Any, **k: Any) -> torch.Tensor:
        calls.append(1)
        p = orig(x, *a, **k)
        return uniform(None, p) if len(calls) == 2 else p

    torch.softmax = softmax  # type: ignore[assignment]
    F_softmax, F.softmax = F.softmax, softmax  # type: ignore[assignment]
    try:
        ref = eager(input_ids=ids).logits
    finally:
        torch.softmax, F.softmax = orig, F_softmax  # type: ignore[assignment]
    assert len(calls) == 3
    assert torch.allclose(edited, ref, atol=1e-5)
    assert (edited - base).abs().max() > 1e-4  # the edit changed the output


class _InPlace(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x) * 2
        y.relu_()                      # its result unused: code after reads y
        z = y.view(-1)
        y.add_(1.0)                    # overwrites what relu_ made
        return torch.sigmoid(z).reshape(-1, 8)


@torch.no_grad()
def test_a_plain_model_with_in_place_ops() -> None:
    torch.manual_seed(0)
    model = _InPlace().eval()
    x = torch.randn(3, 8)
    tapped = fxprobe.tap(model, ops="lin", tracer="dynamo")
    assert torch.equal(tapped(x), model(x))
    relu = "relu"  # y.relu_(), named by its op
    _, cache = tapped.run_with_cache(x, names=[relu, "lin"])
    lin = model.lin(x)
    assert torch.equal(cache["lin"], lin)
    assert torch.equal(cache[relu], (lin * 2).relu())  # copied before add_ overwrote it
    with tapped.intervene({relu: lambda s, v: -v}):  # written back into y, which code reads
        out = tapped(x)
    assert torch.equal(out, torch.sigmoid(-(lin * 2).relu() + 1.0))
    assert torch.equal(tapped(x), model(x))


def test_a_model_fx_traces_whole_is_edited_per_call_too() -> None:
    """It raised ConfigError (per-call edits reached dynamo's sites only); fx regions run
    their version with intervention points now (tests/test_intervene_frontends.py)."""
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    tapped = fxprobe.tap(model)
    x = torch.randn(2, 4)
    with tapped.intervene({"0": _zero_pos(0)}):
        out = tapped(x)
    handle = model[0].register_forward_hook(lambda m, a, o: _zero_pos(0)(None, o))
    ref = model(x)
    handle.remove()
    assert torch.equal(out, ref)
    assert torch.equal(tapped(x), model(x))


@torch.no_grad()
def test_canonical_names_select_per_call_and_read_the_cache(gpt2: Any) -> None:
    """A canonical name as an exact key of intervene() (it was looked up among site names
    only: SelectorError) and as a key of the cache run_with_cache returns."""
    model, tapped, ids = gpt2
    ref = _hooked(model, {"transformer.h.1": _zero_pos(2)}, ids)
    for key in ["blocks.1.resid_post", "blocks.2.resid_pre"]:  # one value, two roles
        with tapped.intervene({key: _zero_pos(2)}):
            assert torch.equal(tapped(input_ids=ids).logits, ref), key
    kept: list[torch.Tensor] = []
    handle = model.transformer.h[0].register_forward_hook(lambda m, a, o: kept.append(o.clone()))
    model(input_ids=ids)
    handle.remove()
    _, cache = tapped.run_with_cache(input_ids=ids, names="blocks.*.resid_post")
    assert list(cache) == [f"transformer.h.{i}" for i in range(3)]  # own names: the layers' calls
    assert torch.equal(cache["blocks.0.resid_post"], kept[0])
    assert cache["blocks.1.resid_pre"] is cache["transformer.h.0"]
    with pytest.raises(fxprobe.UnknownSiteError, match="blocks.1.resid_post"):
        cache["blocks.1.resid_psot"]
