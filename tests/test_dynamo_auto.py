"""tracer='auto' with dynamo: fx first, dynamo for what fx cannot trace, hooks when dynamo fails;
deferred selectors, model errors, graph breaks and a module called twice."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import zoo
from dynamo_support import OPS, InplaceAfter, image, make_vit
from reference import hook_values, model_state, states_equal
from torch import nn

import fxprobe


def test_grad_on_dynamo_sites_matches_autograd() -> None:
    model = make_vit()
    tapped = fxprobe.tap(model, ops=["blocks.1.attn.qkv", "blocks.0.norm2"], tracer="dynamo",
                         grad=True)
    x = image()
    tapped(x).square().sum().backward()
    seen: dict[str, torch.Tensor] = {}

    def keep(name: str) -> Any:
        def hook(m: nn.Module, a: Any, out: torch.Tensor) -> None:
            out.retain_grad()
            seen[name] = out

        return hook

    ref_model = copy.deepcopy(model)
    ref_model.zero_grad()
    ref_model.blocks[1].attn.qkv.register_forward_hook(keep("blocks.1.attn.qkv"))
    ref_model.blocks[0].norm2.register_forward_hook(keep("blocks.0.norm2"))
    ref_model(x).square().sum().backward()
    for name, value in seen.items():
        assert value.grad is not None
        torch.testing.assert_close(tapped.grads[name], value.grad, rtol=0, atol=0)
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None for g in grads)  # training through the tapped module trains it


def test_auto_never_uses_dynamo_when_fx_traces_everything(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    def no_compile(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("torch.compile was called for an fx-traceable model")

    monkeypatch.setattr(torch, "compile", no_compile)
    model = make_vit()
    tapped = fxprobe.tap(model, ops=OPS)
    x = image()
    with torch.no_grad():
        out = tapped(x)
        expected, ref = hook_values(model, ["blocks.0.attn.qkv", "head"], x)
    assert torch.equal(out, expected) and torch.equal(tapped.taps["head"], ref["head"])
    assert {s.how for s in tapped.sites} == {"fx"} and tapped.dynamo_info == ()
    assert [s.name for s in tapped.sites] == [
        s.name for s in fxprobe.tap(model, ops=OPS, tracer="fx").sites]


def _taking(model: nn.Module, sign: float) -> torch.Tensor:
    """An input for zoo's DataDependent whose gate takes the positive (or negative) branch."""
    gen = torch.Generator().manual_seed(0)
    inp = torch.randn(3, 8, generator=gen)
    while model.stem(inp).sum() * sign <= 0:
        inp = torch.randn(3, 8, generator=gen)
    return inp


def test_auto_runs_what_fx_cannot_trace_under_dynamo_after_listing_hooks() -> None:
    model, _, _ = zoo.make("data_dependent")
    before = model_state(model)
    tapped = fxprobe.tap(model, ops=[nn.Linear, torch.sum])
    # Before the first forward: what fx and hooks know (the fallback is still listed).
    assert [(s.name, s.how) for s in tapped.sites] == [
        ("stem", "fx"), ("gate.pos", "hook"), ("gate.neg.0", "fx"), ("head", "fx")]
    assert [f.path for f in tapped.fallbacks] == ["gate"]
    for sign in (1.0, -1.0):
        inp = _taking(model, sign)
        with torch.no_grad():
            out = tapped(inp)
            expected, ref = hook_values(model, ["stem", "gate.pos", "gate.neg.0", "head"], inp)
        assert torch.equal(out, expected)
        taken = "gate.pos" if sign > 0 else "gate.neg.0"
        for name in ("stem", taken, "head"):
            assert torch.equal(tapped.taps[name], ref[name]), name
        assert torch.equal(tapped.taps["gate.sum"], ref["stem"].sum())
    how = {s.name: s.how for s in tapped.sites}
    assert how == {"stem": "fx", "head": "fx", "gate.pos": "dynamo", "gate.neg.0": "dynamo",
                   "gate.sum": "dynamo"}
    assert tapped.fallbacks == ()
    assert [c.path for c in tapped.dynamo_info] == ["gate"]  # stem and head: fx only
    assert "gate: " in "\n".join(tapped.summary().notes)
    assert "1 dynamo" in tapped.summary().notes[0] or "dynamo)" in tapped.summary().notes[0]
    tapped.remove()
    assert states_equal(before, model_state(model))


