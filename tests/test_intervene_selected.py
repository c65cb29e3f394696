"""A per-call block on the sites ``tap()`` selected runs the graph dynamo captured as it is.

A graph built for ``tap()`` carries an intervention point at each site it selected, so an
``intervene`` block or a ``run_with_cache`` on those sites builds no second graph (on a 32-layer
model that second graph took a second or more to build); a block that names any other site of
the graph runs the version with a point at every site, as before. Every call of the sequences
below is compared with forward hooks on an untapped copy (the reference), and the sequences
mix both paths, new lengths and plain calls in between, so that no edit outlives its block.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import fxprobe

transformers = pytest.importorskip("transformers")


def _llama(layers: int = 3) -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=100, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(cfg).eval()


def _reference(model: nn.Module, x: torch.Tensor,
               edits: dict[str, Callable[[torch.Tensor], torch.Tensor]]
               ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The logits and the output of every decoder layer (cloned) of an untapped copy whose
    modules at the paths in ``edits`` have their output replaced by forward hooks."""
    ref = copy.deepcopy(model)
    seen: dict[str, torch.Tensor] = {}
    handles = []
    for path, fn in edits.items():
        handles.append(ref.get_submodule(path).register_forward_hook(
            lambda m, i, o, fn=fn: fn(o)))
    for n, layer in enumerate(ref.model.layers):
        handles.append(layer.register_forward_hook(
            lambda m, i, o, n=n: seen.__setitem__(f"blocks.{n}.resid_post", o.detach().clone())))
    try:
        with torch.no_grad():
            logits = ref(x).logits
    finally:
        for h in handles:
            h.remove()
    return logits, seen


def _versions(tapped: Any) -> list[Any]:
    region = tapped._lifecycle().program.dynamo[""]
    return [v for c in region.captured for v in c.versions.values()]


def _steer(v: torch.Tensor) -> torch.Tensor:
    return v + torch.linspace(-1, 1, v.shape[-1])


@torch.no_grad()
def test_blocks_on_selected_sites_equal_hooks_and_need_no_second_graph() -> None:
    model = _llama()
    tapped = fxprobe.tap(model, ops="blocks.*.resid_post", tracer="dynamo")
    steer: dict[str, Any] = {"blocks.1.resid_post": lambda s, v: _steer(v)}
    for length in [6, 9]:
        x = torch.randint(0, 100, (2, length))
        want, seen = _reference(model, x, {"model.layers.1": _steer})
        with tapped.intervene(steer):
            out = tapped(x)
        torch.testing.assert_close(out.logits, want)
        for name, value in seen.items():  # the taps keep what flowed on, after the edit
            torch.testing.assert_close(tapped.taps[name], value)
        plain, seen = _reference(model, x, {})
        torch.testing.assert_close(tapped(x).logits, plain)  # the block is over: no edit
        _, cache = tapped.run_with_cache(x, names="blocks.2.resid_post")
        torch.testing.assert_close(cache["blocks.2.resid_post"], seen["blocks.2.resid_post"])
    assert all(v.pointed is None for v in _versions(tapped))  # no graph built for the blocks


@torch.no_grad()
def test_a_block_on_another_site_runs_the_graph_with_every_point_and_both_stay_right() -> None:
    """Selected site, unselected site, both, then the selected one again: each equal to
    hooks; the version with every point is built once and used only where needed."""
    model = _llama()
    tapped = fxprobe.tap(model, ops="blocks.*.resid_post", tracer="dynamo")
    x = torch.randint(0, 100, (2, 7))
    half: Callable[[torch.Tensor], torch.Tensor] = lambda v: v * 0.5  # noqa: E731
    sequence: list[dict[str, tuple[str, Callable[[torch.Tensor], torch.Tensor]]]] = [
        {"blocks.0.resid_post": ("model.layers.0", _steer)},
        {"model.layers.1.mlp": ("model.layers.1.mlp", half)},
        {"blocks.0.resid_post": ("model.layers.0", _steer),
         "model.layers.2.mlp": ("model.layers.2.mlp", half)},
        {"blocks.2.resid_post": ("model.layers.2", _steer)},
    ]
    for step, edits in enumerate(sequence):
        fns = {name: (lambda s, v, fn=fn: fn(v)) for name, (_, fn) in edits.items()}
        want, seen = _reference(model, x, dict(edits.values()))
        with tapped.intervene(fns):
            out = tapped(x)
        torch.testing.assert_close(out.logits, want, msg=f"step {step}")
        for name, value in seen.items():
            torch.testing.assert_close(tapped.taps[name], value, msg=f"step {step} {name}")
        plain, _ = _reference(model, x, {})
        torch.testing.assert_close(tapped(x).logits, plain, msg=f"after step {step}")
    # The graph with every point is built only for the layers whose unselected sites were
    # edited (each layer's own graph, captured once for every layer); the graph around the
    # layers holds the selected layer calls, already behind points.
    pointed = {v.prefix for v in _versions(tapped) if v.pointed is not None}
    assert pointed == {"model.layers.1", "model.layers.2"}


@torch.no_grad()
def test_a_block_composes_with_the_tap_function_as_the_version_with_every_point_does() -> None:
    """``tap(fn=)`` on a selected site and a per-call edit of it: the per-call function runs
    first, ``fn`` on what it returned, in both versions."""
    model = _llama(2)
    tapped = fxprobe.tap(model, ops="blocks.0.resid_post", tracer="dynamo",
                         fn=lambda s, v: v + 1.0)
    x = torch.randint(0, 100, (1, 5))
    want, _ = _reference(model, x, {"model.layers.0": lambda v: v * 2.0 + 1.0})
    with tapped.intervene({"blocks.0.resid_post": lambda s, v: v * 2.0}):
        selected_only = tapped(x).logits
    with tapped.intervene({"blocks.0.resid_post": lambda s, v: v * 2.0,
                           "model.layers.1.mlp": lambda s, v: None}):
        every_point = tapped(x).logits
    torch.testing.assert_close(selected_only, want)
    torch.testing.assert_close(every_point, want)


@torch.no_grad()
def test_caches_that_alternate_between_a_selected_site_and_another_stay_right() -> None:
    """Tables made and dropped in turn (CPython gives a new one the address of the last):
    which version serves a table is decided for each table, never for an address."""
    model = _llama(2)
    tapped = fxprobe.tap(model, ops="blocks.0.resid_post", tracer="dynamo")
    x = torch.randint(0, 100, (2, 5))
    ref = copy.deepcopy(model)
    seen: dict[str, torch.Tensor] = {}
    handles = [ref.get_submodule(p).register_forward_hook(
        lambda m, i, o, p=p: seen.__setitem__(p, o.detach().clone()))
        for p in ("model.layers.0", "model.layers.1.mlp")]
    ref(x)
    for h in handles:
        h.remove()
    for _ in range(6):
        for name, path in [("blocks.0.resid_post", "model.layers.0"),
                           ("model.layers.1.mlp", "model.layers.1.mlp")]:
            _, cache = tapped.run_with_cache(x, names=name)
            assert len(cache) == 1, list(cache)
            torch.testing.assert_close(cache[name], seen[path])
