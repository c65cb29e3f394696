"""torch.compile on a TappedModule: no graph breaks, same outputs, values still captured."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import zoo

import fxprobe

MODES = [{}, {"reduce": "stats"}, {"reduce": "sample", "sample_size": 16}, {"keep": 3},
         {"to": "cpu"}, {"fn": lambda site, value: None}]


@pytest.mark.parametrize("kwargs", MODES)
def test_compile_tapped_module_without_graph_breaks(kwargs: dict[str, object]) -> None:
    model, (x,), _ = zoo.make("resnet")
    tapped = fxprobe.tap(model, **kwargs)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(tapped)(x)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0)
    torch._dynamo.reset()
    compiled = torch.compile(tapped, backend="eager")
    reference = fxprobe.tap(model, **kwargs)
    with torch.no_grad():
        got = compiled(x * 2)
        expected = reference(x * 2)
    assert torch.equal(got, expected) and torch.equal(got, model(x * 2))
    assert list(tapped.taps) == list(reference.taps)
    for name, value in reference.taps.items():
        got_value = tapped.taps[name]
        if isinstance(value, torch.Tensor):
            assert torch.equal(got_value, value), name
        elif isinstance(value, fxprobe.Stats):
            # Compiled, statistics take the device path; eager on a CPU, the host-read path:
            # the same numbers to float32 rounding.
            a, b = dataclasses.astuple(got_value), dataclasses.astuple(value)
            assert a[:3] == b[:3] and all(
                math.isclose(x, y, rel_tol=1e-5, abs_tol=1e-6) or (x != x and y != y)
                for x, y in zip(a[3:], b[3:], strict=True)), name
        else:
            assert got_value == value, name
    torch._dynamo.reset()


def test_compile_a_tapped_model_whose_untraceable_module_dynamo_would_capture() -> None:
    # tracer="auto" runs the module fx cannot trace under a dynamo of its own, which an outer
    # torch.compile traces through: that module falls back to hooks, and says why.
    from reference import hook_values
    from torch import nn

    model, (x,), _ = zoo.make("data_dependent")
    tapped = fxprobe.tap(model, ops=nn.Linear)
    torch._dynamo.reset()
    compiled = torch.compile(tapped, backend="eager")
    for inp in (x, -x):
        with torch.no_grad():
            got = compiled(inp)
            expected, ref = hook_values(model, ["stem", "gate.pos", "gate.neg.0", "head"], inp)
        assert torch.equal(got, expected)
        assert sorted(tapped.taps) == sorted(ref)
        for name, value in ref.items():
            assert torch.equal(tapped.taps[name], value), name
    (fb,) = tapped.fallbacks
    assert fb.path == "gate" and "torch dynamo failed too" in fb.error
    torch._dynamo.reset()


@pytest.mark.parametrize("keep", [3, "all"])
def test_compiled_history_keeps_every_forward_without_recompiling(keep: int | str) -> None:
    """The first call of a tapped module compiled (no eager call before it): each compiled
    call is one more forward of the history, with the eager module's values, and the history
    growing does not make dynamo recompile (it guarded on its length: a recompilation per
    call until dynamo's cache limit, then eager)."""
    from torch._dynamo.utils import counters

    model, (x,), _ = zoo.make("resnet")
    tapped = fxprobe.tap(model, keep=keep)
    reference = fxprobe.tap(model, keep=keep)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(tapped, backend="eager")
    inputs = [x * (i + 1) for i in range(6)]
    with torch.no_grad():
        for inp in inputs:
            assert torch.equal(compiled(inp), reference(inp))
    assert len(tapped.history) == len(reference.history) == (3 if keep == 3 else 6)
    for got, expected in zip(tapped.history, reference.history, strict=True):
        assert list(got) == list(expected)
        for name, value in expected.items():
            assert torch.equal(got[name], value), name
    assert counters["stats"]["unique_graphs"] <= (3 if keep == 3 else 2)
    torch._dynamo.reset()


class _StaticOutputs:
    """A dynamo backend that returns every graph output in the same memory at each call, as a
    CUDA-graph replay does, on a CPU; its ``config`` says CUDA graphs as
    ``mode="reduce-overhead"`` does."""

    config = {"triton.cudagraphs": True}

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: object) -> object:
        from torch.utils._pytree import tree_flatten, tree_unflatten

        static: list[object] = []

        def replay(*args: object) -> object:
            leaves, spec = tree_flatten(gm(*args))
            if not static:
                static.extend(v.clone() if isinstance(v, torch.Tensor) else v for v in leaves)
            else:
                for buf, v in zip(static, leaves, strict=True):
                    if isinstance(buf, torch.Tensor):
                        buf.copy_(v)
            return tree_unflatten(list(static), spec)

        return replay


@pytest.mark.parametrize("reduce", [None, "stats"])
def test_kept_values_survive_a_graph_replay_that_overwrites_its_outputs(
        monkeypatch: pytest.MonkeyPatch, reduce: str | None) -> None:
    """Under CUDA graphs each replay writes the graph's outputs into the same memory: values
    kept from one forward (a keep=3 history) must be copies made after the graph, else every
    kept forward shows the last one's values. Emulated on a CPU; tests/test_cuda.py runs
    mode="reduce-overhead" on a GPU."""
    from fxprobe.capture import pipeline

    monkeypatch.setattr(pipeline, "CUDAGRAPH_DEVICES", frozenset({"cuda", "cpu"}))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    tapped = fxprobe.tap(model, ops=torch.nn.Linear, keep=3, reduce=reduce)
    reference = fxprobe.tap(model, ops=torch.nn.Linear, keep=3, reduce=reduce)
    torch._dynamo.reset()
    compiled = torch.compile(tapped, backend=_StaticOutputs())
    inputs = [torch.randn(2, 8) * (i + 1) for i in range(4)]
    with torch.no_grad():
        for inp in inputs:
            assert torch.equal(compiled(inp), model(inp))
            reference(inp)
    assert len(tapped.history) == 3
    firsts = []
    for got, expected in zip(tapped.history, reference.history, strict=True):
        for name in ("0", "2"):
            if reduce is None:
                assert torch.equal(got[name], expected[name]), name
            else:
                assert got[name].mean == pytest.approx(expected[name].mean, rel=1e-5), name
                assert got[name].std == pytest.approx(expected[name].std, rel=1e-5), name
        firsts.append(got["0"].sum().item() if reduce is None else got["0"].mean)
    assert len(set(firsts)) == 3
    torch._dynamo.reset()


def test_cudagraphs_in_use_reads_the_compile_mode() -> None:
    from fxprobe.capture.pipeline import cudagraphs_in_use

    def probe(x: torch.Tensor) -> torch.Tensor:
        return x + 1 if cudagraphs_in_use() else x - 1

    x = torch.zeros(1)
    for kwargs, expected in (({"backend": "eager"}, -1.0), ({"mode": "reduce-overhead"}, 1.0),
                             ({"backend": _StaticOutputs()}, 1.0)):
        torch._dynamo.reset()
        assert torch.compile(probe, **kwargs)(x).item() == expected, kwargs  # type: ignore[arg-type]
    torch._dynamo.reset()