def test_auto_defers_a_selector_only_dynamo_can_match_to_the_first_forward() -> None:
    model, (x,), _ = zoo.make("data_dependent")
    tapped = fxprobe.tap(model, ops="gate.sum")  # no fx or hook site has this name
    assert tapped.sites == ()
    with torch.no_grad():
        tapped(x)
    assert [s.name for s in tapped.sites] == ["gate.sum"]
    assert torch.equal(tapped.taps["gate.sum"], model.stem(x).sum())
    typo = fxprobe.tap(model, ops="gate.summ")
    with pytest.raises(fxprobe.SelectorError, match="gate.summ") as err, torch.no_grad():
        typo(x)
    assert "first forward" in str(err.value) and "gate.sum" in str(err.value)


def test_auto_falls_back_to_hooks_when_dynamo_fails(dynamo_fails: None) -> None:
    model, _, _ = zoo.make("data_dependent")
    tapped = fxprobe.tap(model, ops=nn.Linear)
    for sign in (1.0, -1.0):
        inp = _taking(model, sign)
        with torch.no_grad():
            out = tapped(inp)
            expected, ref = hook_values(model, ["gate.pos", "gate.neg.0"], inp)
        assert torch.equal(out, expected)  # the forward that works eagerly still works
        (name,) = ref
        assert torch.equal(tapped.taps[name], ref[name])
    assert {s.name: s.how for s in tapped.sites}["gate.pos"] == "hook"
    (fb,) = tapped.fallbacks
    assert fb.path == "gate" and "control flow" in fb.error
    assert "torch dynamo failed too" in fb.error and "dynamo fails here" in fb.error
    assert tapped.dynamo_info[0].graphs == 0


class _CountsThenBreaks(nn.Module):
    """Writes a buffer in place, then a graph break: two graphs."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        y = self.lin(x)
        return y * 2 if y.sum() > 0 else -y  # data-dependent: fx cannot trace it


def test_auto_refuses_to_run_twice_what_wrote_model_state(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    real = fxprobe.frontends.dynamo.DynamoRegion.backend

    def second_graph_fails(self: Any, gm: Any, example_inputs: Any) -> Any:
        if self.graphs:
            raise RuntimeError("the second graph fails")
        return real(self, gm, example_inputs)

    monkeypatch.setattr(fxprobe.frontends.dynamo.DynamoRegion, "backend", second_graph_fails)
    torch.manual_seed(0)
    model = nn.Sequential(_CountsThenBreaks())
    tapped = fxprobe.tap(model, ops=nn.Linear)
    with pytest.raises(fxprobe.DynamoError, match="in place") as err, torch.no_grad():
        tapped(torch.randn(2, 4))
    assert "the second graph fails" in str(err.value)
    assert model[0].calls.item() == 1  # written once, as the forward did before failing


def test_sites_under_auto_lists_dynamo_sites_only_with_an_example_input() -> None:
    model, (x,), _ = zoo.make("data_dependent")
    plain = fxprobe.sites(model)
    assert "gate.pos" in plain and "gate.sum" not in plain
    assert [f.path for f in plain.fallbacks] == ["gate"]
    found = fxprobe.sites(model, example_input=x)
    how = {r.name: r.how for r in found.records}
    assert how["stem"] == "fx" and how["gate.sum"] == "dynamo"
    assert found.fallbacks == ()
    vit = make_vit()  # fx traces it whole: an example input changes nothing, runs no dynamo
    for tracer in ("auto", "fx+dynamo"):
        assert fxprobe.sites(vit, tracer=tracer, example_input=image()) == fxprobe.sites(vit)


def test_graphs_copied_and_outplaced_include_dynamo_graphs() -> None:
    torch.manual_seed(0)
    model = InplaceAfter()
    tapped = fxprobe.tap(model, ops=[nn.Linear], tracer="dynamo")
    assert tapped.graphs == {} and tapped.copied == frozenset()
    with torch.no_grad():
        tapped(torch.randn(4, 8))
    (key,) = tapped.graphs
    assert key == "dynamo::0"
    graph = tapped.graphs[key]
    assert any(n.op == "call_function" and "linear" in str(n.target) for n in graph.nodes)
    assert tapped.copied == {"fc"}  # relu_ overwrites it: copied (see the test above)
    vit = fxprobe.tap(make_vit(brk=True), ops=nn.Linear, tracer="dynamo")
    with torch.no_grad():
        vit(image())
    keys = list(vit.graphs)
    assert keys[0] == "dynamo::0" and len(keys) == len(set(keys)) >= 3
    assert all(k.startswith("dynamo::") for k in keys)
    assert any("@blocks.1" in k for k in keys)  # a graph reused for another block


class _Skips(nn.Module):
    """Calls its untraceable gate only for inputs with a positive sum."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = zoo.Gate(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gate(x) if x.sum() > 0 else x


