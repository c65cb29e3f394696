"""Shared blocks (``FXPROBE_DYNAMO_REGIONS=shared``, ``frontends/dynamo_blocks.py``) against
independent references over sequences of calls: the untapped model's eager output, forward
hooks that clone on an untapped copy, and the whole-model capture (``FXPROBE_DYNAMO_REGIONS=0``).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

import fxprobe

_CONFIG = type("Config", (), {"use_cache": False, "is_decoder": False})()


def _hooks(model: nn.Module, paths: list[str]) -> dict[str, torch.Tensor]:
    """Each module's output (cloned), filled as ``model`` runs."""
    seen: dict[str, torch.Tensor] = {}
    for p in paths:
        model.get_submodule(p).register_forward_hook(
            lambda m, a, o, p=p: seen.__setitem__(p, o.detach().clone()))
    return seen


def _tap(model: nn.Module, monkeypatch: pytest.MonkeyPatch, mode: str = "shared",
         ops: Any = None) -> Any:
    monkeypatch.setenv("FXPROBE_DYNAMO_REGIONS", mode)
    return fxprobe.tap(model, ops=ops or fxprobe.where(lambda s: True), tracer="dynamo")


class _Stage(nn.Module):
    def __init__(self, stride: int) -> None:
        super().__init__()
        self.conv = nn.Conv1d(4, 4, 3, stride=stride, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.conv(x))


class _Pyramid(nn.Module):
    """Stages of one class and parameter shapes, the first keeping the length, the others
    halving it (the stride an attribute of the convolution, not a tensor)."""

    config = _CONFIG

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Conv1d(4, 4, 1)
        self.stages = nn.ModuleList([_Stage(1), _Stage(2), _Stage(2)])
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for stage in self.stages:
            x = stage(x)
        return self.head(x.sum(-1) / x.shape[-1])


def test_blocks_alike_but_for_a_stride_each_get_their_own_output_shape(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Stage 1 reads what stage 0 read (same shapes, same parameter shapes) but halves the
    length: its output made on fake tensors must not be stage 0's (the mean after the stages
    divided by the wrong length, and the stages named a residual stream)."""
    torch.manual_seed(0)
    model = _Pyramid().eval()
    reference = copy.deepcopy(model)
    seen = _hooks(reference, [f"stages.{i}" for i in range(3)])
    tapped = _tap(model, monkeypatch)
    for length in (16, 20):
        x = torch.randn(2, 4, length)
        with torch.no_grad():
            torch.testing.assert_close(tapped(x), reference(x))
        for name, value in seen.items():
            torch.testing.assert_close(tapped.taps[name], value)
    assert not any(s.canonical for s in tapped.known_sites())  # no residual stream here


class _Scaled(nn.Module):
    def __init__(self, index: int) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.index = index  # read by the forward: dynamo captures each instance on its own

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.lin(x) * (self.index + 1)


class _Indexed(nn.Module):
    config = _CONFIG

    def __init__(self, layers: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        self.layers = nn.ModuleList(_Scaled(i) for i in range(layers))
        self.out = nn.Linear(8, 20)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


def test_more_blocks_reading_their_index_than_the_recompile_limit(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """One code object runs every block: a graph per instance (a layer reading its index)
    must not count against recompile_limit as recompilations of one frame (the whole model
    captured without sharing, FXPROBE_DYNAMO_REGIONS=1, runs; sharing raised)."""
    torch.manual_seed(0)
    model = _Indexed(3).eval()
    reference = copy.deepcopy(model)
    seen = _hooks(reference, [f"layers.{i}.lin" for i in range(3)])
    with torch._dynamo.config.patch(recompile_limit=2):
        tapped = _tap(model, monkeypatch)
        for length in (5, 6):
            ids = torch.randint(0, 20, (2, length))
            with torch.no_grad():
                torch.testing.assert_close(tapped(ids), reference(ids))
            for name, value in seen.items():
                torch.testing.assert_close(tapped.taps[name], value)


def test_output_attentions_turned_on_in_a_later_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers records ``output_attentions`` by hooks it sets inside the forward: the
    blocks' call then runs unshared, and returns every layer's attentions (none were
    returned), with every block's output as hooks on an untapped copy see it."""
    from canonical_support import tf

    torch.manual_seed(0)
    model = tf.BertModel(tf.BertConfig(
        num_hidden_layers=2, hidden_size=16, num_attention_heads=2, intermediate_size=32,
        vocab_size=50, max_position_embeddings=32)).eval()
    model.config._attn_implementation = "eager"
    reference = copy.deepcopy(model)
    seen = {}
    for i, layer in enumerate(reference.encoder.layer):
        layer.register_forward_hook(lambda m, a, o, i=i: seen.__setitem__(
            f"blocks.{i}.resid_post", (o[0] if isinstance(o, tuple) else o).detach().clone()))
    tapped = _tap(model, monkeypatch)
    for step, attentions in enumerate([False, True]):
        ids = torch.randint(2, 50, (2, 5 + step))
        with torch.no_grad():
            out = tapped(input_ids=ids, output_attentions=attentions)
            want = reference(input_ids=ids, output_attentions=attentions)
        torch.testing.assert_close(out.last_hidden_state, want.last_hidden_state)
        assert len(out.attentions or ()) == len(want.attentions or ()), step
        for got, expected in zip(out.attentions or (), want.attentions or (), strict=True):
            torch.testing.assert_close(got, expected)
        names = {c: s.name for s in tapped.known_sites() for c in s.canonical}
        for name, value in seen.items():
            torch.testing.assert_close(tapped.taps[names[name]], value)
