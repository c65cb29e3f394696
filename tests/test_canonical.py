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
from canonical_support import DECODER, TOKENS, _close, check_documented_shapes, tf
from torch import nn

import fxprobe

DOCS = Path(__file__).resolve().parent.parent / "docs" / "transformers.md"
BEGIN, END = "<!-- canonical-table: begin -->", "<!-- canonical-table: end -->"


REGEN = os.environ.get("FXPROBE_REGEN_DOCS") == "1"


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
    check_documented_shapes(family, model, tapped, inputs(family))  # docs/transformers.md


def test_glob_selects_canonical_names_under_auto_before_dynamo_ran() -> None:
    """Canonical names appear with dynamo's graphs at the first forward; a canonical name the
    model cannot have (a typo) is refused at tap()."""
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
    with pytest.raises(fxprobe.SelectorError, match="resid_post"):  # a typo: at tap()
        fxprobe.tap(model, ops="blocks.*.resid_psot")


def test_scores_beside_sdpa_are_computed_only_where_selected() -> None:
    model = make("GPT-2", "sdpa")
    tapped = fxprobe.tap(model, ops="blocks.0.attn.scores", tracer="dynamo")
    with torch.no_grad():
        tapped(**inputs("GPT-2"))
    assert list(tapped.taps) == ["transformer.h.0.attn.attention_scores"]
    called = [n.target.__name__ for graph in tapped.graphs.values() for n in graph.nodes
              if n.op == "call_function"
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

