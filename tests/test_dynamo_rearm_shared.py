"""``FXPROBE_DYNAMO_REGIONS=shared``: a raise inside a shared block (its own code run by the
shared blocks' function) then later calls, plain and with an edit, against the untapped model
with hooks; and T5 (two stacks of one class, not shared) over a prefill and steps with a KV
cache, an edit of a decoder layer's output, against hooks."""

from __future__ import annotations

import types
from typing import Any

import pytest
import torch
import transformers as tf
from reference import hooked
from torch import nn

import fxprobe


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.out = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, fail: bool = False) -> torch.Tensor:
        h = torch.relu(self.fc(x))
        if fail:
            raise ValueError("bad block")
        return x + self.out(h)


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.config = types.SimpleNamespace(use_cache=False)
        self.layers = nn.ModuleList([Block() for _ in range(3)])

    def forward(self, x: torch.Tensor, fail_at: int = -1) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x, fail=i == fail_at)
        return x


def test_a_raise_inside_a_shared_block(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FXPROBE_DYNAMO_REGIONS", "shared")
    torch.manual_seed(0)
    model = Stack()
    tapped = fxprobe.tap(model, ops="layers.*.fc", tracer="dynamo")
    with torch.no_grad():
        tapped(torch.randn(2, 8))
        for fail_at in (1, 2):
            with pytest.raises(ValueError, match="bad block"):
                tapped(torch.randn(2, 8), fail_at)
            for n in (2, 3):
                x = torch.randn(n, 8)
                torch.testing.assert_close(tapped(x), model(x))
                h = x
                for i, layer in enumerate(model.layers):
                    torch.testing.assert_close(tapped.taps[f"layers.{i}.fc"], layer.fc(h))
                    h = layer(h)
        with tapped.intervene({"layers.1.fc": lambda s, v: v * 3}):
            edited = tapped(x)
        ref, _ = hooked(model, lambda: model(x), {"layers.1.fc": lambda o: o * 3})
        torch.testing.assert_close(edited, ref)


def _t5_steps(call: Any, ids: torch.Tensor) -> list[torch.Tensor]:
    past, dec, outs = None, torch.zeros(2, 1, dtype=torch.long), []
    for step in range(3):
        out = call(input_ids=ids, decoder_input_ids=dec[:, -1:], past_key_values=past,
                   use_cache=True)
        past = out.past_key_values
        outs.append(out.logits)
        dec = torch.cat([dec, torch.tensor([[3 + step], [5 + step]])], 1)
    return outs


def test_t5_two_stacks_over_steps_with_a_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    model = tf.T5ForConditionalGeneration(tf.T5Config(
        vocab_size=100, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
        decoder_start_token_id=0, pad_token_id=0)).eval()
    ids = torch.randint(1, 100, (2, 5), generator=torch.Generator().manual_seed(1))
    layer = model.decoder.block[0]
    with torch.no_grad():
        handle = layer.register_forward_hook(
            lambda m, a, o: (o[0] * 0.5, *o[1:]) if isinstance(o, tuple) else o * 0.5)
        try:
            ref = _t5_steps(model, ids)
        finally:
            handle.remove()
        plain = _t5_steps(model, ids)
        monkeypatch.setenv("FXPROBE_DYNAMO_REGIONS", "shared")
        tapped = fxprobe.tap(model, ops="decoder.blocks.*.resid_post", tracer="dynamo")

        def edited(**kwargs: Any) -> Any:
            with tapped.intervene({"decoder.blocks.0.resid_post": lambda s, v: v * 0.5}):
                return tapped(**kwargs)

        for step, (a, b) in enumerate(zip(_t5_steps(edited, ids), ref, strict=True)):
            torch.testing.assert_close(a, b, msg=f"step {step}")
        for step, (a, b) in enumerate(zip(_t5_steps(tapped, ids), plain, strict=True)):
            torch.testing.assert_close(a, b, msg=f"plain step {step}")
