"""One vocabulary, one layout: every canonical value has its documented shape on every family.

``attn.q/k/v`` are (batch, heads, positions, head dim) (the model's own key/value heads),
``attn.scores``/``attn.pattern`` (batch, heads, query, key), ``attn.z`` (batch, positions,
heads, head dim), the stream and what is added to it (batch, positions, width). A value in
another layout with the same number of elements (Bloom's (batch * heads, ...), a view taken
before the heads were moved) would read and edit other numbers than the name says: checked
by shape on every family the suite builds (here for those test_canonical does not build, there
on its own tapped models: ``canonical_support.check_documented_shapes``), and by value and by
edit against the model itself (forward hooks on the projections of an untapped copy, the heads
sliced by hand as the model's own code lays them out).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import fxprobe

tf = pytest.importorskip("transformers")
from canonical_support import _heads, check_documented_shapes  # noqa: E402

from tests.test_canonical import CONFIGS, DECODER, EAGER_ONLY, TOKENS, inputs  # noqa: E402

MORE: dict[str, Callable[[], tuple[Any, Any]]] = {
    "Bloom": lambda: (tf.BloomConfig(n_layer=2, hidden_size=32, n_head=4, **TOKENS),
                      tf.BloomForCausalLM),
    "GPT-2-reorder": lambda: (tf.GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=64,
                                            reorder_and_upcast_attn=True, **TOKENS),
                              tf.GPT2LMHeadModel),
    "Falcon-alibi": lambda: (tf.FalconConfig(num_hidden_layers=2, hidden_size=32,
                                             num_attention_heads=2, alibi=True, **TOKENS),
                             tf.FalconForCausalLM),
    "Cohere": lambda: (tf.CohereConfig(**DECODER, logit_scale=0.5, **TOKENS),
                       tf.CohereForCausalLM),
    "Granite": lambda: (tf.GraniteConfig(**DECODER, logits_scaling=4.0, **TOKENS),
                        tf.GraniteForCausalLM),
}
FAMILIES = {**CONFIGS, **MORE}
NO_SDPA = EAGER_ONLY | {"Bloom"}


def build(family: str, attn: str = "eager") -> nn.Module:
    config, cls = FAMILIES[family]()
    config._attn_implementation = attn
    torch.manual_seed(0)
    return cls(config).eval()


def kwargs(family: str) -> dict[str, Any]:
    if family in CONFIGS:
        return inputs(family)
    ids = torch.randint(2, 100, (2, 7), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "use_cache": False}


def tap_canonical(model: nn.Module, family: str) -> Any:
    tapped = fxprobe.tap(model, ops=fxprobe.where(lambda s: bool(s.canonical)),
                         tracer="dynamo")
    with torch.no_grad():
        tapped(**kwargs(family))
    return tapped


# The families test_canonical builds have their shapes checked there, on the same tapped model
# (one capture per family and attention): these are the others.
CASES = [(f, "eager") for f in MORE] + [("Falcon-alibi", "sdpa")]


@pytest.mark.parametrize(("family", "attn"), CASES, ids=[f"{f}-{a}" for f, a in CASES])
def test_every_canonical_value_has_its_documented_shape(family: str, attn: str) -> None:
    model = build(family, attn)
    check_documented_shapes(family, model, tap_canonical(model, family), kwargs(family))


def _split_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """(batch, positions, heads * dim) -> (batch, heads, positions, dim), as every family's
    attention splits them."""
    b, t, _ = x.shape
    return x.view(b, t, heads, -1).transpose(1, 2)


@pytest.mark.parametrize("batch", [2, 1])
def test_bloom_q_k_v_and_z_are_each_heads_own_values(batch: int) -> None:
    """Bloom fuses q, k, v per head ((batch, positions, heads, 3, dim)) and runs its kernel on
    (batch * heads, ...): the names give the heads as the documentation lays them out (with
    one sequence too, where batch * heads is the heads)."""
    model = build("Bloom")
    kw = {**kwargs("Bloom"), "input_ids": kwargs("Bloom")["input_ids"][:batch]}
    tapped = fxprobe.tap(model, ops=fxprobe.where(lambda s: bool(s.canonical)),
                         tracer="dynamo")
    with torch.no_grad():
        tapped(**kw)
    ref: dict[str, torch.Tensor] = {}
    heads = model.config.n_head
    for L, block in enumerate(model.transformer.h):
        attn = block.self_attention
        attn.query_key_value.register_forward_hook(
            lambda m, a, o, L=L: ref.setdefault(f"qkv{L}", o.detach().clone()))
        attn.dense.register_forward_pre_hook(
            lambda m, a, L=L: ref.setdefault(f"z{L}", a[0].detach().clone()))
    with torch.no_grad():
        model(**kw)
    for L in range(2):
        b, t, _ = ref[f"qkv{L}"].shape
        fused = ref[f"qkv{L}"].view(b, t, heads, 3, -1)  # Bloom's own _reshape
        for i, role in enumerate("qkv"):
            torch.testing.assert_close(tapped.taps[f"blocks.{L}.attn.{role}"],
                                       fused[..., i, :].transpose(1, 2))
        torch.testing.assert_close(tapped.taps[f"blocks.{L}.attn.z"],
                                   ref[f"z{L}"].view(b, t, heads, -1))


def test_q_is_found_by_layout_where_positions_equal_heads() -> None:
    """With as many positions as heads, GPT-2's ``q.view(B, T, H, d)`` has the shape of the
    ``q.transpose(1, 2)`` the kernel reads: only the latter is ``attn.q``."""
    model = build("GPT-2")
    ids = torch.tensor([[5, 7], [9, 11]])  # 2 positions, 2 heads
    qkv: list[torch.Tensor] = []
    model.transformer.h[0].attn.c_attn.register_forward_hook(lambda m, a, o: qkv.append(o))
    tapped = fxprobe.tap(model, ops="blocks.*.attn.*", tracer="dynamo")
    with torch.no_grad():
        tapped(input_ids=ids, use_cache=False)
        model(input_ids=ids, use_cache=False)
    q, k, v = qkv[0].split(32, dim=-1)
    for role, x in zip("qkv", (q, k, v), strict=True):
        torch.testing.assert_close(tapped.taps[f"blocks.0.attn.{role}"], _split_heads(x, 2))


Z_INPUT = {  # the module whose input is the heads' output, concatenated
    "Bloom": "transformer.h.{L}.self_attention.dense",
    "GPT-2": "transformer.h.{L}.attn.c_proj",
    "GPT-2-reorder": "transformer.h.{L}.attn.c_proj",
    "Llama": "model.layers.{L}.self_attn.o_proj",
    "Falcon-alibi": "transformer.h.{L}.self_attention.dense",
}


@pytest.mark.parametrize("how", ["intervene", "fn"])
@pytest.mark.parametrize("family", list(Z_INPUT))
def test_editing_one_head_of_z_edits_that_head(family: str, how: str) -> None:
    """``z[:, :, h] = 0`` through the canonical name equals the model with head h's slice of
    the output projection's input zeroed by a hook."""
    model, head, layer = build(family), 1, 1

    def zero_head(site: Any, z: torch.Tensor) -> torch.Tensor:
        z = z.clone()
        z[:, :, head] = 0
        return z

    name = f"blocks.{layer}.attn.z"
    if how == "fn":
        tapped = fxprobe.tap(model, ops=name, tracer="dynamo", fn=zero_head)
        with torch.no_grad():
            edited = tapped(**kwargs(family)).logits
    else:
        tapped = fxprobe.tap(model, ops=name, tracer="dynamo")
        with torch.no_grad(), tapped.intervene({name: zero_head}):  # before any forward
            edited = tapped(**kwargs(family)).logits
    heads = _heads(model.config)[0]

    def pre(m: nn.Module, args: Any) -> Any:
        x = args[0].clone()
        x.view(*x.shape[:-1], heads, -1)[:, :, head] = 0
        return (x, *args[1:])

    reference = build(family)
    reference.get_submodule(Z_INPUT[family].format(L=layer)).register_forward_pre_hook(pre)
    with torch.no_grad():
        expected = reference(**kwargs(family)).logits
        plain = build(family)(**kwargs(family)).logits
    torch.testing.assert_close(edited, expected)
    assert not torch.allclose(edited, plain)


