"""Versions of dynamo graphs that keep no site run one untapped function of the captured graph
(``DynamoRegion._untapped``), in the default capture (a graph reused for another instance of
a block split by a graph break) and under ``FXPROBE_DYNAMO_REGIONS=shared``: sequences of
calls that select, edit and read sites inside such versions, each against the untapped model
with forward hooks that edit or clone. And the fake-output key of shared blocks
(``dynamo_blocks._places``): an attribute equal to a block's place in one layer only is
compared (the blocks are no twins); one equal to it in every layer that changes the output's
shape is caught when the blocks run (``DynamoError``), never a silent value."""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from dynamo_support import SplitBlock
from reference import hooked
from torch import nn

import fxprobe
from fxprobe.core.errors import DynamoError

Edit = Callable[[torch.Tensor], torch.Tensor]


class _Stack(nn.Module):
    def __init__(self, split: bool = True, twice: bool = False) -> None:
        super().__init__()
        self.config = types.SimpleNamespace(use_cache=False)
        self.layers = nn.ModuleList([SplitBlock(split) for _ in range(3)])
        self.twice = twice

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(2 if self.twice else 1):
            for layer in self.layers:
                x = layer(x)
        return x


def _versions(tapped: Any) -> dict[str, Any]:
    return {k: v for region in tapped._lifecycle().program.dynamo.values()
            for k, v in region.instrumented().items()}


