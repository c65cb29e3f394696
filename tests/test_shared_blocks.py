"""Repeated blocks captured once for every instance and called as one op of the graph around
them (``FXPROBE_DYNAMO_REGIONS=shared``, ``frontends/dynamo_blocks.py``): every canonical name
and value as forward hooks that clone on an untapped copy see them, and every site the
marking-off capture (``FXPROBE_DYNAMO_REGIONS=0``) has, with the same value; one graph for the
block's code; per-call edits inside a block and around it; sequences of calls (new shapes, a
second block, training with gradients, another dtype, a cache, hooks on a block)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from canonical_support import _close
from test_dynamo_regions import (
    LAYERS,
    build,
    kwargs,
    references,
    region,
    roles,
    sequence_check,
)
from torch import nn

import fxprobe
from fxprobe.frontends.dynamo_blocks import block_call


def _tap(family: str, monkeypatch: pytest.MonkeyPatch, mode: str, ops: Any = None) -> Any:
    monkeypatch.setenv("FXPROBE_DYNAMO_REGIONS", mode)
    model = build(family)
    if family != "Llama":
        model.config._attn_implementation = "sdpa"
    return model, fxprobe.tap(model, ops=ops or fxprobe.where(lambda s: True), tracer="dynamo")


def _block_graphs(tapped: Any) -> list[Any]:
    """The graphs captured for the blocks' own code (their frames' self is a block)."""
    return [c for c in region(tapped).captured if c.anchor is not None
            and c.gm.graph.find_nodes(op="call_function", target=block_call) == []
            and "L['module']" in str([n.meta.get("fxprobe_source") for n in c.gm.graph.nodes
                                      if n.op == "placeholder"])]


@pytest.mark.parametrize("family", ["Llama", "BERT"])  # pre- and post-norm
def test_every_name_and_value_as_hooks_and_as_the_whole_capture(
        family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    kw = kwargs(family)
    runs = {}
    for mode in ("0", "shared"):
        model, tapped = _tap(family, monkeypatch, mode)
        with torch.no_grad():
            out = tapped(**kw)
        sites = {s.name: s for s in tapped.known_sites()}
        runs[mode] = sites, dict(tapped.taps), out
        assert not any("forward" in b.__dict__ for b in model.modules())  # model untouched
    whole, shared = runs["0"], runs["shared"]
    # Every site of the whole capture is there, with its canonical names and its value; the
    # blocks' calls are sites of their own (the op around each block), holding what it returns.
    blocks = {f"{p}" for p in shared[0]} - set(whole[0])
    assert len(blocks) == LAYERS, blocks
    for name, site in whole[0].items():
        # The stream between blocks is named on the calls: what each block returns.
        want = {c for c in site.canonical if not c.endswith(("resid_pre", "resid_post"))}
        assert want <= set(shared[0][name].canonical), name
        value = whole[1].get(name)
        if isinstance(value, torch.Tensor):
            assert torch.equal(shared[1][name], value), name
    by_canonical = {c: n for n, s in shared[0].items() for c in s.canonical}
    assert set(by_canonical) == {c for s in whole[0].values() for c in s.canonical}
    for c, n in by_canonical.items():  # resid_post, and resid_pre after block 0: the calls
        if c.endswith("resid_post") or c.endswith("resid_pre") and c != "blocks.0.resid_pre":
            L = int(c.split(".")[1]) - c.endswith("resid_pre")
            assert n in blocks and n.endswith(f".{L}"), (c, n)
            whole_site = {c2: n2 for n2, s in whole[0].items() for c2 in s.canonical}[c]
            assert torch.equal(shared[1][n], whole[1][whole_site]), c
    ref = references(family, kw)
    for L in range(LAYERS):
        for role in roles(family):
            name = f"blocks.{L}.{role}"
            _close(name, shared[1][by_canonical[name]], ref[name])
    result = shared[2]
    torch.testing.assert_close(result.logits if hasattr(result, "logits")
                               else result.last_hidden_state, ref["out"])


def test_the_block_is_captured_once_for_every_instance(monkeypatch: pytest.MonkeyPatch) -> None:
    _, tapped = _tap("Llama", monkeypatch, "shared", ops="blocks.*.resid_post")
    with torch.no_grad():
        tapped(**kwargs("Llama"))
        tapped(**kwargs("Llama", length=11))
    graphs = region(tapped).captured
    calls = [c for c in graphs if c.gm.graph.find_nodes(op="call_function", target=block_call)]
    assert len(calls) == 1  # the model around the blocks: one graph, LAYERS calls in it
    assert len(calls[0].gm.graph.find_nodes(op="call_function", target=block_call)) == LAYERS
    assert len(graphs) == 2  # and one graph of the block's code, named for each instance
    assert len(graphs[1].versions) == LAYERS


def test_per_call_edits_inside_and_around_the_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """An edit of layer 2's output (inside its graph), of what layer 1 reads (the call of
    layer 0, around the blocks), and of the logits: values as hooks that make them."""
    _, tapped = _tap("Llama", monkeypatch, "shared", ops="blocks.*.resid_post")
    kw = kwargs("Llama")
    names = {c: s.name for s in tapped.known_sites() for c in s.canonical}
    with torch.no_grad():
        tapped(**kw)
        plain = dict(tapped.taps)
        names = {c: s.name for s in tapped.known_sites() for c in s.canonical}
        edits = {"blocks.2.resid_post": lambda s, v: v * 3 + 1,
                 "blocks.1.resid_pre": lambda s, v: v - 2}
        with tapped.intervene(edits):
            out = tapped(**kw)
        edited = dict(tapped.taps)
        again = tapped(**kw)  # after the block: as before it
    ref = references("Llama", kw, edit=lambda L, v: v * 3 + 1 if L == 2 else
                     v - 2 if L == 0 else v)
    for L in range(LAYERS):  # layer 0's output is what layer 1 reads: one site, edited
        name = names[f"blocks.{L}.resid_post"]
        torch.testing.assert_close(edited[name], ref[f"blocks.{L}.resid_post"])
        assert not torch.equal(edited[name], plain[name])
    torch.testing.assert_close(out.logits, ref["out"])
    torch.testing.assert_close(again.logits, references("Llama", kw)["out"])


def test_a_sequence_of_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    """A forward, a new length, a new batch, two edit blocks, one left by an exception,
    training with gradients, float64, a forward with the cache and one without: every value
    as an untapped copy's hooks see it."""
    model, tapped = _tap("Llama", monkeypatch, "shared", ops="blocks.*.resid_post")

    check = sequence_check(tapped, lambda canonical: canonical)  # the graph names them so
    check(kwargs("Llama"))
    check(kwargs("Llama", length=11))
    check(kwargs("Llama", batch=3))
    check(kwargs("Llama"), lambda L, v: v * 0 if L == 1 else v,
          {"blocks.1.resid_post": lambda s, v: v * 0})
    with pytest.raises(RuntimeError, match="boom"), torch.no_grad(), tapped.intervene(
            {"blocks.3.resid_post": lambda s, v: (_ for _ in ()).throw(RuntimeError("boom"))}):
        tapped(**kwargs("Llama"))
    check(kwargs("Llama", length=5), lambda L, v: v + 2 if L == 3 else v,
          {"blocks.3.resid_post": lambda s, v: v + 2})
    check(kwargs("Llama", use_cache=True))  # a cache: the whole model, each layer traced
    check(kwargs("Llama"))
    # Training: gradients of every parameter as the untapped model's.
    reference = copy.deepcopy(model)
    tapped.train()
    reference.train()
    kw = kwargs("Llama", length=6)
    tapped(**kw).logits.pow(2).sum().backward()
    reference(**kw).logits.pow(2).sum().backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
    tapped.eval()
    tapped.to(torch.float64)
    with torch.no_grad():
        out = tapped(**kw)
        want = model.to(torch.float64)(**kw)
    torch.testing.assert_close(out.logits, want.logits)
    assert tapped.taps["blocks.3.resid_post"].dtype == torch.float64