def test_a_module_split_by_a_graph_break_names_its_ops_by_its_own_path() -> None:
    # The gate's forward breaks the graph, so dynamo runs it as a frame of its own, whose
    # graph receives no parameter: its module is found from the code the frame runs.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), _Skips()).eval()
    gen = torch.Generator().manual_seed(0)
    x = next(x for x in (torch.randn(2, 8, generator=gen) for _ in range(20))
             if model[0](x).sum() > 0)  # the gate runs
    tapped = fxprobe.tap(model, ops=["1.gate.sum", "1.sum"])
    with torch.no_grad():
        out = tapped(x)
    assert torch.equal(out, model(x))
    assert [(s.name, s.how) for s in tapped.sites] == [("1.sum", "dynamo"),
                                                       ("1.gate.sum", "dynamo")]
    h = model[0](x)
    assert torch.equal(tapped.taps["1.sum"], h.sum())  # _Skips' own test
    assert torch.equal(tapped.taps["1.gate.sum"], h.sum())  # the Gate's, on the same input


class _FailsOnNegative(nn.Module):
    """Untraceable, and raises for some inputs whether run eagerly or under dynamo."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.min() < -100:
            raise ValueError("out of range")
        return self.lin(x)


def test_auto_keeps_dynamo_when_the_model_itself_raises() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(_FailsOnNegative())
    tapped = fxprobe.tap(model, ops=nn.Linear)
    with pytest.raises(ValueError, match="out of range"), torch.no_grad():
        tapped(torch.full((2, 4), -1000.0))
    x = torch.randn(2, 4)
    with torch.no_grad():
        out = tapped(x)
    assert torch.equal(out, model(x)) and torch.equal(tapped.taps["0.lin"], model[0].lin(x))
    assert tapped.fallbacks == () and [s.how for s in tapped.sites] == ["dynamo"]


class _Untraceable(nn.Module):
    """Data-dependent control flow (fx cannot trace it); calls its layer twice."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > -1e9:  # taken for every input here: each call runs the same code
            x = self.fc(x).relu()
        return self.fc(x)


class _CallsTwice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = _Untraceable()
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.inner(self.inner(x) + 1))


@pytest.mark.parametrize("tracer", ["auto", "fx+dynamo", "dynamo"])
def test_a_module_dynamo_runs_called_twice_keeps_both_calls(tracer: str) -> None:
    torch.manual_seed(0)
    model = _CallsTwice().eval()
    x = torch.randn(3, 4)
    torch._dynamo.reset()
    tapped = fxprobe.tap(model, ops=nn.Linear, tracer=tracer)
    with torch.no_grad():
        out = tapped(x)
        expected, ref = hook_values(model, ["inner.fc", "head"], x)
    assert torch.equal(out, expected)
    # As hooks count calls: inner.fc and inner.fc_1 in the first call of inner, then _2, _3.
    assert sorted(tapped.taps) == sorted(ref) == [
        "head", "inner.fc", "inner.fc_1", "inner.fc_2", "inner.fc_3"]
    for name, value in ref.items():
        assert torch.equal(tapped.taps[name], value), name
    with torch.no_grad():  # the next forward: the same names, its own values
        tapped(2 * x)
        _, ref = hook_values(model, ["inner.fc", "head"], 2 * x)
    assert sorted(tapped.taps) == sorted(ref)
    for name, value in ref.items():
        assert torch.equal(tapped.taps[name], value), name
    assert {s.name for s in tapped.sites} >= set(ref)

    # fn= reaches the second call alone: zero its first layer's output.
    def fn(site: fxprobe.Site, value: torch.Tensor) -> torch.Tensor | None:
        return torch.zeros_like(value) if site.name == "inner.fc_2" else None

    patched = fxprobe.tap(model, ops=nn.Linear, tracer=tracer, fn=fn)
    calls: list[int] = []

    def zero_third(m: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor | None:
        calls.append(1)
        return torch.zeros_like(out) if len(calls) == 3 else None

    handle = model.inner.fc.register_forward_hook(zero_third)
    with torch.no_grad():
        try:
            reference = model(x)
        finally:
            handle.remove()
        got = patched(x)
    assert torch.equal(got, reference) and not torch.equal(got, expected)
    assert patched.taps.replaced == {"inner.fc_2"}

