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
    with model.get_submodule(where).register_forward_hook(_double):
        want = model(X)  # (gone from the model before the next forward of the tapped one)
        want_add = model.a(X) / (2 if where == "a" else 1)  # a.add is inside a
    assert not torch.equal(want, before)  # the hook changes the output
    inlined = where == "a" or tracer == "dynamo"  # dynamo inlines every module call
    if inlined:  # fxprobe notices the new hook and traces again
        with pytest.warns(UserWarning, match="traced again"):
            got = tapped(X)
    else:  # called as a module already: its hooks run as they are
        got = tapped(X)
    assert torch.equal(got, want)
    assert torch.equal(tapped.taps["a.add"], want_add)
    handle.remove()  # removing it is seen too
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # dynamo captured the hook: a second trace
        assert torch.equal(tapped(X), before)


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


# -- the model's hooks, changed after tap() ---------------------------------------------------

TRACERS = ["auto", "fx", "hooks", "dynamo"]


def _tap(model: nn.Module, tracer: str) -> fxprobe.TappedModule:
    return fxprobe.tap(model, ops="a" if tracer == "hooks" else "a.add", tracer=tracer)


@pytest.mark.parametrize("tracer", TRACERS)
@pytest.mark.parametrize("where", ["", "a", "a.lin", "b"])
def test_a_hook_removed_from_the_model_after_tap_no_longer_fires(where: str,
                                                                 tracer: str) -> None:
    model = _model()
    fired: list[int] = []

    def double(mod: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
        fired.append(1)
        return out * 2

    handle = model.get_submodule(where).register_forward_hook(double)
    tapped = _tap(model, tracer)
    assert torch.equal(tapped(X), model(X)) and len(fired) == 2
    handle.remove()
    want = model(X)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = tapped(X)
        again = tapped(X)
    assert fired == [1, 1]  # removed: it fires no more, in the model or the tapped module
    assert torch.equal(got, want) and torch.equal(again, want)
    # Said at most once (the second trace, where a graph had captured the hook), and never
    # that a hook was registered.
    assert len(caught) <= 1 and all("registered" not in str(w.message) for w in caught)


@pytest.mark.parametrize("tracer", TRACERS)
@pytest.mark.parametrize("where", ["", "a", "a.lin", "b"])
def test_a_hook_registered_on_the_model_after_tap_acts_in_the_tapped_module(
        where: str, tracer: str) -> None:
    model = _model()
    tapped = _tap(model, tracer)
    before = tapped(X)
    handle = model.get_submodule(where).register_forward_hook(_double)
    pre = model.get_submodule(where).register_forward_pre_hook(_shift)
    want = model(X)
    assert not torch.equal(want, before)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = tapped(X)
        again = tapped(X)
    assert torch.equal(got, want) and torch.equal(again, want)
    assert len(caught) <= 1  # a second trace (a graph inlined the module) is said once
    handle.remove()
    pre.remove()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert torch.equal(tapped(X), before)
    # Hooks registered on the tapped module stay off the model, and the other way round.
    assert not model.get_submodule(where)._forward_hooks


@pytest.mark.parametrize("tracer", ["auto", "dynamo", "hooks"])
def test_transformers_own_output_hooks_draw_no_warning(tracer: str) -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    ids = torch.randint(0, 100, (1, 5), generator=torch.Generator().manual_seed(0))
    tapped = fxprobe.tap(model, ops="transformer.h.0", tracer=tracer)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outs = [tapped(input_ids=ids, output_hidden_states=True) for _ in range(2)]
        want = model(input_ids=ids, output_hidden_states=True)  # the model's own hooks now
        outs.append(tapped(input_ids=ids, output_hidden_states=True))
        outs.append(tapped(input_ids=ids))
    # Neither the hooks transformers puts on the tapped module's modules nor the model's.
    assert [str(w.message) for w in caught if "hook" in str(w.message)] == []
    for out in outs[:3]:
        assert len(out.hidden_states) == len(want.hidden_states) == 3
        for got, expected in zip(out.hidden_states, want.hidden_states, strict=True):
            assert torch.equal(got, expected)
        assert torch.equal(out.logits, want.logits)
    assert outs[3].hidden_states is None
    h0 = tapped.taps["transformer.h.0"]
    assert torch.equal(h0[0] if isinstance(h0, tuple) else h0, want.hidden_states[1])


def test_a_backward_hook_registered_on_the_model_after_tap_fires_in_the_tapped_module() -> None:
    model = _model()
    tapped = fxprobe.tap(model, ops="a.add")
    x = X.clone().requires_grad_(True)
    tapped(x).sum().backward()
    grads: list[torch.Tensor] = []
    handle = model.a.register_full_backward_hook(lambda m, gi, go: grads.append(go[0]) or None)
    model(x).sum().backward()
    want = grads.pop()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # traced again: a graph had inlined model.a
        tapped(x).sum().backward()
    assert len(grads) == 1 and torch.equal(grads[0], want)
    handle.remove()
    tapped(x).sum().backward()
    assert len(grads) == 1  # removed: no more
