"""Dynamo regions capture with dynamic shapes from the first call: a new sequence length or
batch size runs the graphs already captured (counted through ``tapped.dynamo_info``), with values
equal to the untapped model and to forward hooks on an untapped copy at every shape; where the
model's code needs an exact size, one warning names the module and the input."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import fxprobe

transformers = pytest.importorskip("transformers")

SHAPES = [(2, 8), (3, 11), (2, 5), (4, 16), (3, 3)]


def _llama(layers: int = 2) -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=100, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(cfg).eval()


def _hooked(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The logits and each layer's output, by forward hooks that clone, on an untapped copy."""
    ref = copy.deepcopy(model)
    seen: list[torch.Tensor] = []
    handles = [layer.register_forward_hook(
        lambda m, i, o: seen.append((o[0] if isinstance(o, tuple) else o).detach().clone()))
        for layer in ref.model.layers]
    try:
        with torch.no_grad():
            logits = ref(x).logits
    finally:
        for h in handles:
            h.remove()
    return logits, seen


def test_new_lengths_and_batches_capture_nothing_new() -> None:
    model = _llama()
    tapped = fxprobe.tap(model, ops=["blocks.*.resid_post", "logits"], tracer="dynamo")
    for i, shape in enumerate(SHAPES):
        x = torch.randint(0, 100, shape, generator=torch.Generator().manual_seed(i))
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)  # no static-size report here
            out = tapped(x)
        logits, layers = _hooked(model, x)
        with torch.no_grad():
            assert torch.equal(out.logits, model(x).logits), shape
        assert torch.equal(out.logits, logits), shape
        assert torch.equal(tapped.taps["logits"], logits), shape
        for n, value in enumerate(layers):
            assert torch.equal(tapped.taps[f"blocks.{n}.resid_post"], value), (shape, n)
        (info,) = tapped.dynamo_info
        # the first captures serve every shape: the model's graph and its layers' own one
        # (captured once for every layer, frontends/dynamo_blocks.py)
        assert info.graphs == 2, (shape, info)


def test_a_length_of_one_first_keeps_every_canonical_name() -> None:
    """A length of 1 at the first call (decoding; dynamo specializes it): the block names are
    found for every block, and a longer input afterwards keeps them."""
    model = _llama()
    tapped = fxprobe.tap(model, ops="blocks.*.resid_post", tracer="dynamo")
    for shape in [(2, 1), (3, 8), (2, 1)]:
        x = torch.randint(0, 100, shape)
        with torch.no_grad():
            tapped(x)
        _, layers = _hooked(model, x)
        for n, value in enumerate(layers):
            assert torch.equal(tapped.taps[f"blocks.{n}.resid_post"], value), (shape, n)


def test_sizes_are_no_sites() -> None:
    """A dynamic graph computes sizes (``s0 * 2``); they are not sites: the names are the
    tensors' only, each site's value a tensor."""
    model = _llama()
    tapped = fxprobe.tap(model, tracer="dynamo")
    x = torch.randint(0, 100, (2, 6))
    with torch.no_grad():
        tapped(x)
    for name in tapped.taps.keys():
        value = tapped.taps[name]
        assert not isinstance(value, (int, torch.SymInt, torch.Size)), name


class _Branchy(nn.Module):
    """Needs its input's length exactly (a branch on it): that size cannot be dynamic."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        if x.shape[1] == 8:
            return y.relu()
        return y.tanh()


def test_a_size_the_model_needs_exactly_is_reported_and_stays_right() -> None:
    torch.manual_seed(0)
    model = _Branchy().eval()
    tapped = fxprobe.tap(model, ops=["fc"], tracer="dynamo")
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tapped(torch.randn(2, 8, 4))
    (message,) = [str(w.message) for w in caught if "static" in str(w.message)]
    assert "_Branchy" in message and "'x'" in message and "dim 1" in message
    for shape in [(3, 8, 4), (2, 5, 4), (4, 8, 4)]:
        x = torch.randn(*shape)
        with torch.no_grad():
            assert torch.equal(tapped(x), model(x)), shape
            assert torch.equal(tapped.taps["fc"], model.fc(x)), shape
    (info,) = tapped.dynamo_info
    assert info.graphs == 2  # the batch is dynamic; the other length is captured once more