@pytest.mark.parametrize("mode", ["marked", "shared"])
def test_graph_break_blocks_one_layer_selected_then_edits_reads_and_grads(
        mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Marked (the blocks' graph break leaves them unmarked: the whole capture), each block's
    two graphs are captured for layer 0 and reused for layers 1 and 2; only layer 1 selects a
    site, so layers 0 and 2 run the untapped functions. Shared (the default), the blocks' own
    capture has the graph break. Edits and reads in those layers, a new batch, train mode
    with gradients."""
    monkeypatch.setenv("FXPROBE_DYNAMO_REGIONS", mode)
    torch.manual_seed(0)
    model = _Stack().eval()
    tapped = fxprobe.tap(model, ops="layers.1.fc", tracer="dynamo")
    x = torch.randn(2, 8)
    with torch.no_grad():
        out = tapped(x)
    ref, kept = hooked(model, lambda: model(x), keep=("layers.1.fc",))
    torch.testing.assert_close(out, ref)
    assert list(tapped.taps) == ["layers.1.fc"]
    torch.testing.assert_close(tapped.taps["layers.1.fc"], kept["layers.1.fc"][0])
    versions = _versions(tapped)
    first = [v for k, v in versions.items() if k.startswith("dynamo::0")]
    if mode == "marked":
        assert len(first) == 3  # layer 0's graph, and the same named for layers 1 and 2
        assert len({id(v.fn) for v in first if not v.names}) == 1  # one untapped function
        assert [v.prefix for v in first if v.names] == ["layers.1"]
    for v in versions.values():  # each names its own layer's ops, untapped or not
        if mode == "shared" and not v.prefix:
            continue  # the graph around the shared layers: their calls and the input
        named = {s.name for n in v.graph.nodes for s in n.meta.get("fxprobe_sites", ())}
        assert named and all(n.startswith(v.prefix + ".") for n in named), (v.prefix, named)

    def double(v: torch.Tensor) -> torch.Tensor:
        return v * 2 + 1

    with torch.no_grad():  # an edit in layer 0 (untapped) reaches layer 1's tap
        with tapped.intervene({"layers.0.out": lambda s, v: double(v)}):
            edited = tapped(x)
    ref, kept = hooked(model, lambda: model(x), {"layers.0.out": double}, ("layers.1.fc",))
    torch.testing.assert_close(edited, ref)
    torch.testing.assert_close(tapped.taps["layers.1.fc"], kept["layers.1.fc"][0])
    x3 = torch.randn(5, 8)
    with torch.no_grad():  # nested blocks on layers 2 and 0, a new batch
        with tapped.intervene({"layers.2.fc": lambda s, v: -v}), \
                tapped.intervene({"layers.0.relu": lambda s, v: v * 0.5}):
            edited = tapped(x3)
        out, cache = tapped.run_with_cache(x3, names=["layers.0.fc", "layers.2.out"])
    ref, _ = hooked(model, lambda: model(x3), {"layers.2.fc": lambda v: -v,
                                                "layers.0.fc": lambda v: v.relu() * 0.5})
    torch.testing.assert_close(edited, ref)
    ref, kept = hooked(model, lambda: model(x3),
                        keep=("layers.0.fc", "layers.1.fc", "layers.2.out"))
    torch.testing.assert_close(out, ref)
    assert set(cache) == {"layers.0.fc", "layers.2.out"}
    for name in cache:
        torch.testing.assert_close(cache[name], kept[name][0])
    torch.testing.assert_close(tapped.taps["layers.1.fc"], kept["layers.1.fc"][0])
    with pytest.raises(ZeroDivisionError), tapped.intervene({"layers.2.out": lambda s, v: 1 / 0}):
        tapped(x)
    with torch.no_grad():  # after an edit raised inside an untapped layer
        torch.testing.assert_close(tapped(x), model(x))
    tapped.train()  # train mode: gradients through the untapped functions
    with tapped.intervene({"layers.0.fc": lambda s, v: v * 3}):
        tapped(x).square().sum().backward()
    ours = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    model.train()
    hooked(model, lambda: model(x).square().sum().backward(), {"layers.0.fc": lambda v: v * 3})
    for n, p in model.named_parameters():
        torch.testing.assert_close(ours[n], p.grad, msg=n)


def test_module_called_twice_only_its_second_call_selected() -> None:
    """Every block runs twice per forward (repeat versions): only layer 1's second call keeps
    a site, every other version is untapped; an edit of layer 2's first call and a read of
    layer 0's second, as hooks that count the calls."""
    torch.manual_seed(0)
    model = _Stack(twice=True).eval()
    tapped = fxprobe.tap(model, ops="layers.1.fc_1", tracer="dynamo")
    x = torch.randn(2, 8)
    with torch.no_grad():
        out = tapped(x)
    ref, kept = hooked(model, lambda: model(x), keep=("layers.1.fc", "layers.0.fc"))
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(tapped.taps["layers.1.fc_1"], kept["layers.1.fc"][1])
    calls = [0]

    def first_only(v: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        return v * 0 if calls[0] == 1 else v

    with torch.no_grad():
        with tapped.intervene({"layers.2.fc": lambda s, v: v * 0}):
            edited = tapped(x)
        out, cache = tapped.run_with_cache(x, names="layers.0.fc_1")
    ref, kept = hooked(model, lambda: model(x), {"layers.2.fc": first_only}, ("layers.1.fc",))
    torch.testing.assert_close(edited, ref)
    assert not torch.allclose(edited, model(x))
    _, plain = hooked(model, lambda: model(x), keep=("layers.0.fc", "layers.1.fc"))
    torch.testing.assert_close(cache["layers.0.fc_1"], plain["layers.0.fc"][1])
    torch.testing.assert_close(tapped.taps["layers.1.fc_1"], plain["layers.1.fc"][1])


@pytest.mark.parametrize("widths", [(3, 1, 3), (1, 0, 3)])
def test_shared_attribute_equal_to_one_layers_place_is_compared(
        monkeypatch: pytest.MonkeyPatch, widths: tuple[int, ...]) -> None:
    """A block's ``pad`` sets its output's width; it equals the block's place in one layer
    only (layer 1's 1; layer 0's 1 and layer 1's 0 are not places), so it is compared: no
    layer takes another's output shape. Values, an edit, a second shape, as the model."""
    monkeypatch.setenv("FXPROBE_DYNAMO_REGIONS", "shared")
    model = _Padded(widths).eval()
    tapped = fxprobe.tap(model, ops="layers.2.fc", tracer="dynamo")
    for shape in [(2, 8), (3, 5, 8)]:
        x = torch.randn(*shape)
        with torch.no_grad():
            out = tapped(x)
            with tapped.intervene({"layers.1.fc": lambda s, v: v * 0}):
                edited = tapped(x)
        torch.testing.assert_close(out, model(x))
        ref, kept = hooked(model, lambda x=x: model(x), {"layers.1.fc": lambda v: v * 0},
                            keep=("layers.2.fc",))
        torch.testing.assert_close(edited, ref)
        torch.testing.assert_close(tapped.taps["layers.2.fc"], kept["layers.2.fc"][0])
    shared = tapped._lifecycle().program.dynamo[""].shared
    assert shared.places == {("", "layer_idx")}
    assert not {i for i, t in shared.twins.items() if widths[i] != widths[t]}


def test_shared_attribute_that_is_every_layers_place_and_changes_shape_is_caught(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``pad`` equal to every block's place is not compared (as ``layer_idx``): the blocks
    are taken alike where traced, and the shapes they return running tell them apart, loudly."""
    monkeypatch.setenv("FXPROBE_DYNAMO_REGIONS", "shared")
    model = _Padded((0, 1, 2)).eval()
    tapped = fxprobe.tap(model, ops="layers.2.fc", tracer="dynamo")
    with pytest.raises(DynamoError, match="different shapes"):
        tapped(torch.randn(2, 8))


class _PadBlock(nn.Module):
    def __init__(self, place: int, pad: int) -> None:
        super().__init__()
        self.fc, self.layer_idx, self.pad = nn.Linear(8, 8), place, pad

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.pad(self.fc(x) * (self.layer_idx + 1), (0, self.pad))


class _Padded(nn.Module):
    """Blocks all called on the input, their outputs (of width ``8 + pad``) side by side."""

    def __init__(self, widths: tuple[int, ...]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.config = types.SimpleNamespace(use_cache=False)
        self.layers = nn.ModuleList([_PadBlock(i, w) for i, w in enumerate(widths)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([layer(x) for layer in self.layers], -1)


@pytest.mark.filterwarnings("ignore:fxprobe. the hooks of")  # traced again: said once each
def test_shared_hooks_added_and_removed_after_untapped_forwards(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Shared blocks with one layer's ``fc`` selected: a hook registered on another layer's
    module of the model after two forwards acts from the next forward, in the selected
    layer's tap too; removed, it acts no more; one on the tapped module's acts too."""
    monkeypatch.setenv("FXPROBE_DYNAMO_REGIONS", "shared")
    torch.manual_seed(0)
    model = _Stack(split=False).eval()
    tapped = fxprobe.tap(model, ops="layers.2.fc", tracer="dynamo")
    x = torch.randn(2, 5, 8)
    assert tapped._lifecycle().program.dynamo[""].shared is not None

    def check(edits: dict[str, Edit] | None = None) -> None:
        with torch.no_grad():
            out = tapped(x)
        ref, kept = hooked(model, lambda: model(x), edits, ("layers.2.fc",))
        torch.testing.assert_close(out, ref)
        torch.testing.assert_close(tapped.taps["layers.2.fc"], kept["layers.2.fc"][0])

    check()
    check()
    handle = model.layers[1].out.register_forward_hook(lambda m, a, out: out * 0 + 1)
    try:
        check({"layers.1.out": lambda v: v * 0 + 1})
        check({"layers.1.out": lambda v: v * 0 + 1})
    finally:
        handle.remove()
    check()
    check()
    handle = tapped.get_submodule("layers.0.fc").register_forward_hook(lambda m, a, out: -out)
    try:
        check({"layers.0.fc": lambda v: -v})
    finally:
        handle.remove()
    check()
    with torch.no_grad(), tapped.intervene({"layers.1.fc": lambda s, v: v * 0}):
        out = tapped(torch.randn(3, 9, 8))
    assert out.shape == (3, 9, 8)
    check()


def test_shared_gpt2_cache_steps_one_layer_selected(monkeypatch: pytest.MonkeyPatch) -> None:
    """GPT-2 (``layer_idx`` the blocks' place) with a key/value cache, shared: layer 2's
    ``mlp.c_proj`` selected; a step editing layer 1 (untapped), a step reading layers 0 and 3
    inside, each as the model with hooks on a copy of its cache."""
    tf = pytest.importorskip("transformers")
    monkeypatch.setenv("FXPROBE_DYNAMO_REGIONS", "shared")
    torch.manual_seed(0)
    model = tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=4, n_embd=32, n_head=2, vocab_size=100,
                                             n_positions=64)).eval()
    proj = [f"transformer.h.{i}.mlp.c_proj" for i in range(4)]
    tapped = fxprobe.tap(model, ops=proj[2], tracer="dynamo")
    ids = torch.randint(1, 100, (2, 6))
    with torch.no_grad():
        ours = tapped(ids, use_cache=True)
        ref, kept = hooked(model, lambda: model(ids, use_cache=True), keep=(proj[2],))
        torch.testing.assert_close(ours.logits, ref.logits)
        torch.testing.assert_close(tapped.taps[proj[2]], kept[proj[2]][0])
        step = torch.randint(1, 100, (2, 1))
        with tapped.intervene({proj[1]: lambda s, v: v * 0}):
            ours = tapped(step, cache=ours.cache, use_cache=True)
        ref, kept = hooked(model, lambda: model(step, cache=ref.cache,
                                                 use_cache=True),
                            {proj[1]: lambda v: v * 0}, (proj[2],))
        torch.testing.assert_close(ours.logits, ref.logits)
        torch.testing.assert_close(tapped.taps[proj[2]], kept[proj[2]][0])
        step = torch.randint(1, 100, (2, 1))
        ours, cache = tapped.run_with_cache(step, cache=ours.cache,
                                            use_cache=True, names=[proj[0], proj[3]])
        ref, kept = hooked(model, lambda: model(step, cache=ref.cache,
                                                 use_cache=True), keep=(proj[0], proj[3]))
    torch.testing.assert_close(ours.logits, ref.logits)
    for name in (proj[0], proj[3]):
        torch.testing.assert_close(cache[name], kept[name][0])
