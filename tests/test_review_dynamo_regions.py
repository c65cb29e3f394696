"""Review of repeated blocks traced once (``frontends/dynamo_inline.py``): models whose layers
are called in other orders, twice, or per-layer configured; every site name and value as with
``FXPROBE_DYNAMO_REGIONS=0`` and as forward hooks that clone on an untapped copy."""

from __future__ import annotations

import copy
import types
from typing import Any

import pytest
import torch
from torch import nn

import fxprobe


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.lin2 = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.lin2(torch.relu(self.lin(x)))


class _Ordered(nn.Module):
    config = types.SimpleNamespace(use_cache=False)  # says it keeps no cache: marked

    def __init__(self, order: list[int]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Layer() for _ in range(4))
        self.order = order

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i in self.order:
            x = self.layers[i](x)
        return x * 2


def _run(order: list[int], on: bool, monkeypatch: pytest.MonkeyPatch,
         xs: list[torch.Tensor]) -> tuple[list[str], list[dict[str, Any]], Any]:
    monkeypatch.setenv("FXPROBE_DYNAMO_REGIONS", "1" if on else "0")
    torch.manual_seed(0)
    tapped = fxprobe.tap(_Ordered(order), ops=fxprobe.where(lambda s: True), tracer="dynamo")
    taps = []
    for x in xs:
        tapped(x)
        taps.append({k: v.detach().clone() for k, v in tapped.taps.items()})
    return ([s.name for s in tapped.known_sites()], taps,
            tapped._lifecycle().program.dynamo[""].inlined)


def _hooks(order: list[int], x: torch.Tensor) -> dict[str, list[torch.Tensor]]:
    torch.manual_seed(0)
    model = copy.deepcopy(_Ordered(order))
    seen: dict[str, list[torch.Tensor]] = {}
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear):
            m.register_forward_hook(
                lambda m, a, o, name=name: seen.setdefault(name, []).append(o.detach().clone()))
    model(x)
    return seen


@pytest.mark.parametrize("order", [[3, 2, 1, 0], [2, 0, 3, 1], [0, 1, 0, 2, 3, 3]])
def test_layers_called_out_of_order_or_twice(order: list[int],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A layer called twice (``layers[0]`` twice) was inlined with the second call's sites
    named as the first's (``layers.0.lin`` held the second call's value, the first call's
    named ``layers.0.lin.linear``): such a block is now traced on its own."""
    xs = [torch.randn(5, 8), torch.randn(7, 8), torch.randn(5, 8)]
    off = _run(order, False, monkeypatch, xs)
    on = _run(order, True, monkeypatch, xs)
    assert on[0] == off[0]
    twice = len(set(order)) != len(order)
    assert on[2][1] == (0 if twice else 1)
    for got, want in zip(on[1], off[1], strict=True):
        assert got.keys() == want.keys()
        for name, value in want.items():
            torch.testing.assert_close(got[name], value, msg=name)
    for x, taps in zip(xs, on[1], strict=True):
        ref = _hooks(order, x)
        for name, values in ref.items():
            for i, value in enumerate(values):
                torch.testing.assert_close(taps[name if i == 0 else f"{name}_{i}"], value)


class _Varied(nn.Module):
    """A layer that differs per instance in ways no parameter shows."""

    def __init__(self, i: int, kind: str) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.kind, self.layer_idx, self.scale = kind, i, 1.0 + i
        self.window = 2 if i % 2 else None
        self.t = torch.full((8,), float(i))  # a tensor attribute, no buffer
        self.act = torch.relu if i % 2 else torch.tanh
        self.drop = nn.Dropout(0.2 if i % 2 else 0.5)
        self.eps = [1e-3, 1e-1][i % 2]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        if self.kind == "idx" and self.layer_idx % 2:
            h = h * 2
        elif self.kind == "scale":
            h = h * self.scale
        elif self.kind == "window" and self.window is not None:
            h = h[-self.window:].sum(0, keepdim=True) + h
        elif self.kind == "training" and self.training:
            h = h + 100
        elif self.kind == "tensor":
            h = h + self.t
        elif self.kind == "act":
            h = self.act(h)
        elif self.kind == "drop":
            h = self.drop(h)
        elif self.kind == "eps":
            h = h / (h.abs().mean() + self.eps)
        return x + h


class _VariedStack(nn.Module):
    config = types.SimpleNamespace(use_cache=False)

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Varied(i, kind) for i in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x * 2


@pytest.mark.parametrize("kind", ["idx", "scale", "window", "training", "tensor", "act", "drop",
                                  "eps", "shared"])
def test_layers_that_differ_per_instance(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Per-layer branches, floats, windows, training flags, tensor attributes, activations,
    dropout rates and shared submodules: each layer's value as hooks on an untapped copy see
    it, over two calls (a new shape), dropout drawn under the same seed."""
    monkeypatch.setenv("FXPROBE_DYNAMO_REGIONS", "1")
    torch.manual_seed(0)
    model = _VariedStack(kind).eval()
    if kind == "training":
        model.layers[1].train()
    elif kind == "drop":
        model.train()
    elif kind == "shared":
        model.layers[2].lin = model.layers[0].lin
    ref_model = copy.deepcopy(model)
    tapped = fxprobe.tap(model, ops=fxprobe.where(lambda s: True), tracer="dynamo")
    for x in (torch.randn(5, 8), torch.randn(7, 8)):
        ref: dict[int, torch.Tensor] = {}
        handles = [layer.register_forward_hook(
            lambda m, a, o, i=i, ref=ref: ref.__setitem__(i, o.detach().clone()))
            for i, layer in enumerate(ref_model.layers)]
        torch.manual_seed(5)
        want = ref_model(x)
        for h in handles:
            h.remove()
        torch.manual_seed(5)
        got = tapped(x)
        torch.testing.assert_close(got, want)
        for i in range(4):
            torch.testing.assert_close(tapped.taps[f"layers.{i}"], ref[i])
    assert not any("forward" in m.__dict__ for m in model.modules())