def test_a_hook_inside_a_block_is_never_given_fake_tensors(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A hook on a module inside a block (registered after tap()) would run on the fake
    tensors the graph around the blocks is traced with: the call runs unshared, and the hook
    sees the real values, once per forward."""
    model, tapped = _tap("Llama", monkeypatch, "shared", ops="blocks.*.resid_post")
    seen: list[torch.Tensor] = []
    model.model.layers[1].mlp.register_forward_hook(
        lambda m, a, o: seen.append(o.detach().clone()))
    kw = kwargs("Llama")
    with torch.no_grad():
        tapped(**kw)
    ref_model = build("Llama")
    want: list[torch.Tensor] = []
    ref_model.model.layers[1].mlp.register_forward_hook(
        lambda m, a, o: want.append(o.detach().clone()))
    with torch.no_grad():
        ref_model(**kw)
    assert len(seen) == 1 and not isinstance(seen[0], torch._subclasses.FakeTensor)
    torch.testing.assert_close(seen[0], want[0])


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.lin(torch.relu(x))


class _Stack(nn.Module):
    config = type("Config", (), {"use_cache": False, "is_decoder": False})()

    def __init__(self, order: list[int]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Layer() for _ in range(3))
        self.order = order

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i in self.order:
            x = self.layers[i](x)
        return x * 2


@pytest.mark.parametrize("order", [[2, 1, 0], [0, 1, 0, 2]])
def test_blocks_out_of_order_or_called_twice(order: list[int],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Each call of a block names its own sites (``layers.0.lin``, then ``layers.0.lin_1``),
    over two forwards, as hooks on an untapped copy see them."""
    monkeypatch.setenv("FXPROBE_DYNAMO_REGIONS", "shared")
    torch.manual_seed(0)
    model = _Stack(order)
    reference = copy.deepcopy(model)
    tapped = fxprobe.tap(model, ops=nn.Linear, tracer="dynamo")
    seen: dict[str, list[torch.Tensor]] = {}
    for i, layer in enumerate(reference.layers):
        layer.lin.register_forward_hook(
            lambda m, a, o, i=i: seen.setdefault(f"layers.{i}.lin", []).append(o.detach()))
    for batch in (2, 5):
        seen.clear()
        x = torch.randn(batch, 8)
        torch.testing.assert_close(tapped(x), reference(x))
        for name, values in seen.items():
            for n, value in enumerate(values):
                torch.testing.assert_close(tapped.taps[name + (f"_{n}" if n else "")], value)


class _Strided(nn.Module):
    def __init__(self, index: int) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.index = index  # its place in the list, which its output's shape depends on

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x[:, :: self.index + 1])


