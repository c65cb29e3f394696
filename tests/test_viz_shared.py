"""The picture of a model whose repeated blocks are captured once (``FXPROBE_DYNAMO_REGIONS=
shared``): each block's graph is drawn inside the block, fed from what feeds its call and
flowing into it, never from the model's input box. The reference is the picture of the same
model with its blocks marked (one graph, ``FXPROBE_DYNAMO_REGIONS=1``): every data edge between
two ops there is drawn here too, once the blocks' call nodes are passed through."""

from __future__ import annotations

import pytest
import torch
from viz_support import parse_dot

import fxprobe

transformers = pytest.importorskip("transformers")

LAYERS = 3


@pytest.fixture(scope="module")
def llama() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(num_hidden_layers=LAYERS, hidden_size=64,
                                   intermediate_size=128, num_attention_heads=4,
                                   num_key_value_heads=4, vocab_size=100)
    return transformers.LlamaForCausalLM(cfg).eval()


def _picture(model: torch.nn.Module, mode: str, use_cache: bool,
             monkeypatch: pytest.MonkeyPatch) -> tuple[str, dict, set[tuple[str, str]]]:
    monkeypatch.setenv("FXPROBE_DYNAMO_REGIONS", mode)
    tapped = fxprobe.tap(model, ops="blocks.*.resid_post", tracer="dynamo")
    for grad, length in [(False, 5), (True, 6)]:  # then captured again, with gradients
        ids = torch.randint(0, 100, (1, length), generator=torch.Generator().manual_seed(1))
        with torch.set_grad_enabled(grad):
            got = tapped(ids, use_cache=use_cache).logits
        with torch.no_grad():
            want = model(ids, use_cache=use_cache).logits
        torch.testing.assert_close(got, want)
    source = fxprobe.to_dot(tapped, fold=False).source
    nodes, edges = parse_dot(source)
    statements = [line.split(" [", 1)[0].strip() for line in source.splitlines()
                  if " [" in line and "->" not in line]
    assert len(statements) == len(set(statements)), "a node is drawn twice"
    return source, nodes, set(edges)


@pytest.mark.parametrize("use_cache", [True, False], ids=["cache", "no-cache"])
def test_shared_blocks_drawn_inside_their_calls(llama, use_cache, monkeypatch):
    source, nodes, shared = _picture(llama, "shared", use_cache, monkeypatch)
    _, _, marked = _picture(llama, "1", use_cache, monkeypatch)
    calls = [f"model.layers.{i}" for i in range(LAYERS)]
    assert set(calls) <= set(nodes), "each block's call is a site of the graph around them"
    inputs = {"/input", "input_ids"}
    inside = [(a, b) for a, b in shared if a in inputs and b.startswith("model.layers.")]
    assert not inside, f"a block's ops drawn as fed from the model's input: {inside[:3]}"
    # Each block's first op reads what the block before it returned (the first: the
    # embedding), and each call is reached only from ops inside its own block.
    assert ("model.embed_tokens", "model.layers.0.input_layernorm.to") in shared
    for i in range(1, LAYERS):
        assert (calls[i - 1], f"model.layers.{i}.input_layernorm.to") in shared
    for call in calls:
        into = {a for a, b in shared if b == call}
        assert into and all(a.startswith(f"{call}.") for a in into), (call, into)
    assert (calls[-1], "model.norm.to") in shared
    # Through the calls, every edge between two ops of the marked picture is drawn.
    for call in calls:
        ins = {a for a, b in shared if b == call}
        outs = {b for a, b in shared if a == call}
        shared = {e for e in shared if call not in e} | {(a, b) for a in ins for b in outs}
    ends = {"/input", "/output"}
    ops = {(a, b) for a, b in marked if a not in ends and b not in ends}
    assert ops and not ops - shared, sorted(ops - shared)[:5]
    assert (f"1 graph of repeated blocks captured once, drawn in each of the {LAYERS} "
            "blocks that run it") in source
    assert "graph breaks" not in source
