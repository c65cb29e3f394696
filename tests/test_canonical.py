"""Canonical transformer names (``blocks.3.resid_post``) on 14 families, each value checked.

One tiny model per family (two layers, width 32, vocabulary 100), built from its config;
eager and SDPA attention where the family has both. References, from the untapped model with
the same weights: ``output_hidden_states`` (residual stream), ``output_attentions=True`` of
eager attention (pattern), the softmax's input under eager attention (scores), the arguments
of ``F.scaled_dot_product_attention`` (q, k, v), and forward hooks on the projections, norms,
MLPs and attention modules, named per family below (the test's own table: the library has
none).

The table of which names each family has is written into docs/transformers.md between marker
comments: ``FXPROBE_REGEN_DOCS=1 pytest tests/test_canonical.py`` regenerates it; otherwise
the test checks that the docs say what the models have.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxprobe

tf = pytest.importorskip("transformers")

DOCS = Path(__file__).resolve().parent.parent / "docs" / "transformers.md"
BEGIN, END = "<!-- canonical-table: begin -->", "<!-- canonical-table: end -->"
REGEN = os.environ.get("FXPROBE_REGEN_DOCS") == "1"
TOKENS = dict(vocab_size=100, bos_token_id=0, eos_token_id=0, pad_token_id=0)
DECODER = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=2,
               num_key_value_heads=1, intermediate_size=64, max_position_embeddings=64)


def _configs() -> dict[str, Callable[[], tuple[Any, Any]]]:
    return {
        "GPT-2": lambda: (tf.GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=64,
                                        **TOKENS), tf.GPT2LMHeadModel),
        "GPT-NeoX": lambda: (tf.GPTNeoXConfig(
            num_hidden_layers=2, hidden_size=32, num_attention_heads=2, intermediate_size=64,
            max_position_embeddings=64, **TOKENS), tf.GPTNeoXForCausalLM),
        "GPT-J": lambda: (tf.GPTJConfig(n_layer=2, n_embd=32, n_head=2, rotary_dim=8,
                                        n_positions=64, **TOKENS), tf.GPTJForCausalLM),
        "Llama": lambda: (tf.LlamaConfig(**DECODER, **TOKENS), tf.LlamaForCausalLM),
        "Mistral": lambda: (tf.MistralConfig(**DECODER, sliding_window=None, **TOKENS),
                            tf.MistralForCausalLM),
        "Qwen2": lambda: (tf.Qwen2Config(**DECODER, **TOKENS), tf.Qwen2ForCausalLM),
        "Qwen3": lambda: (tf.Qwen3Config(**DECODER, head_dim=16, **TOKENS),
                          tf.Qwen3ForCausalLM),
        "Gemma2": lambda: (tf.Gemma2Config(**DECODER, head_dim=16, sliding_window=64,
                                           attn_logit_softcapping=None,
                                           query_pre_attn_scalar=16, **TOKENS),
                           tf.Gemma2ForCausalLM),
        "Phi-3": lambda: (tf.Phi3Config(**DECODER, **TOKENS), tf.Phi3ForCausalLM),
        "OPT": lambda: (tf.OPTConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2,
                                     ffn_dim=64, max_position_embeddings=64,
                                     word_embed_proj_dim=32, **TOKENS), tf.OPTForCausalLM),
        "Falcon": lambda: (tf.FalconConfig(num_hidden_layers=2, hidden_size=32,
                                           num_attention_heads=2, **TOKENS),
                           tf.FalconForCausalLM),
        "Mixtral (MoE)": lambda: (tf.MixtralConfig(**DECODER, num_local_experts=4,
                                                   num_experts_per_tok=2, sliding_window=None,
                                                   **TOKENS), tf.MixtralForCausalLM),
        "BERT": lambda: (tf.BertConfig(num_hidden_layers=2, hidden_size=32,
                                       num_attention_heads=2, intermediate_size=64,
                                       vocab_size=100, max_position_embeddings=64),
                         tf.BertForMaskedLM),
        "T5": lambda: (tf.T5Config(num_layers=2, num_decoder_layers=2, d_model=32, d_ff=64,
                                   num_heads=2, d_kv=16, vocab_size=100,
                                   decoder_start_token_id=0, pad_token_id=0, eos_token_id=1),
                       tf.T5ForConditionalGeneration),
    }


CONFIGS = _configs()
EAGER_ONLY = {"Gemma2"}  # transformers refuses SDPA for Gemma2

# Per family, the modules whose input ("in") or output ("out") is each value, by block.
_LLAMA = {"attn_out": ("model.layers.{L}.self_attn", "out"),
          "attn.z": ("model.layers.{L}.self_attn.o_proj", "in"),
          "resid_mid": ("model.layers.{L}.post_attention_layernorm", "in"),
          "mlp.pre": ("model.layers.{L}.mlp.act_fn", "in"),
          "mlp.post": ("model.layers.{L}.mlp.down_proj", "in"),
          "mlp_out": ("model.layers.{L}.mlp", "out"),
          "ln_final": ("model.norm", "out")}
HOOKS: dict[str, dict[str, tuple[str, str]]] = {
    "GPT-2": {"attn_out": ("transformer.h.{L}.attn", "out"),
              "attn.z": ("transformer.h.{L}.attn.c_proj", "in"),
              "resid_mid": ("transformer.h.{L}.ln_2", "in"),
              "mlp.pre": ("transformer.h.{L}.mlp.act", "in"),
              "mlp.post": ("transformer.h.{L}.mlp.c_proj", "in"),
              "mlp_out": ("transformer.h.{L}.mlp", "out"),
              "ln_final": ("transformer.ln_f", "out"), "pos_embed": ("transformer.wpe", "out")},
    "GPT-NeoX": {"attn_out": ("gpt_neox.layers.{L}.attention", "out"),
                 "attn.z": ("gpt_neox.layers.{L}.attention.dense", "in"),
                 "mlp.pre": ("gpt_neox.layers.{L}.mlp.act", "in"),
                 "mlp.post": ("gpt_neox.layers.{L}.mlp.dense_4h_to_h", "in"),
                 "mlp_out": ("gpt_neox.layers.{L}.mlp", "out"),
                 "ln_final": ("gpt_neox.final_layer_norm", "out")},
    "GPT-J": {"attn_out": ("transformer.h.{L}.attn", "out"),
              "attn.z": ("transformer.h.{L}.attn.out_proj", "in"),
              "mlp.pre": ("transformer.h.{L}.mlp.act", "in"),
              "mlp.post": ("transformer.h.{L}.mlp.fc_out", "in"),
              "mlp_out": ("transformer.h.{L}.mlp", "out"),
              "ln_final": ("transformer.ln_f", "out")},
    "Llama": _LLAMA, "Mistral": _LLAMA, "Qwen2": _LLAMA, "Qwen3": _LLAMA,
    "Gemma2": {**_LLAMA,
               "attn_out": ("model.layers.{L}.post_attention_layernorm", "out"),
               "resid_mid": ("model.layers.{L}.pre_feedforward_layernorm", "in"),
               "mlp_out": ("model.layers.{L}.post_feedforward_layernorm", "out")},
    "Phi-3": {**_LLAMA, "mlp.pre": ("model.layers.{L}.mlp.activation_fn", "in")},
    "OPT": {"attn_out": ("model.decoder.layers.{L}.self_attn", "out"),
            "attn.z": ("model.decoder.layers.{L}.self_attn.out_proj", "in"),
            "resid_mid": ("model.decoder.layers.{L}.final_layer_norm", "in"),
            "mlp.pre": ("model.decoder.layers.{L}.activation_fn", "in"),
            "mlp.post": ("model.decoder.layers.{L}.fc2", "in"),
            "mlp_out": ("model.decoder.layers.{L}.fc2", "out"),
            "ln_final": ("model.decoder.final_layer_norm", "out"),
            "pos_embed": ("model.decoder.embed_positions", "out")},
    "Falcon": {"attn_out": ("transformer.h.{L}.self_attention", "out"),
               "attn.z": ("transformer.h.{L}.self_attention.dense", "in"),
               "mlp.pre": ("transformer.h.{L}.mlp.act", "in"),
               "mlp.post": ("transformer.h.{L}.mlp.dense_4h_to_h", "in"),
               "mlp_out": ("transformer.h.{L}.mlp", "out"),
               "ln_final": ("transformer.ln_f", "out")},
    "Mixtral (MoE)": {k: v for k, v in _LLAMA.items() if not k.startswith("mlp.")},
    "BERT": {"attn_out": ("bert.encoder.layer.{L}.attention.output.dense", "out"),
             "attn.z": ("bert.encoder.layer.{L}.attention.output.dense", "in"),
             "resid_mid": ("bert.encoder.layer.{L}.attention.output.LayerNorm", "out"),
             "mlp.pre": ("bert.encoder.layer.{L}.intermediate.intermediate_act_fn", "in"),
             "mlp.post": ("bert.encoder.layer.{L}.output.dense", "in"),
             "mlp_out": ("bert.encoder.layer.{L}.output.dense", "out"),
             "pos_embed": ("bert.embeddings.position_embeddings", "out")},
    "T5": {
        **{f"{stack}.{k}": (v[0].replace("S.", f"{stack}."), v[1]) for stack in
           ("encoder", "decoder") for k, v in {
               "attn_out": ("S.block.{L}.layer.0.SelfAttention", "out"),
               "attn.z": ("S.block.{L}.layer.0.SelfAttention.o", "in"),
               "resid_mid": ("S.block.{L}.layer.1.layer_norm", "in"),
               "ln_final": ("S.final_layer_norm", "out")}.items()},
        **{f"encoder.{k}": (f"encoder.block.{{L}}.layer.1.DenseReluDense{m}", io)
           for k, (m, io) in {"mlp.pre": (".act", "in"), "mlp.post": (".wo", "in"),
                              "mlp_out": ("", "out")}.items()},
        **{f"decoder.{k}": (f"decoder.block.{{L}}.layer.{m}", io)
           for k, (m, io) in {"cross_attn_out": ("1.EncDecAttention", "out"),
                              "cross_attn.z": ("1.EncDecAttention.o", "in"),
                              "resid_mid_cross": ("2.layer_norm", "in"),
                              "mlp.pre": ("2.DenseReluDense.act", "in"),
                              "mlp.post": ("2.DenseReluDense.wo", "in"),
                              "mlp_out": ("2.DenseReluDense", "out")}.items()},
    },
}
FINAL_NORM_INPUT = {  # the last block's stream, where output_hidden_states gives it normed
    "GPT-2": "transformer.ln_f", "GPT-NeoX": "gpt_neox.final_layer_norm",
    "GPT-J": "transformer.ln_f", "Llama": "model.norm", "Mistral": "model.norm",
    "Qwen2": "model.norm", "Qwen3": "model.norm", "Gemma2": "model.norm", "Phi-3": "model.norm",
    "OPT": "model.decoder.final_layer_norm", "Falcon": "transformer.ln_f",
    "Mixtral (MoE)": "model.norm", "T5": "encoder.final_layer_norm|decoder.final_layer_norm",
}


def make(family: str, attn: str) -> nn.Module:
    config, cls = CONFIGS[family]()
    config._attn_implementation = attn
    torch.manual_seed(0)
    return cls(config).eval()


def inputs(family: str) -> dict[str, Any]:
    ids = torch.randint(2, 100, (2, 7), generator=torch.Generator().manual_seed(0))
    kw: dict[str, Any] = {"input_ids": ids}
    if family == "T5":
        kw["decoder_input_ids"] = ids[:, :5]
    if family != "BERT":
        kw["use_cache"] = False
    return kw


def kernels(family: str) -> list[str]:
    """The attention kernels in the order a forward runs them, by canonical prefix."""
    if family == "T5":
        return ["encoder.blocks.0.attn", "encoder.blocks.1.attn", "decoder.blocks.0.attn",
                "decoder.blocks.0.cross_attn", "decoder.blocks.1.attn",
                "decoder.blocks.1.cross_attn"]
    return ["blocks.0.attn", "blocks.1.attn"]


def _first(x: Any) -> torch.Tensor:
    return x[0] if isinstance(x, (tuple, list)) else x


def references(family: str) -> dict[str, torch.Tensor]:
    """Every canonical value of ``family``, from the untapped model (see the docstring)."""
    ref: dict[str, torch.Tensor] = {}
    model = make(family, "eager")
    handles = []
    blocks = range(2)
    for key, (template, io) in HOOKS[family].items():
        for L in blocks if "{L}" in template else [None]:
            module = model.get_submodule(template.format(L=L))
            stack, role = "", key
            if key.startswith(("encoder.", "decoder.")):
                stack, role = key.split(".", 1)
                stack += "."
            name = f"{stack}blocks.{L}.{role}" if L is not None else f"{stack}{role}"

            def keep(m: nn.Module, args: Any, out: Any = None, *, name: str = name,
                     io: str = io) -> None:
                ref.setdefault(name, (_first(args) if io == "in" else _first(out))
                               .detach().clone())

            handles.append(module.register_forward_pre_hook(keep) if io == "in"
                           else module.register_forward_hook(keep))
    for where in FINAL_NORM_INPUT.get(family, "").split("|"):
        if where:
            stack = where.split(".")[0] + "." if family == "T5" else ""

            def last(m: nn.Module, args: Any, *, stack: str = stack) -> None:
                ref[f"{stack}blocks.1.resid_post"] = args[0].detach().clone()

            handles.append(model.get_submodule(where).register_forward_pre_hook(last))
    scores: list[torch.Tensor] = []
    real_softmax = F.softmax

    def softmax(x: torch.Tensor, *args: Any, **kw: Any) -> torch.Tensor:
        if x.dim() == 4:
            scores.append(x.detach().clone())
        return real_softmax(x, *args, **kw)

    matmuls: list[tuple[torch.Tensor, torch.Tensor]] = []
    real_matmul = torch.matmul

    def matmul(a: torch.Tensor, b: torch.Tensor, **kw: Any) -> torch.Tensor:
        if a.dim() == 4:
            matmuls.append((a.detach().clone(), b.detach().clone()))
        return real_matmul(a, b, **kw)

    mp = pytest.MonkeyPatch()
    try:
        mp.setattr(F, "softmax", softmax)
        mp.setattr(torch, "matmul", matmul)
        with torch.no_grad():
            out = model(**inputs(family), output_hidden_states=True, output_attentions=True)
    finally:
        mp.undo()
        for h in handles:
            h.remove()
    ref["logits"] = out.logits
    stacks = {"encoder.": (out.encoder_hidden_states, out.encoder_attentions),
              "decoder.": (out.decoder_hidden_states, out.decoder_attentions)} \
        if family == "T5" else {"": (out.hidden_states, out.attentions)}
    for stack, (hidden, attentions) in stacks.items():
        for L in blocks:
            ref[f"{stack}blocks.{L}.resid_pre"] = hidden[L]
            if L + 1 < len(hidden) - 1 or family == "BERT":
                ref.setdefault(f"{stack}blocks.{L}.resid_post", hidden[L + 1])
            ref[f"{stack}blocks.{L}.attn.pattern"] = attentions[L]
    if family == "T5":
        for L in blocks:
            ref[f"decoder.blocks.{L}.cross_attn.pattern"] = out.cross_attentions[L]
    embedding = model.get_input_embeddings()
    ids = inputs(family)
    for stack, key in ({"encoder.": "input_ids", "decoder.": "decoder_input_ids"}.items()
                       if family == "T5" else [("", "input_ids")]):
        ref[f"{stack}embed"] = embedding(ids[key]).detach()
    order = kernels(family)
    assert len(scores) == len(order), f"{len(scores)} softmax calls for {order}"
    ref.update((f"{k}.scores", s) for k, s in zip(order, scores, strict=True))
    if family in EAGER_ONLY:  # q @ k.T and pattern @ v, through torch.matmul
        for k, ((q, kt), (_, v)) in zip(order, zip(matmuls[::2], matmuls[1::2], strict=True),
                                        strict=True):
            ref.update({f"{k}.q": q, f"{k}.k": kt.transpose(-1, -2), f"{k}.v": v})
        return ref
    sdpa_model = make(family, "sdpa")
    calls: list[tuple[torch.Tensor, ...]] = []
    real_sdpa = F.scaled_dot_product_attention

    def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: Any, **kw: Any) -> Any:
        calls.append((q.clone(), k.clone(), v.clone()))
        return real_sdpa(q, k, v, *args, **kw)

    mp = pytest.MonkeyPatch()
    try:
        mp.setattr(F, "scaled_dot_product_attention", sdpa)
        with torch.no_grad():
            sdpa_model(**inputs(family))
    finally:
        mp.undo()
    assert len(calls) == len(order)
    for k, (q, kk, v) in zip(order, calls, strict=True):
        ref.update({f"{k}.q": q, f"{k}.k": kk, f"{k}.v": v})
    return ref


_REFS: dict[str, dict[str, torch.Tensor]] = {}
FOUND: dict[str, dict[str, set[str]]] = {}
"""The canonical names found, by family and attention (for the docs table)."""


def _close(name: str, ours: torch.Tensor, ref: torch.Tensor) -> None:
    if name.endswith((".k", ".v")) and ours.dim() == 4 and ours.shape[1] != ref.shape[1]:
        ours = ours.repeat_interleave(ref.shape[1] // ours.shape[1], dim=1)  # the kernel's
    if ours.shape != ref.shape:
        assert ours.numel() == ref.numel(), f"{name}: {tuple(ours.shape)} vs {tuple(ref.shape)}"
        ours = ours.reshape(ref.shape)
    if name.endswith(".scores"):  # masked entries: -inf beside SDPA, the dtype's min in eager
        keep = ref > torch.finfo(ref.dtype).min / 2
        ours, ref = ours[keep], ref[keep]
    torch.testing.assert_close(ours, ref, atol=2e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")


CASES = [(f, a) for f in CONFIGS for a in ("eager", "sdpa") if a == "eager" or
         f not in EAGER_ONLY]


@pytest.mark.parametrize(("family", "attn"), CASES, ids=[f"{f}-{a}" for f, a in CASES])
def test_canonical_names_equal_the_reference_values(family: str, attn: str) -> None:
    if family not in _REFS:
        _REFS[family] = references(family)
    ref = _REFS[family]
    model = make(family, attn)
    tapped = fxprobe.tap(model, ops=fxprobe.where(lambda s: bool(s.canonical)),
                         tracer="dynamo")
    with torch.no_grad():
        out = tapped(**inputs(family))
        expected = model(**inputs(family))
    assert torch.equal(out.logits, expected.logits)
    found = {c for s in tapped.sites for c in s.canonical}
    FOUND.setdefault(family, {})[attn] = found
    unchecked = sorted(found - ref.keys())
    assert not unchecked, f"no reference for {unchecked}"
    missing = sorted(ref.keys() - found)
    assert not missing, f"the reference has {missing}, the tapped model not"
    for name in sorted(found):
        _close(name, tapped.taps[name], ref[name])


def test_glob_selects_canonical_names_under_auto_before_dynamo_ran() -> None:
    """The default tracer checks fx's selectors at tap(); canonical names appear with
    dynamo's graphs at the first forward and are checked there (and a typo still raises)."""
    model = make("Llama", "sdpa")
    tapped = fxprobe.tap(model, ops=["blocks.*.resid_post", "blocks.1.attn.pattern"])
    with torch.no_grad():
        out = tapped(**inputs("Llama"), output_hidden_states=True)
    assert [c for s in tapped.sites for c in s.canonical] == [
        "blocks.0.resid_post", "blocks.1.resid_pre", "blocks.1.attn.pattern",
        "blocks.1.resid_post"]
    torch.testing.assert_close(tapped.taps["blocks.0.resid_post"], out.hidden_states[1])
    assert "blocks.1.resid_pre" in tapped.taps
    assert tapped.taps["blocks.1.attn.pattern"].shape == (2, 2, 7, 7)
    with pytest.raises(fxprobe.UnknownSiteError, match="blocks.0.resid_post"):
        tapped.taps["blocks.0.resid_posts"]
    typo = fxprobe.tap(model, ops="blocks.*.resid_psot")
    with pytest.raises(fxprobe.SelectorError, match="resid_post"), torch.no_grad():
        typo(**inputs("Llama"))