class _StridedStack(nn.Module):
    config = _Stack.config

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.layers = nn.ModuleList([_Strided(0), _Strided(1)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return x.reshape(x.shape[0], -1)


def test_blocks_alike_in_shape_but_not_in_output_are_refused(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocks with parameters and inputs of the same shapes whose outputs differ by their
    index (an attribute equal to their place, which the shared capture does not compare, as
    transformers' ``layer_idx``): the graph around them took the second's output to be shaped
    as the first's, so the forward raises, naming the blocks, rather than run on."""
    monkeypatch.setenv("FXPROBE_DYNAMO_REGIONS", "shared")
    torch.manual_seed(0)
    model = _StridedStack()
    tapped = fxprobe.tap(model, ops=nn.Linear, tracer="dynamo")
    with pytest.raises(fxprobe.DynamoError, match="blocks 0 and 1 of _Strided"), \
            torch.no_grad():  # (with gradients the two inputs differ: one requires them)
        tapped(torch.randn(2, 6, 8))
    monkeypatch.setenv("FXPROBE_DYNAMO_REGIONS", "0")
    tapped = fxprobe.tap(model, ops=nn.Linear, tracer="dynamo")
    x = torch.randn(2, 6, 8)
    torch.testing.assert_close(tapped(x), model(x))
