"""Partial tracing: op-level taps wherever fx can trace, hooks inside what it cannot."""

from __future__ import annotations

import pytest
import torch
import zoo
from reference import hook_values, model_state, same, states_equal
from torch import nn

import fxprobe


def test_data_dependent_submodule_falls_back(dynamo_fails: None) -> None:
    model, (x,), _ = zoo.make("data_dependent")
    tapped = fxprobe.tap(model)
    (fb,) = tapped.fallbacks
    assert fb.path == "gate" and fb.module_type is zoo.Gate
    assert "control flow" in fb.error and "zoo.py" in fb.location and "x.sum()" in fb.location
    how = {s.name: s.how for s in tapped.sites}
    assert how["stem"] == how["gate"] == how["relu"] == "fx"  # functional relu at op level
    assert how["gate.pos"] == "hook"
    assert how["gate.neg.0"] == "fx"  # a traceable child of the opaque module
    for sign in (1.0, -1.0):
        with torch.no_grad():
            gen = torch.Generator().manual_seed(0)
            inp = torch.randn(3, 8, generator=gen)
            while model.stem(inp).sum() * sign <= 0:  # an input that takes this branch
                inp = torch.randn(3, 8, generator=gen)
            out = tapped(inp)
            expected, ref = hook_values(model, ["stem", "gate", "gate.pos", "gate.neg.0"], inp)
        assert torch.equal(out, expected)
        for name, value in ref.items():
            assert torch.equal(tapped.taps[name], value), name
        branch_not_taken = "gate.neg.0" if sign > 0 else "gate.pos"
        with pytest.raises(fxprobe.SiteNotRunError, match=branch_not_taken):
            tapped.taps[branch_not_taken]
    (fb,) = tapped.fallbacks  # tracer="auto" tried dynamo first, and says why it failed
    assert "torch dynamo failed too" in fb.error and "dynamo fails here" in fb.error


def test_untraceable_top_level_with_traceable_children() -> None:
    model, (x,), _ = zoo.make("untraceable_top")
    before = model_state(model)
    tapped = fxprobe.tap(model)
    (fb,) = tapped.fallbacks
    assert fb.path == "" and "h.mean()" in fb.location
    how = {s.name: s.how for s in tapped.sites}
    assert how["blocks.0.relu"] == "fx" and how["enc.1"] == "fx" and how["norm"] == "hook"
    with torch.no_grad():
        out = tapped(x)
        expected, ref = hook_values(model, ["enc.2", "blocks.1", "norm"], x)
        h1 = model.blocks[0](model.enc(x))
        relu = torch.relu(model.blocks[1].lin(h1))
    assert torch.equal(out, expected)
    assert torch.equal(tapped.taps["enc.2"], ref["enc.2"])
    assert torch.equal(tapped.taps["blocks.1.add"], ref["blocks.1"])
    assert torch.equal(tapped.taps["blocks.1.relu"], relu)
    assert torch.equal(tapped.taps["norm"], ref["norm"])
    tapped.remove()
    assert states_equal(before, model_state(model))


def test_tracer_fx_fails_loudly_with_location_and_hint() -> None:
    model, _, _ = zoo.make("data_dependent")
    with pytest.raises(fxprobe.TraceError) as err:
        fxprobe.tap(model, tracer="fx")
    msg = str(err.value)
    assert "'gate' (Gate)" in msg and "x.sum() > 0" in msg
    assert "tracer='auto'" in msg and "leaf_modules" in msg


def test_leaf_modules_keep_a_module_opaque_without_fallback() -> None:
    model, (x,), _ = zoo.make("data_dependent")
    tapped = fxprobe.tap(model, leaf_modules=[zoo.Gate], tracer="fx")
    assert tapped.fallbacks == ()
    assert "gate.pos" not in {s.name for s in tapped.sites}
    with torch.no_grad():
        assert torch.equal(tapped(x), model(x))
    by_path = fxprobe.tap(model, ops="gate", leaf_modules=["gate"], tracer="fx")
    assert [s.name for s in by_path.sites] == ["gate"]


def test_hooks_only_tracer() -> None:
    model, (x,), _ = zoo.make("resnet")
    tapped = fxprobe.tap(model, ops=[nn.Conv2d, "layer1.0"], tracer="hooks")
    assert {s.how for s in tapped.sites} == {"hook"}
    paths = [s.name for s in tapped.sites]
    with torch.no_grad():
        out = tapped(x)
        expected, ref = hook_values(model, paths, x)
    assert torch.equal(out, expected)
    assert set(tapped.taps) == set(ref)
    for k, v in ref.items():
        assert same(tapped.taps[k], v), k


