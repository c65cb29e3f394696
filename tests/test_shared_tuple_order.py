"""``FXPROBE_DYNAMO_REGIONS=shared`` on blocks that return tuples other than (stream, extra):
the stream as element 1 (``(attention weights, hidden)``), element 0 read twice by the model,
element 0 never read, one block. The names around the shared blocks (``blocks.L.resid_pre``,
``resid_post``) and their values as in the unset mode and as hooks cloning each block's
stream on the untapped model; an edit of ``resid_post`` as a hook editing it."""

from __future__ import annotations

import types
from typing import Any

import pytest
import torch
from torch import nn

import fxprobe


class Block(nn.Module):
    def __init__(self, order: str) -> None:
        super().__init__()
        self.fc, self.att, self.order = nn.Linear(8, 8), nn.Linear(8, 8), order

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = x + torch.tanh(self.fc(x))
        w = torch.sigmoid(self.att(x))  # same shape as the stream
        return (w, h) if self.order == "weights-first" else (h, w)


class Stack(nn.Module):
    def __init__(self, order: str) -> None:
        super().__init__()
        self.config = types.SimpleNamespace(use_cache=False)
        self.embed = nn.Linear(4, 8)
        self.layers = nn.ModuleList([Block(order) for _ in range(3)])
        self.head = nn.Linear(8, 4)
        self.order = order

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        extra = torch.zeros_like(h)
        for layer in self.layers:
            out = layer(h)
            if self.order == "weights-first":
                h, extra = out[1], extra + out[0]
            elif self.order == "twice":
                h, extra = out[0], extra + out[0] * out[1]
            else:  # "unread": the stream is element 0, the model keeps only element 1
                h = h + out[1]
        return self.head(h + extra)


def _stream(order: str, out: Any) -> torch.Tensor:
    return out[1] if order == "weights-first" else out[0]


def _tapped(model: Stack, mode: str, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv("FXPROBE_DYNAMO_REGIONS", mode)
    return fxprobe.tap(model, ops=fxprobe.where(lambda s: True), tracer="dynamo")


@pytest.mark.parametrize("order", ["weights-first", "twice", "unread"])
def test_stream_names_and_edits_around_tuple_blocks(
        order: str, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    model = Stack(order).eval()
    got: dict[str, dict[str, torch.Tensor]] = {}
    edited: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for mode in ("1", "shared"):
            tapped = _tapped(model, mode, monkeypatch)
            x = torch.randn(2, 3, 4)
            for n in (2, 3):  # a second call with a new batch
                x = torch.randn(n, 3, 4, generator=torch.Generator().manual_seed(n))
                out = tapped(x)
                torch.testing.assert_close(out, model(x))
            names = {c: s.name for s in tapped.known_sites() for c in s.canonical}
            got[mode] = {c: tapped.taps[nm].clone() for c, nm in names.items()
                         if nm in tapped.taps}
            if "blocks.1.resid_post" in names:
                with tapped.intervene({"blocks.1.resid_post": lambda s, v: v * 2 - 1}):
                    edited[mode] = tapped(x)
            torch.testing.assert_close(tapped(x), model(x))  # no edit left behind
        kept: dict[int, torch.Tensor] = {}
        handles = [layer.register_forward_hook(
            lambda m, a, o, i=i: kept.__setitem__(i, _stream(order, o).clone()))
            for i, layer in enumerate(model.layers)]
        try:
            model(x)
        finally:
            for h in handles:
                h.remove()

        def edit(m: nn.Module, a: Any, o: Any) -> Any:
            s = _stream(order, o) * 2 - 1
            return (o[0], s) if order == "weights-first" else (s, o[1])

        handle = model.layers[1].register_forward_hook(edit)
        try:
            ref = model(x)
        finally:
            handle.remove()
    for c, v in got["1"].items():  # the unset mode names none of these here (no family)
        torch.testing.assert_close(got["shared"][c], v, msg=c)
    for mode, values in got.items():
        for i, v in kept.items():
            if f"blocks.{i}.resid_post" in values:
                torch.testing.assert_close(values[f"blocks.{i}.resid_post"], v,
                                           msg=f"{mode} blocks.{i}.resid_post")
    for mode, value in edited.items():
        torch.testing.assert_close(value, ref, msg=mode)
    if order != "unread":  # the stream read by the next block is named
        assert "blocks.2.resid_post" in got["shared"] and "shared" in edited


def test_one_block_returning_weights_first_names_no_stream(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """With one block nothing tells which element is the stream: no name, never the weights."""
    torch.manual_seed(0)
    model = Stack("weights-first").eval()
    model.layers = model.layers[:1]
    tapped = _tapped(model, "shared", monkeypatch)
    x = torch.randn(2, 3, 4)
    with torch.no_grad():
        torch.testing.assert_close(tapped(x), model(x))
        names = {c: s.name for s in tapped.known_sites() for c in s.canonical}
        if "blocks.0.resid_post" in names:
            torch.testing.assert_close(tapped.taps[names["blocks.0.resid_post"]],
                                       model.layers[0](model.embed(x))[1])