def test_scores_beside_sdpa_are_computed_only_where_selected() -> None:
    model = make("GPT-2", "sdpa")
    tapped = fxprobe.tap(model, ops="blocks.0.attn.scores", tracer="dynamo")
    with torch.no_grad():
        tapped(**inputs("GPT-2"))
    assert list(tapped.taps) == ["transformer.h.0.attn.attention_scores"]
    graph = next(iter(tapped.graphs.values()))
    called = [n.target.__name__ for n in graph.nodes if n.op == "call_function"
              and getattr(n.target, "__module__", "").startswith("fxprobe")]
    assert called.count("attention_scores") == 1 and "attention_probs" not in called


COLUMNS = ["embed", "pos_embed", "resid_pre", "attn.q/k/v", "attn.scores", "attn.pattern",
           "attn.z", "attn_out", "resid_mid", "cross_attn.*", "cross_attn_out",
           "resid_mid_cross", "mlp.pre", "mlp.post", "mlp_out", "resid_post", "ln_final",
           "logits"]


def _column(name: str) -> str:
    role = re.sub(r"^(encoder\.|decoder\.)?(blocks\.\d+\.)?", "", name)
    if role in ("attn.q", "attn.k", "attn.v"):
        return "attn.q/k/v"
    if role.startswith("cross_attn."):
        return "cross_attn.*"
    return role