def test_editing_one_head_of_bloom_q_edits_that_head() -> None:
    """Doubling head h of ``attn.q`` equals doubling Bloom's fused query of head h."""
    model, head = build("Bloom"), 2
    tapped = fxprobe.tap(model, ops="blocks.0.attn.q", tracer="dynamo")

    def double(site: Any, q: torch.Tensor) -> torch.Tensor:
        q = q.clone()
        q[:, head] *= 2
        return q

    with torch.no_grad(), tapped.intervene({"blocks.0.attn.q": double}):
        edited = tapped(**kwargs("Bloom")).logits

    def post(m: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
        out = out.clone()
        b, t, _ = out.shape
        out.view(b, t, 4, 3, -1)[:, :, head, 0] *= 2
        return out

    reference = build("Bloom")
    reference.transformer.h[0].self_attention.query_key_value.register_forward_hook(post)
    with torch.no_grad():
        torch.testing.assert_close(edited, reference(**kwargs("Bloom")).logits)


def test_gpt2_reorder_and_upcast_has_k() -> None:
    model = build("GPT-2-reorder")
    tapped = tap_canonical(model, "GPT-2-reorder")
    qkv: list[torch.Tensor] = []
    for block in model.transformer.h:
        block.attn.c_attn.register_forward_hook(lambda m, a, o: qkv.append(o))
    with torch.no_grad():
        model(**kwargs("GPT-2-reorder"))
    for L in range(2):
        for role, x in zip("qkv", qkv[L].split(32, dim=-1), strict=True):
            torch.testing.assert_close(tapped.taps[f"blocks.{L}.attn.{role}"],
                                       _split_heads(x, 2))


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_falcon_with_alibi_has_z_and_the_mlp_points(attn: str) -> None:
    model = build("Falcon-alibi", attn)
    tapped = tap_canonical(model, "Falcon-alibi")
    ref: dict[str, torch.Tensor] = {}
    for L, block in enumerate(model.transformer.h):
        for role, module in (("attn.z", block.self_attention.dense),
                             ("mlp.pre", block.mlp.act),
                             ("mlp.post", block.mlp.dense_4h_to_h)):
            module.register_forward_pre_hook(
                lambda m, a, key=f"blocks.{L}.{role}": ref.setdefault(key, a[0].clone()))
    with torch.no_grad():
        model(**kwargs("Falcon-alibi"))
    for name, value in ref.items():
        if name.endswith(".z"):
            value = value.view(*value.shape[:-1], 2, -1)
        torch.testing.assert_close(tapped.taps[name], value, msg=name)


@pytest.mark.parametrize(("family", "scale"), [("Granite", 1 / 4.0), ("Cohere", 0.5)])
def test_logit_lens_on_families_that_scale_the_logits(family: str, scale: float) -> None:
    """``logits`` is what the model returns; Granite divides the head's output by
    ``config.logits_scaling``, Cohere multiplies it by ``config.logit_scale``: the lens of
    docs/transformers.md applies the same scale there (as the docs say)."""
    model = build(family)
    tapped = fxprobe.tap(model, ops=["blocks.*.resid_post", "logits"], tracer="dynamo")
    with torch.no_grad():
        out = tapped(**kwargs(family))
        head = model.get_output_embeddings()(model.model.norm(tapped.taps["blocks.1.resid_post"]))
    torch.testing.assert_close(head * scale, out.logits)
    torch.testing.assert_close(tapped.taps["logits"], out.logits)
    assert not torch.allclose(head, out.logits)


def test_names_found_from_weights_hold_in_every_naming_of_a_graph() -> None:
    """``attn.z``, ``mlp.pre``/``post`` and ``logits`` are found from the ops that read a weight;
    dynamo drops its graph inputs' sources after the capture, and the graph is named again for
    per-call runs (and for other module instances): the names must not drift (issue #26, 1)."""
    model = build("GPT-2")
    names = ["blocks.*.attn.z", "blocks.*.mlp.pre", "blocks.*.mlp.post", "logits"]
    tapped = fxprobe.tap(model, ops="blocks.0.resid_post", tracer="dynamo")
    ref: dict[str, torch.Tensor] = {}
    reference = build("GPT-2")
    for L, block in enumerate(reference.transformer.h):
        for role, module in (("attn.z", block.attn.c_proj), ("mlp.pre", block.mlp.act),
                             ("mlp.post", block.mlp.c_proj)):
            module.register_forward_pre_hook(
                lambda m, a, key=f"blocks.{L}.{role}": ref.setdefault(key, a[0].clone()))
    with torch.no_grad():
        ref["logits"] = reference(**kwargs("GPT-2")).logits
        tapped(**kwargs("GPT-2"))
        caches = [tapped.run_with_cache(**kwargs("GPT-2"), names=names)[1] for _ in range(2)]
    for cache in caches:
        assert len(list(cache)) == 7
        for name, value in ref.items():
            if name.endswith(".z"):
                value = value.view(*value.shape[:-1], 2, -1)
            torch.testing.assert_close(cache[name], value, msg=name)
