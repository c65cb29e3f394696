"""The model's own inputs are sites (``input_ids``, ``attention_mask``) wherever it takes them.

Under ``tracer="fx"`` every placeholder was one; a Hugging Face model (which fx cannot trace)
runs under dynamo, whose graph inputs were no sites, so ``ops=["attention_mask", ...]`` and
docs/disk.md's padding recipe failed on every such model. References: the tensors the model
was called with, the model called with an edited mask, forward hooks on an untapped copy.
"""

from __future__ import annotations

import re
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import fxprobe

tf = pytest.importorskip("transformers")
DOCS = Path(__file__).resolve().parent.parent / "docs" / "disk.md"


def _gpt2() -> nn.Module:
    config = tf.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=64)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return tf.GPT2LMHeadModel(config).eval()


def _llama() -> nn.Module:
    config = tf.LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2,
                            num_key_value_heads=1, intermediate_size=64, vocab_size=100,
                            max_position_embeddings=64)
    torch.manual_seed(0)
    return tf.LlamaForCausalLM(config).eval()


def _t5() -> nn.Module:
    config = tf.T5Config(num_layers=2, num_decoder_layers=2, d_model=32, d_ff=64, num_heads=2,
                         d_kv=16, vocab_size=100, decoder_start_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    return tf.T5ForConditionalGeneration(config).eval()


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(2, 100, (3, 6), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(3, 6, dtype=torch.long)
    mask[0, :2] = 0
    mask[2, :4] = 0
    return ids, mask


@pytest.mark.parametrize("tracer", ["dynamo", "auto"])
@pytest.mark.parametrize("build", [_gpt2, _llama, _t5], ids=["GPT-2", "Llama", "T5"])
def test_inputs_of_a_hugging_face_model_are_sites(build: Any, tracer: str) -> None:
    ids, mask = _batch()
    kw: dict[str, Any] = {"input_ids": ids, "attention_mask": mask, "use_cache": False}
    names = ["input_ids", "attention_mask"]
    if build is _t5:
        kw["decoder_input_ids"] = ids[:, :4]
        names.append("decoder_input_ids")
    tapped = fxprobe.tap(build(), ops=names, tracer=tracer)
    with torch.no_grad():
        tapped(**kw)
    assert sorted(tapped.taps) == sorted(names)
    for n in names:
        assert torch.equal(tapped.taps[n], kw[n])
        site = next(s for s in tapped.sites if s.name == n)
        assert site.kind == "placeholder" and site.how == "dynamo"


def test_editing_the_mask_through_its_site_equals_calling_with_the_edited_mask() -> None:
    ids, mask = _batch()
    edited = mask.clone()
    edited[1, :3] = 0

    def edit(site: Any, value: torch.Tensor) -> torch.Tensor:
        return edited

    tapped = fxprobe.tap(_gpt2(), ops="attention_mask", tracer="dynamo", fn=edit)
    model = _gpt2()
    with torch.no_grad():
        out = tapped(input_ids=ids, attention_mask=mask, use_cache=False).logits
        expected = model(input_ids=ids, attention_mask=edited, use_cache=False).logits
        plain = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    torch.testing.assert_close(out, expected)
    assert not torch.allclose(out, plain)
    assert torch.equal(tapped.taps["attention_mask"], edited)


def test_positional_inputs_are_named_by_the_forward_parameter() -> None:
    ids, mask = _batch()
    tapped = fxprobe.tap(_gpt2(), ops=["input_ids", "attention_mask"], tracer="dynamo")
    with torch.no_grad():
        tapped(ids, None, mask, use_cache=False)  # (input_ids, past_key_values, mask)
    assert torch.equal(tapped.taps["input_ids"], ids)
    assert torch.equal(tapped.taps["attention_mask"], mask)


def test_an_input_the_model_was_not_called_with_is_no_site() -> None:
    ids, _ = _batch()
    tapped = fxprobe.tap(_gpt2(), ops="attention_mask", tracer="dynamo")
    with pytest.raises(fxprobe.SelectorError, match="attention_mask"), torch.no_grad():
        tapped(input_ids=ids, use_cache=False)


def test_hooks_have_no_input_sites_and_say_so() -> None:
    with pytest.raises(fxprobe.SelectorError, match="attention_mask"):
        fxprobe.tap(_gpt2(), ops="attention_mask", tracer="hooks")


def test_the_padding_recipe_of_the_disk_docs(monkeypatch: pytest.MonkeyPatch,
                                             tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    """docs/disk.md's padded-batch recipe runs as written; its dataset has one row per real
    token, equal to block 0's output (a forward hook on an untapped copy) at that token."""
    section = DOCS.read_text().split("### Padded batches of a transformer")[1]
    code = re.findall(r"```python\n(.*?)```", section, flags=re.S)[0]
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    scope: dict[str, Any] = {"__name__": "__docs__"}
    exec(compile(code, "docs/disk.md (padded batches)", "exec"), scope)
    assert capsys.readouterr().out.split("\n")[:2] == [
        "['attention_mask', 'transformer.h.0']", "24"]
    ids, mask, acts = scope["ids"], scope["mask"], scope["acts"]
    model = _gpt2()
    model.config._attn_implementation = "sdpa"  # the recipe's default attention
    seen: list[torch.Tensor] = []
    model.transformer.h[0].register_forward_hook(
        lambda m, a, o: seen.append((o[0] if isinstance(o, tuple) else o).clone()))
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    real = seen[0][mask.bool()]                  # (real tokens, width), row-major
    assert len(acts) == 2 * int(mask.sum())
    rows = torch.stack([acts[i] for i in range(len(acts))])
    torch.testing.assert_close(rows, torch.cat([real, real]))


def test_inputs_are_reached_per_call() -> None:
    """``run_with_cache`` keeps an input and ``intervene`` edits it, the first per-call run
    (a graph named again, after dynamo dropped its inputs' sources) included."""
    ids, mask = _batch()
    edited = mask.clone()
    edited[1, :3] = 0
    tapped = fxprobe.tap(_gpt2(), ops="blocks.0.resid_post", tracer="dynamo")
    model = _gpt2()
    with torch.no_grad():
        tapped(input_ids=ids, attention_mask=mask, use_cache=False)
        _, cache = tapped.run_with_cache(input_ids=ids, attention_mask=mask, use_cache=False,
                                         names=["input_ids", "attention_mask"])
        with tapped.intervene({"attention_mask": lambda s, v: edited}):
            out = tapped(input_ids=ids, attention_mask=mask, use_cache=False).logits
        expected = model(input_ids=ids, attention_mask=edited, use_cache=False).logits
    assert torch.equal(cache["input_ids"], ids) and torch.equal(cache["attention_mask"], mask)
    torch.testing.assert_close(out, expected)
