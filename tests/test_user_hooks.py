"""The model's own hooks run in the tapped module as they run in the model.

A traced region inlines the forwards of the modules it traces through, so a hook on one of them
would either be run once, at trace time, or never. fxprobe therefore makes every module with a
hook a boundary of its own (its call goes through ``nn.Module.__call__``, so its hooks run at
each call, and its body is traced as a region of its own), runs the root's hooks, and notices a
hook registered on one of its modules after ``tap()`` (``fully_shard`` registers such hooks):
the model is then traced again. The reference is always the model itself, called eagerly with
the same hooks.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn

import fxprobe


class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x)) + 1


class Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = Inner()
        self.b = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x) * 2)


def _model() -> Outer:
    torch.manual_seed(0)
    return Outer().eval()


X = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))


def _double(mod: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
    return out * 2


def _shift(mod: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    return (args[0] + 1,)


@pytest.mark.parametrize("tracer", ["auto", "fx", "hooks", "dynamo"])
def test_hooks_on_the_root_run(tracer: str) -> None:
    model = _model()
    model.register_forward_hook(_double)
    model.register_forward_pre_hook(_shift)
    want = model(X)
    tapped = fxprobe.tap(model, ops="a.add", tracer=tracer) if tracer != "hooks" else \
        fxprobe.tap(model, ops="a", tracer=tracer)
    got = tapped(X)
    assert torch.equal(got, want)
    assert torch.equal(got, tapped(X))  # every call, not just the first


def test_a_hook_on_a_traced_through_module_runs_at_every_call_and_its_ops_stay_sites() -> None:
    model = _model()
    seen: list[torch.Tensor] = []
    model.a.register_forward_hook(lambda m, a, out: seen.append(out) or None)
    model.a.register_forward_pre_hook(_shift)
    want = model(X)
    seen.clear()
    tapped = fxprobe.tap(model, ops=["a.relu", "a.add", "a"])
    for _ in range(3):
        got = tapped(X)
    assert torch.equal(got, want)
    # The user's capturing hook saw real tensors, once per call (never a tracing proxy).
    assert len(seen) == 3 and all(type(t) is torch.Tensor for t in seen)
    assert torch.equal(tapped.taps["a"], seen[-1])
    # The ops inside the hooked module are still sites, with the shifted input.
    lin = model.a.lin(X + 1)
    assert torch.equal(tapped.taps["a.relu"], torch.relu(lin))
    assert torch.equal(tapped.taps["a.add"], torch.relu(lin) + 1)


@pytest.mark.parametrize("tracer", ["auto", "dynamo"])
@pytest.mark.parametrize("where", ["a", "a.lin", "b"])
def test_a_hook_registered_on_the_tapped_module_after_tap_runs(where: str, tracer: str) -> None:
    model = _model()
    tapped = fxprobe.tap(model, ops="a.add", tracer=tracer)
    before = tapped(X)
    handle = tapped.get_submodule(where).register_forward_hook(_double)
    model.get_submodule(where).register_forward_hook(_double)
    want = model(X)
    tapped._model_hooks.changed()  # the model's own hook: said elsewhere (the test below)
    assert not torch.equal(want, before)  # the hook changes the output
    inlined = where == "a" or tracer == "dynamo"  # dynamo inlines every module call
    if inlined:  # fxprobe notices the new hook and traces again
        with pytest.warns(UserWarning, match="traced again"):
            got = tapped(X)
    else:  # called as a module already: its hooks run as they are
        got = tapped(X)
    assert torch.equal(got, want)
    assert torch.equal(tapped.taps["a.add"], model.a(X) / (2 if where == "a" else 1))
    handle.remove()  # removing it is seen too
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # dynamo captured the hook: a second trace
        assert torch.equal(tapped(X), before)


def test_the_models_hooks_registered_after_tap_stay_out() -> None:
    # The documented contract: the tapped module copied the hook tables when it was made.
    model = _model()
    tapped = fxprobe.tap(model, ops="a.add")
    want = tapped(X)
    model.a.register_forward_hook(_double)
    with pytest.warns(UserWarning, match="registered on the model's 'a' after tap"):
        assert torch.equal(tapped(X), want)  # never silently


def test_a_backward_hook_on_a_traced_through_module_fires() -> None:
    model = _model()
    grads: list[torch.Tensor] = []
    model.a.register_full_backward_hook(lambda m, gi, go: grads.append(go[0]) or None)
    x = X.clone().requires_grad_(True)
    model(x).sum().backward()
    want = grads.pop()
    tapped = fxprobe.tap(model, ops="a.add")
    tapped(x).sum().backward()
    assert len(grads) == 1 and torch.equal(grads[0], want)


# -- submodules replaced after tap() ---------------------------------------------------------

@pytest.mark.parametrize("tracer", ["auto", "dynamo"])
@pytest.mark.parametrize("where", ["b", "a.lin", "a"])
def test_a_submodule_assigned_to_the_tapped_module_after_tap_is_the_one_that_runs(
        where: str, tracer: str) -> None:
    model = _model()
    tapped = fxprobe.tap(model, ops=["a.add", "b"], tracer=tracer)
    tapped(X)
    torch.manual_seed(2)
    new = Inner() if where == "a" else nn.Linear(4, 2 if where == "b" else 4)
    parent, _, name = where.rpartition(".")
    setattr(tapped.get_submodule(parent), name, new)
    if tracer == "dynamo":  # dynamo guards on the modules it inlined: it captures again
        got = tapped(X)
    else:  # fxprobe notices, copies the module in, and traces again
        with pytest.warns(UserWarning, match="traced again"):
            got = tapped(X)
        kept = tapped.get_submodule(where)  # a copy sharing the parameters
        assert kept is not new and all(
            p is q for p, q in zip(kept.parameters(), new.parameters(), strict=True))
    # The reference: the model with the same module put in its place (eagerly).
    setattr(model.get_submodule(parent), name, new)
    assert torch.equal(got, model(X))
    assert torch.equal(tapped.taps["a.add"], model.a(X))
    # The object given is never instrumented.
    assert "forward" not in new.__dict__ and not new._forward_hooks


def test_a_submodule_deleted_from_the_tapped_module_fails_as_the_model_would() -> None:
    model = _model()
    tapped = fxprobe.tap(model, ops="a.add")
    tapped(X)
    del tapped.b
    with pytest.raises(AttributeError, match="b"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tapped(X)


def test_a_hook_on_a_swapped_in_module_reached_by_hooks_is_moved() -> None:
    # A module that runs as written is reached by fxprobe's hook; swapped, the hook follows.
    class Untraceable(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.sum() > 1e9:  # data-dependent control flow: fx cannot trace it
                return x
            return self.lin(x)

    model = nn.Sequential(Untraceable(), nn.ReLU()).eval()
    tapped = fxprobe.tap(model, ops="0.lin", tracer="hooks")
    tapped(X)
    assert {s.name: s.how for s in tapped.sites}["0.lin"] == "hook"
    new = nn.Linear(4, 4)
    tapped.get_submodule("0").lin = new
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tapped(X)
    assert torch.equal(tapped.taps["0.lin"], new(X))


def test_a_hook_put_on_the_model_after_tap_warns_at_the_next_forward() -> None:
    """The tapped module runs a copy of the module tree: a hook the user registers on the
    model's own module afterwards cannot run there, and is never silently dropped."""
    import warnings

    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)).eval()
    x = torch.randn(2, 4)
    tapped = fxprobe.tap(model, ops=nn.Linear)
    tapped(x)
    fired: list[int] = []
    handle = model[1].register_forward_hook(lambda *a: fired.append(1))
    try:
        with pytest.warns(UserWarning, match=r"registered on the model's '1' after tap\(\)"):
            tapped(x)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            tapped(x)  # said once
    finally:
        handle.remove()
    assert fired == []
