"""A reviewer's sequences of per-call runs and cross-rank reductions, each step against an
independent reference: hooks on an untapped copy of the model (a re-implementation of the
attention kernel for ``attn.q/k/v/scores/pattern``), statistics of the ranks' values
concatenated, computed with torch.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as tdist
import torch.nn.functional as F
from gloo_job import assert_ok, verdicts
from torch import nn

import fxprobe

tf = pytest.importorskip("transformers")
llama = pytest.importorskip("transformers.models.llama.modeling_llama")


def _flip(value: torch.Tensor) -> torch.Tensor:
    """Negate index 1 of dim 1 (a position, or a head of ``attn.q/k/v/scores/pattern``)."""
    value = value.clone()
    value[:, 1] = -value[:, 1]
    return value


def _attention(edit: dict[str, Callable[[torch.Tensor], torch.Tensor]],
               kept: dict[str, torch.Tensor]) -> Callable[..., Any]:
    """Llama's eager attention, written out: each named value (``blocks.L.attn.q``) edited
    by ``edit``'s function for it and kept in ``kept``."""
    def attend(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, scaling: float, dropout: float = 0.0,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        def at(name: str, v: torch.Tensor) -> torch.Tensor:
            name = f"blocks.{module.layer_idx}.attn.{name}"
            v = edit[name](v) if name in edit else v
            kept[name] = v.detach().clone()
            return v
        query, key, value = at("q", query), at("k", key), at("v", value)
        groups = module.num_key_value_groups
        keys, values = llama.repeat_kv(key, groups), llama.repeat_kv(value, groups)
        w = torch.matmul(query, keys.transpose(2, 3)) * scaling
        if attention_mask is not None:
            w = w + attention_mask
        w = at("pattern", F.softmax(at("scores", w), dim=-1, dtype=torch.float32).to(query.dtype))
        return torch.matmul(w, values).transpose(1, 2).contiguous(), w
    return attend


def _reference(model: nn.Module, ids: torch.Tensor, edits: tuple[str, ...] = ()
               ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    kept: dict[str, torch.Tensor] = {}
    original = llama.eager_attention_forward
    llama.eager_attention_forward = _attention({n: _flip for n in edits}, kept)
    try:
        return model(input_ids=ids).logits, kept
    finally:
        llama.eager_attention_forward = original


@torch.no_grad()
def test_gqa_attention_sites_per_call_over_shapes_and_dtypes() -> None:
    """Llama with 2 key/value heads for 4 query heads: ``attn.k/v`` are per key/value head
    (before the repeat); each block edits and each cache agree with the kernel written out,
    across sequence lengths, batch sizes and a ``double()`` of the tapped module."""
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=48, vocab_size=50, bos_token_id=0, eos_token_id=0)).eval()
    model.config._attn_implementation = "eager"
    ref = copy.deepcopy(model)
    tapped = fxprobe.tap(model, ops="blocks.0.resid_post", tracer="dynamo")
    g = torch.Generator().manual_seed(1)
    names = [f"blocks.{i}.attn.{x}" for i in range(2) for x in ("q", "k", "v", "scores",
                                                                 "pattern")]
    assert torch.equal(_reference(ref, torch.tensor([[3, 4, 5]]))[0],
                       model(input_ids=torch.tensor([[3, 4, 5]])).logits)
    for step, (b, t) in enumerate([(2, 6), (3, 9), (1, 5)]):
        if step == 2:
            tapped.double()
            ref.double()
        ids = torch.randint(2, 50, (b, t), generator=g)
        _, kept = _reference(ref, ids)
        _, cache = tapped.run_with_cache(input_ids=ids, names="blocks.*.attn.*")
        for name in names:  # a masked score is -inf or the dtype's lowest: the same softmax
            # attn.pattern is the float32 softmax, before Llama's .to(query.dtype): float32
            # in a float64 model (the same values, reported in the review, left alone)
            assert cache[name].dtype == kept[name].dtype or name.endswith("pattern"), name
            assert torch.allclose(cache[name].to(kept[name].dtype).clamp(min=-1e9),
                                  kept[name].clamp(min=-1e9), atol=1e-5), (step, name)
        assert cache["blocks.1.attn.k"].shape[1] == 2  # the model's own key/value heads
        for name in names[step::3]:
            want, _ = _reference(ref, ids, (name,))
            with tapped.intervene({name: lambda s, v: _flip(v)}):
                assert torch.allclose(tapped(input_ids=ids).logits, want, atol=1e-5,
                                      equal_nan=True), name  # a negated mask: NaN
        assert torch.equal(tapped(input_ids=ids).logits, ref(input_ids=ids).logits)