def test_shared_module_called_twice_inside_opaque_code() -> None:
    class Loop(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for _ in range(int(x.shape[0] > 0) + 1):  # int() of a traced value: opaque
                x = self.fc(x)
            return x

    model = Loop()
    x = torch.randn(2, 4)
    tapped = fxprobe.tap(model, ops=nn.Linear)
    with torch.no_grad():
        tapped(x)
        _, ref = hook_values(model, ["fc"], x)
    assert list(tapped.taps) == ["fc", "fc_1"]
    assert torch.equal(tapped.taps["fc_1"], ref["fc_1"])


class _Counts(nn.Module):
    """Updates buffers in its forward: in place (recordable) and by rebinding (not)."""

    def __init__(self, rebind: bool) -> None:
        super().__init__()
        self.rebind = rebind
        self.register_buffer("calls", torch.zeros(()))
        self.lin = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.rebind:
            self.calls += 1  # stores a new tensor into the module
        else:
            self.calls.add_(1)
        return self.lin(x) * self.calls


@pytest.mark.parametrize("rebind", [False, True])
def test_forward_that_updates_buffers(rebind: bool) -> None:
    model, twin = _Counts(rebind), _Counts(rebind)
    twin.load_state_dict(model.state_dict())
    tapped = fxprobe.tap(model)
    fxprobe.sites(model)
    assert model.calls.item() == 0  # tracing wrote nothing into the model
    assert bool(tapped.fallbacks) == rebind  # a rebinding forward runs as written
    x = torch.ones(1, 2)
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(tapped(x), twin(x))
    assert model.calls.item() == twin.calls.item() == 3


class _Bare(nn.Module):
    """No children, and a data-dependent branch: only a hook on its call reaches it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2 if x.sum() > 0 else x


class _Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bare = _Bare()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + 1 if x.mean() > -100 else x  # untraceable parent
        return self.bare(x) - 1


def test_untraceable_module_inside_untraced_code_is_hooked(dynamo_fails: None) -> None:
    model = _Outer()
    tapped = fxprobe.tap(model)
    assert [(s.name, s.how) for s in tapped.sites] == [("bare", "hook")]
    x = torch.ones(2, 2)
    with torch.no_grad():
        out = tapped(x)
        _, ref = hook_values(model, ["bare"], x)
    assert torch.equal(out, model(x)) and torch.equal(tapped.taps["bare"], ref["bare"])


class _Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x))


class _CallsGrandchild(nn.Module):
    """Untraceable code that calls a grandchild inside a traceable child directly."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = _Inner()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner.lin(x) if x.sum() > 0 else -x


def test_a_grandchild_called_from_untraced_code_is_captured() -> None:
    torch.manual_seed(0)
    model = _CallsGrandchild()
    tapped = fxprobe.tap(model, ops=["inner.lin"])
    x = torch.rand(2, 4)  # positive: the branch that calls inner.lin
    with torch.no_grad():
        out = tapped(x)
        expected, ref = hook_values(model, ["inner.lin"], x)
    assert torch.equal(out, expected)
    assert list(tapped.taps) == ["inner.lin"]  # once: no second copy from the region
    assert torch.equal(tapped.taps["inner.lin"], ref["inner.lin"])
    # Called through its traced parent, it is tapped by the region (once, too).
    wrapper = fxprobe.tap(_Inner(), ops="lin")
    with torch.no_grad():
        wrapper(x)
    assert list(wrapper.taps) == ["lin"]


class _UsesInner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = _Inner()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.inner(x)
        return self.inner.lin(y) if y.sum() > 0 else y


def test_a_grandchild_called_both_ways_is_captured_once_per_call(dynamo_fails: None
                                                                 ) -> None:
    torch.manual_seed(0)
    model = _UsesInner()
    tapped = fxprobe.tap(model, ops=["inner.lin"])
    x = torch.rand(2, 4)
    with torch.no_grad():
        out = tapped(x)
        expected, ref = hook_values(model, ["inner.lin"], x)
    assert torch.equal(out, expected)
    assert sorted(tapped.taps) == sorted(ref)
    for name in ref:
        assert torch.equal(tapped.taps[name], ref[name]), name
