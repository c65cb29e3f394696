"""Sequences of shapes through dynamo regions, and module sites after in-place writes, against
forward hooks that clone on an untapped copy of the model."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

import fxprobe

transformers = pytest.importorskip("transformers")


def _hooked(model: nn.Module, names: list[str], *args: Any, **kwargs: Any
            ) -> tuple[Any, dict[str, torch.Tensor]]:
    ref = copy.deepcopy(model)
    seen: dict[str, torch.Tensor] = {}
    for name in names:
        def keep(m: nn.Module, a: Any, out: Any, name: str = name) -> None:
            seen.setdefault(name, (out[0] if isinstance(out, tuple) else out).detach().clone())
        ref.get_submodule(name).register_forward_hook(keep)
    with torch.no_grad():
        out = ref(*args, **kwargs)
    return out, seen


@pytest.mark.parametrize("tracer", ["dynamo", "auto"])
def test_gpt2_lengths_and_batches_in_one_life_equal_hooks(tracer: str) -> None:
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=100)).eval()
    names = ["transformer.h.0.mlp", "transformer.h.1.attn.c_proj", "transformer.ln_f"]
    torch._dynamo.reset()
    tapped = fxprobe.tap(model, ops=names, tracer=tracer)
    for batch, length in [(1, 1), (1, 7), (2, 3), (3, 16), (2, 7)]:
        ids = torch.randint(0, 100, (batch, length))
        kwargs: dict[str, Any] = {}
        if batch > 1:  # left padding
            mask = torch.ones(batch, length, dtype=torch.long)
            mask[0, :2] = 0
            kwargs["attention_mask"] = mask
        with torch.no_grad():
            out = tapped(ids, **kwargs)
        expected, seen = _hooked(model, names, ids, **kwargs)
        torch.testing.assert_close(out.logits, expected.logits)
        for name, value in seen.items():
            torch.testing.assert_close(tapped.taps[name], value, msg=f"{name} {batch}x{length}")


class _ViewWrite(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        y.view(-1).add_(1)  # writes y in place through a view
        return y


class _Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = _ViewWrite()
        self.head = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.w(x))


@pytest.mark.parametrize("tracer", ["fx", "dynamo"])
def test_a_module_that_writes_its_output_through_a_view_equals_hooks(tracer: str) -> None:
    torch.manual_seed(0)
    model = _Outer().eval()
    torch._dynamo.reset()
    tapped = fxprobe.tap(model, ops=["w"], tracer=tracer)
    for x in [torch.randn(3, 4), torch.randn(5, 4)]:
        with torch.no_grad():
            tapped(x)
        _, seen = _hooked(model, ["w"], x)
        torch.testing.assert_close(tapped.taps["w"], seen["w"])


class _Branches(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > 4:
            return self.a(x).relu()
        return self.b(x) * 2


class _OnBranches(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blk = _Branches()
        self.head = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blk(x))


def test_a_module_branching_on_length_keeps_its_site_in_the_second_graph() -> None:
    torch.manual_seed(0)
    model = _OnBranches().eval()
    tapped = fxprobe.tap(model, ops=["blk", "head"], tracer="dynamo")
    for length in [1, 7, 3]:
        x = torch.randn(length, 4)
        with torch.no_grad():
            tapped(x)
        _, seen = _hooked(model, ["blk", "head"], x)
        assert sorted(tapped.taps) == ["blk", "head"], length
        for name, value in seen.items():
            torch.testing.assert_close(tapped.taps[name], value)