@torch.no_grad()
def test_resid_mid_edit_reaches_the_mlp_and_the_residual() -> None:
    """``resid_mid`` is the residual stream between attention and MLP: an edit feeds both
    ``ln_2`` and the skip connection (the reference edits the attention output by the
    difference, resid_mid = resid_pre + attn_out); nested under a ``resid_pre`` block."""
    torch.manual_seed(0)
    model = tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=3, n_embd=16, n_head=2, vocab_size=50,
                                             bos_token_id=0, eos_token_id=0)).eval()
    model.config._attn_implementation = "eager"
    ref = copy.deepcopy(model)
    tapped = fxprobe.tap(model, ops="blocks.0.resid_post", tracer="auto")
    block = ref.transformer.h[1]
    x: dict[str, torch.Tensor] = {}

    def pre(m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        x["in"] = args[0] if args else kwargs["hidden_states"]

    def post(m: nn.Module, args: Any, out: Any) -> Any:
        return (_flip(out[0] + x["in"]) - x["in"], *out[1:])

    g = torch.Generator().manual_seed(2)
    for b, t in [(2, 5), (1, 8), (3, 4)]:
        ids = torch.randint(2, 50, (b, t), generator=g)
        handles = [block.register_forward_pre_hook(pre, with_kwargs=True),
                   block.attn.register_forward_hook(post)]
        want = ref(input_ids=ids).logits
        h0 = ref.transformer.h[0].register_forward_pre_hook(
            lambda m, a: (_flip(a[0]), *a[1:]))
        nested = ref(input_ids=ids).logits
        for h in [*handles, h0]:
            h.remove()
        with tapped.intervene({"blocks.1.resid_mid": lambda s, v: _flip(v)}):
            assert torch.allclose(tapped(input_ids=ids).logits, want, atol=1e-5)
        with tapped.intervene({"blocks.1.resid_mid": lambda s, v: _flip(v)}), \
                tapped.intervene({"blocks.0.resid_pre": lambda s, v: _flip(v)}):
            assert torch.allclose(tapped(input_ids=ids).logits, nested, atol=1e-5)
        assert torch.equal(tapped(input_ids=ids).logits, ref(input_ids=ids).logits)


# --- fxprobe.dist.reduce_stats on 2 gloo ranks ---------------------------------------------

class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def _idle_everywhere_then_on_one_rank(rank: int) -> list[str]:
    """No rank has run (dynamo: no site known), then rank 0 runs and rank 1 does not: the
    idle layout verified on the first call made rank 1 skip the layout check that rank 0
    made, and the collectives of two sizes aborted gloo (the process died)."""
    said = []
    torch.manual_seed(0)
    model = _Net().eval()
    tapped = fxprobe.tap(model, ops=["a", "b"], tracer="dynamo")
    assert fxprobe.dist.reduce_stats(tapped) == {}
    x = torch.randn(3 + 4 * rank, 8, generator=torch.Generator().manual_seed(rank))
    if rank == 0:
        tapped(x)
    try:
        fxprobe.dist.reduce_stats(tapped)
    except fxprobe.ConfigError as e:
        said.append(str(e))
    if rank == 1:
        tapped(x)
    got = fxprobe.dist.reduce_stats(tapped)
    every: list[Any] = [None] * 2
    tdist.all_gather_object(every, model.a(x).detach())
    want = torch.cat(every).double()
    s = got["a"]
    assert s.shape == tuple(want.shape) and s.numel == want.numel(), s
    for field, value in (("mean", want.mean()), ("std", want.std()), ("min", want.min()),
                         ("max", want.max())):
        assert math.isclose(getattr(s, field), value.item(), rel_tol=1e-9, abs_tol=1e-12), (
            field, getattr(s, field), value)
    return said


# run on 2 gloo ranks by tests/gloo_job.py, in the session's one job
SCENARIOS = {"idle_everywhere_then_on_one_rank":
             lambda rank, path: _idle_everywhere_then_on_one_rank(rank)}


@pytest.fixture(scope="module")
def gloo_verdicts(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    return verdicts(request.config, "test_review_percall")


def test_reduce_stats_after_a_call_where_every_rank_was_idle(
        gloo_verdicts: list[dict[str, Any]]) -> None:
    for rank, said in enumerate(assert_ok(gloo_verdicts, "idle_everywhere_then_on_one_rank")):
        assert len(said) == 1 and "rank 1 ran no forward" in said[0], (rank, said)


@torch.no_grad()
def test_an_edit_of_the_cached_values_applies_once_per_step() -> None:
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=48, vocab_size=50, bos_token_id=0, eos_token_id=0)).eval()
    model.config._attn_implementation = "eager"
    ref = copy.deepcopy(model)
    tapped = fxprobe.tap(model, ops="blocks.0.resid_post", tracer="dynamo")
    ids, new = torch.tensor([[5, 6, 7, 8]]), torch.tensor([[9]])
    name = "blocks.1.attn.v"
    kept: dict[str, torch.Tensor] = {}
    original = llama.eager_attention_forward
    llama.eager_attention_forward = _attention({name: _flip}, kept)  # each step's kernel
    try:
        first = ref(input_ids=ids, use_cache=True)
        want = ref(input_ids=new, past_key_values=first.past_key_values).logits
    finally:
        llama.eager_attention_forward = original
    with tapped.intervene({name: lambda s, v: _flip(v)}):
        out = tapped(input_ids=ids, use_cache=True)
        assert torch.allclose(out.logits, first.logits, atol=1e-5)  # the prompt: right
        got = tapped(input_ids=new, past_key_values=out.past_key_values).logits
    assert torch.allclose(got, want, atol=1e-5)
