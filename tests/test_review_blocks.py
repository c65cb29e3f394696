"""Review of per-call blocks (``intervene``, ``run_with_cache``) across sequences of calls on
every tracer, each against forward hooks on an untapped copy of the model (the reference)."""

from __future__ import annotations

import copy
import threading
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from test_intervene_frontends import Twice
from torch import nn

import fxprobe

TRACERS = ["fx", "hooks", "auto", "dynamo"]


def _hooked(model: nn.Module, edits: dict[str, Callable[[Any], Any]],
            x: torch.Tensor) -> torch.Tensor:
    """``model(x)`` on a copy, each module named in ``edits`` returning its edited output."""
    ref = copy.deepcopy(model)
    for path, fn in edits.items():
        ref.get_submodule(path).register_forward_hook(lambda m, a, o, fn=fn: fn(o))
    return ref(x)


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))


@pytest.mark.parametrize("tracer", TRACERS)
def test_submodule_assigned_inside_a_block(tracer: str) -> None:
    """A submodule assigned to the tapped module inside a block: the model is traced again
    at the next call, which runs the new module with the block's edits (it raised a
    ConfigError about train and eval mode: the graphs with points were not built again)."""
    model = _model()
    x = torch.randn(5, 4)
    tapped = fxprobe.tap(model, ops=nn.Linear, tracer=tracer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with tapped.intervene({"2": lambda s, v: v * 2}):
            tapped(x)
            torch.manual_seed(1)
            new = nn.Linear(8, 3)
            setattr(tapped, "4", new)
            model[4] = new
            out = tapped(x)
        torch.testing.assert_close(out, _hooked(model, {"2": lambda o: o * 2}, x))
        torch.testing.assert_close(tapped(x), model(x))
        with tapped.intervene({"4": lambda s, v: v * 0}):
            torch.testing.assert_close(tapped(x), _hooked(model, {"4": lambda o: o * 0}, x))


@pytest.mark.parametrize("tracer", TRACERS)
def test_traced_again_by_another_thread_inside_a_block(tracer: str) -> None:
    """Another thread assigns a submodule and runs the tapped module (traced again) while this
    thread is inside a block: this thread's next call runs the new trace with its edits (it
    raised a ConfigError about train and eval mode)."""
    model = _model()
    x = torch.randn(5, 4)
    tapped = fxprobe.tap(model, ops=nn.Linear, tracer=tracer)

    def other() -> None:
        torch.manual_seed(3)
        new = nn.Linear(8, 3)
        setattr(tapped, "4", new)
        model[4] = new
        tapped(x)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with tapped.intervene({"2": lambda s, v: v * 2}):
            tapped(x)
            thread = threading.Thread(target=other)
            thread.start()
            thread.join()
            out = tapped(x)
    torch.testing.assert_close(out, _hooked(model, {"2": lambda o: o * 2}, x))
    torch.testing.assert_close(tapped(x), model(x))


@pytest.mark.parametrize("capture", ["input", "both"])
@pytest.mark.parametrize("tracer", TRACERS)
def test_inputs_kept_inside_a_block(tracer: str, capture: str) -> None:
    """``capture="input"``/``"both"`` inside a block: a call's inputs are the values that flow
    after the block's edits (fx kept the arguments of the intervention point, the site's
    output and its names; dynamo kept the input as it was before the edit)."""
    torch.manual_seed(0)
    model = Twice()
    x = torch.randn(5, 4)
    tapped = fxprobe.tap(model, ops=nn.Linear, tracer=tracer, capture=capture)
    tapped(x)
    with tapped.intervene({"lin_1": lambda s, v: v * 0 + 2}):
        out = tapped(x)
    torch.testing.assert_close(out, model.out(torch.full((5, 4), 2.0)))

    def inputs(name: str) -> tuple[Any, ...]:
        taps = tapped.taps
        return tuple(taps[name] if capture == "input" else taps[name].inputs)

    first = model.lin(x)
    assert len(inputs("out")) == 1 and len(inputs("lin")) == 1
    torch.testing.assert_close(inputs("lin")[0], x)
    torch.testing.assert_close(inputs("lin_1")[0], torch.relu(first))
    torch.testing.assert_close(inputs("out")[0], torch.full((5, 4), 2.0))
    tapped(x)  # and outside the block, as the model computes
    torch.testing.assert_close(inputs("out")[0], model.lin(torch.relu(first)))


@pytest.mark.parametrize("tracer", TRACERS)
def test_cache_inside_a_block_editing_a_later_call(tracer: str) -> None:
    """``run_with_cache`` inside a block that edits a module's second call (``lin_1``): the
    edit applies and the block ends quietly (with tracer="hooks" it raised a SelectorError on
    leaving: only the cache's table had met the call)."""
    torch.manual_seed(0)
    model = Twice()
    x = torch.randn(5, 4)
    tapped = fxprobe.tap(model, ops=nn.Linear, tracer=tracer)
    with tapped.intervene({"lin_1": lambda s, v: v * 0 + 2}):
        out, cache = tapped.run_with_cache(x, names=["lin", "out"])
    torch.testing.assert_close(out, model.out(torch.full((5, 4), 2.0)))
    torch.testing.assert_close(cache["lin"], model.lin(x))
    torch.testing.assert_close(cache["out"], out.detach())
    torch.testing.assert_close(tapped(x), model(x))


@pytest.mark.parametrize("tracer", ["fx", "dynamo"])
def test_graph_input_kept_inside_a_block(tracer: str) -> None:
    """``capture="input"``: the graph's input site keeps no inputs, in a block as outside (in a
    block it kept the intervention point's arguments: the input, its name and two flags)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    x = torch.randn(2, 4)
    tapped = fxprobe.tap(model, tracer=tracer, capture="input")
    tapped(x)
    assert tapped.taps["input"] == ()
    with tapped.intervene({"0": lambda s, v: v + 1}):
        tapped(x)
    assert tapped.taps["input"] == ()
    torch.testing.assert_close(tapped.taps["1"][0], model[0](x) + 1)


@pytest.mark.parametrize("tracer", TRACERS)
def test_nested_blocks_editing_a_later_call(tracer: str) -> None:
    """A block editing ``lin_1`` around a block editing ``out``, the outer running no forward
    of its own: both edits apply and both blocks end quietly (with tracer="hooks" the outer
    block raised a SelectorError on leaving: only the inner table had met ``lin_1``)."""
    torch.manual_seed(0)
    model = Twice()
    x = torch.randn(5, 4)
    tapped = fxprobe.tap(model, ops=nn.Linear, tracer=tracer)
    second = model.lin(torch.relu(model.lin(x))) * 2
    with tapped.intervene({"lin_1": lambda s, v: v * 2}):
        with tapped.intervene({"out": lambda s, v: v + 1}):
            inner = tapped(x)
    torch.testing.assert_close(inner, model.out(second) + 1)
    torch.testing.assert_close(tapped(x), model(x))