def _qwen2_sequence(on: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, list[Any]]:
    import transformers as tf

    monkeypatch.setenv("FXPROBE_DYNAMO_REGIONS", "1" if on else "0")
    torch.manual_seed(0)
    model = tf.Qwen2Model(tf.Qwen2Config(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
        vocab_size=100, max_position_embeddings=64, num_hidden_layers=4, head_dim=8,
        use_sliding_window=True, sliding_window=3, max_window_layers=0,
        layer_types=["full_attention", "sliding_attention"] * 2,
        attn_implementation="eager")).eval()
    tapped = fxprobe.tap(model, ops=fxprobe.where(lambda s: True), tracer="dynamo")
    ids = torch.randint(2, 100, (2, 7), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[0, :3] = 0
    runs = []

    def keep(out: Any) -> None:
        runs.append((out.last_hidden_state.detach().clone(),
                     {k: v.detach().clone() for k, v in tapped.taps.items()
                      if isinstance(v, torch.Tensor)}))

    edits = {"blocks.1.attn.pattern": lambda s, v: v * 0.5,
             "blocks.3.attn.q": lambda s, v: v + 1,
             "layers.2.add_1": lambda s, v: v * 2}
    with tapped.intervene(edits):
        keep(tapped(input_ids=ids, attention_mask=mask, use_cache=False,
                    output_hidden_states=True, output_attentions=True))
    keep(tapped(input_ids=ids, attention_mask=mask, use_cache=False))
    return tapped._lifecycle().program.dynamo[""].inlined, runs


def test_qwen2_alternating_sliding_window_with_padding_and_edits(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Full and sliding layers alternating, a padded mask,
    per-call edits of layers 1-3 (a pattern, a query, an op by its dynamo name), hidden
    states and attentions returned: every value as with the marking off."""
    off_inlined, off = _qwen2_sequence(False, monkeypatch)
    on_inlined, on = _qwen2_sequence(True, monkeypatch)
    # output_attentions installs transformers' output-capturing hooks on every layer and
    # its attention: hooked blocks are not marked (tests/test_block_hooks.py).
    assert off_inlined == on_inlined == (0, 0)
    assert not torch.equal(off[0][0], off[1][0])  # the edits applied
    for (out_on, taps_on), (out_off, taps_off) in zip(on, off, strict=True):
        torch.testing.assert_close(out_on, out_off)
        assert taps_on.keys() == taps_off.keys()
        for name, value in taps_off.items():
            torch.testing.assert_close(taps_on[name], value, msg=name)