def table(found: dict[str, set[str]]) -> str:
    lines = ["| family | " + " | ".join(f"`{c}`" for c in COLUMNS) + " |",
             "|---|" + "---|" * len(COLUMNS)]
    for family, names in found.items():
        stacks: dict[str, set[str]] = {}
        for n in names:
            stack = n.split(".")[0] if n.startswith(("encoder.", "decoder.")) else ""
            stacks.setdefault(_column(n), set()).add(stack)
        cells = []
        for c in COLUMNS:
            where = stacks.get(c)
            if not where:
                cells.append("-")
            elif where == {""}:
                cells.append("yes")
            else:
                cells.append(", ".join(sorted(s[:3] for s in where if s)))
        lines.append(f"| {family} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def test_docs_table_lists_the_names_each_family_has() -> None:
    if set(FOUND) != set(CONFIGS):
        pytest.skip("runs after every family's test (run the whole file)")
    for family, by_attn in FOUND.items():
        assert len({frozenset(v) for v in by_attn.values()}) == 1, family  # eager = sdpa
    found = {f: next(iter(FOUND[f].values())) for f in CONFIGS}
    text = DOCS.read_text()
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    new = f"{text[:start]}\n{table(found)}\n{text[end:]}"
    if REGEN:
        DOCS.write_text(new)
        return
    assert new == text, "docs/transformers.md is stale: FXPROBE_REGEN_DOCS=1 pytest " \
        "tests/test_canonical.py"


# Layouts outside the 14 families: a canonical name is right or absent, never a guess.

def _tap_all(model: nn.Module, **kw: Any) -> Any:
    tapped = fxprobe.tap(model, ops=fxprobe.where(lambda s: True), tracer="dynamo")
    with torch.no_grad():
        tapped(**kw)
    return tapped


def _names(tapped: Any) -> set[str]:
    return {c for s in tapped.sites for c in s.canonical}


def _ids() -> torch.Tensor:
    return torch.randint(2, 100, (2, 7), generator=torch.Generator().manual_seed(0))


BADDBMM = {
    "Bloom": lambda: (tf.BloomConfig(n_layer=3, hidden_size=32, n_head=4, **TOKENS),
                      tf.BloomForCausalLM),
    "GPT-2-reorder": lambda: (tf.GPT2Config(n_layer=3, n_embd=32, n_head=2, n_positions=64,
                                            reorder_and_upcast_attn=True, **TOKENS),
                              tf.GPT2LMHeadModel),
}


@pytest.mark.parametrize("family", list(BADDBMM))
def test_attention_through_baddbmm_is_each_blocks_own(family: str) -> None:
    """``baddbmm(input, q, k.T)`` computes the scores (Bloom, GPT-2 reordered): the kernel is
    the block's own (not the previous block's ``probs @ v`` taken for q: ``cross_attn``)."""
    def build() -> nn.Module:
        config, cls = BADDBMM[family]()
        config._attn_implementation = "eager"
        torch.manual_seed(0)
        return cls(config).eval()

    tapped = _tap_all(build(), input_ids=_ids(), use_cache=False)
    names = _names(tapped)
    assert not [n for n in names if "cross" in n]
    calls: list[tuple[torch.Tensor, torch.Tensor]] = []
    real_fn, real_method = torch.baddbmm, torch.Tensor.baddbmm

    def fn(inp: torch.Tensor, b1: torch.Tensor, b2: torch.Tensor, **kw: Any) -> torch.Tensor:
        calls.append((b1.clone(), b2.clone()))
        return real_fn(inp, b1, b2, **kw)

    def method(self: torch.Tensor, batch1: torch.Tensor, batch2: torch.Tensor,
               **kw: Any) -> torch.Tensor:
        calls.append((batch1.clone(), batch2.clone()))
        return real_method(self, batch1, batch2, **kw)

    mp = pytest.MonkeyPatch()
    try:
        mp.setattr(torch, "baddbmm", fn)
        mp.setattr(torch.Tensor, "baddbmm", method)
        with torch.no_grad():
            out = build()(input_ids=_ids(), use_cache=False, output_attentions=True,
                          output_hidden_states=True)
    finally:
        mp.undo()
    assert len(calls) == 3
    for L in range(3):
        for role in ("resid_pre", "attn.q", "attn.pattern", "resid_post"):
            assert f"blocks.{L}.{role}" in names
        _close("q", tapped.taps[f"blocks.{L}.attn.q"], calls[L][0])
        if f"blocks.{L}.attn.k" in names or family == "Bloom":  # GPT-2's k: (.., dim, pos)
            _close("k", tapped.taps[f"blocks.{L}.attn.k"], calls[L][1].transpose(-1, -2))
        _close("pattern", tapped.taps[f"blocks.{L}.attn.pattern"], out.attentions[L])
        _close("resid_pre", tapped.taps[f"blocks.{L}.resid_pre"], out.hidden_states[L])
        if L < 2:
            _close("resid_post", tapped.taps[f"blocks.{L}.resid_post"], out.hidden_states[L + 1])


class _Block(nn.Module):
    def __init__(self, d: int = 32, heads: int = 2) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.o = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.proj = nn.Linear(d, 64), nn.Linear(64, d)
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        q, k, v = (t.view(B, T, self.heads, D // self.heads).transpose(1, 2)
                   for t in self.qkv(self.ln_1(x)).split(D, -1))
        z = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(z.transpose(1, 2).reshape(B, T, D))
        return x + self.proj(F.gelu(self.fc(self.ln_2(x))))


class _Stack(nn.Module):
    def __init__(self, order: list[int], shared: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(100, 32)
        b = _Block()
        self.blocks = nn.ModuleList([b, b, b] if shared else [_Block() for _ in range(3)])
        self.ln_f, self.head = nn.LayerNorm(32), nn.Linear(32, 100, bias=False)
        self.order = order

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(input_ids)
        for i in self.order:
            x = self.blocks[i](x)
        return self.head(self.ln_f(x))


def test_blocks_run_out_of_index_order_name_the_final_norm_after_the_last_to_run() -> None:
    model = _Stack([2, 0, 1]).eval()
    tapped = _tap_all(model, input_ids=_ids())
    ref: dict[str, torch.Tensor] = {}
    for i, b in enumerate(model.blocks):
        b.register_forward_pre_hook(lambda m, a, i=i: ref.setdefault(f"blocks.{i}.resid_pre",
                                                                     a[0].clone()))
        b.register_forward_hook(lambda m, a, o, i=i: ref.setdefault(f"blocks.{i}.resid_post",
                                                                    o.clone()))
    model.ln_f.register_forward_hook(lambda m, a, o: ref.setdefault("ln_final", o.clone()))
    with torch.no_grad():
        logits = model(_ids())
    ref["logits"] = logits
    assert {"ln_final", "logits"} <= _names(tapped)
    for name in ref:
        assert name in _names(tapped), name
        _close(name, tapped.taps[name], ref[name])


def test_a_block_run_several_times_has_no_canonical_names() -> None:
    """One module run N times (``ModuleList([b, b, b])``, ALBERT's shared layer): the calls
    cannot be told apart by index, so no canonical names (rather than mixed calls)."""
    assert not _names(_tap_all(_Stack([0, 1, 2], shared=True).eval(), input_ids=_ids()))
    config = tf.AlbertConfig(num_hidden_layers=3, hidden_size=32, embedding_size=16,
                             num_attention_heads=2, intermediate_size=64, vocab_size=100,
                             max_position_embeddings=64)
    torch.manual_seed(0)
    assert not _names(_tap_all(tf.AlbertForMaskedLM(config).eval(), input_ids=_ids()))


PARALLEL = {  # x + attn(norm(x)) + mlp(norm(x)), as two adds
    "Cohere": lambda: (tf.CohereConfig(**DECODER, **TOKENS), tf.CohereForCausalLM),
    "StableLM": lambda: (tf.StableLmConfig(**DECODER, use_parallel_residual=True, **TOKENS),
                         tf.StableLmForCausalLM),
}


@pytest.mark.parametrize("family", list(PARALLEL))
def test_parallel_block_written_as_two_adds_has_no_resid_mid(family: str) -> None:
    def build() -> nn.Module:
        config, cls = PARALLEL[family]()
        config._attn_implementation = "sdpa"
        torch.manual_seed(0)
        return cls(config).eval()

    tapped = _tap_all(build(), input_ids=_ids(), use_cache=False)
    names = _names(tapped)
    assert not [n for n in names if "resid_mid" in n]
    model = build()
    ref: dict[str, torch.Tensor] = {}
    for L, layer in enumerate(model.model.layers):
        layer.self_attn.o_proj.register_forward_hook(
            lambda m, a, o, L=L: ref.setdefault(f"blocks.{L}.attn_out", o.clone()))
        layer.mlp.register_forward_hook(
            lambda m, a, o, L=L: ref.setdefault(f"blocks.{L}.mlp_out", o.clone()))
    with torch.no_grad():
        out = model(input_ids=_ids(), use_cache=False, output_hidden_states=True)
    ref.update({f"blocks.{L}.resid_pre": out.hidden_states[L] for L in range(2)})
    ref["blocks.0.resid_post"] = out.hidden_states[1]
    for name in ref:
        assert name in names, name
        _close(name, tapped.taps[name], ref[name])
