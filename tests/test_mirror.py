"""Never modify the model: conversions, state written while tracing, patched forwards."""

from __future__ import annotations

import copy
import types
from typing import Any

import pytest
import torch
import zoo
from reference import model_state, states_equal
from torch import nn

import fxprobe


def _tensors(m: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [*m.named_parameters(), *m.named_buffers()]


@pytest.mark.parametrize("convert", [
    lambda m: m.double(),
    lambda m: m.half(),
    lambda m: m.to(torch.float64),
    lambda m: m.float(),
], ids=["double", "half", "to_float64", "float"])
@pytest.mark.parametrize("side", ["tapped", "model"])
def test_conversions_keep_model_and_tapped_module_sharing(convert: Any, side: str) -> None:
    model, (x,), _ = zoo.make("resnet")
    tapped = fxprobe.tap(model, ops="bn1")
    convert(tapped if side == "tapped" else model)
    ours = dict(_tensors(tapped))
    for name, t in _tensors(model):
        assert ours[name] is t, name  # the same tensor objects: buffers included
    dtype = next(model.parameters()).dtype
    assert {t.dtype for _, t in _tensors(model) if t.is_floating_point()} == {dtype}
    if dtype == torch.float64:
        with torch.no_grad():
            out = tapped(x.double())
            assert torch.equal(out, model(x.double()))
            assert tapped.taps["bn1"].dtype == torch.float64


def test_training_the_tapped_module_updates_the_models_running_stats() -> None:
    model, (x,), _ = zoo.make("resnet")
    tapped = fxprobe.tap(model, ops="bn1").double()
    before = model.bn1.running_mean.clone()
    tapped.train()
    with torch.no_grad():
        tapped(x.double())
    assert model.bn1.running_mean.dtype == torch.float64
    assert not torch.equal(model.bn1.running_mean, before.double())


class _Counter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.n = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.n += 1
        return self.lin(x) * self.n


def test_python_int_state_is_not_frozen_at_its_trace_time_value() -> None:
    torch.manual_seed(0)
    model = _Counter()
    reference = copy.deepcopy(model)
    x = torch.randn(2, 4)
    tapped = fxprobe.tap(model)
    (fb,) = tapped.fallbacks
    assert fb.path == "" and "self.n" in fb.error
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(tapped(x), reference(x))
    assert model.n == 0  # the model's own counter: tapping and running the copy leave it


class _Appends(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.seen: list[Any] = []
        self.register_buffer("steps", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(x)
        return self.lin(x)


class _BumpsBuffers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("steps", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.buffers():
            b.add_(1)
        return self.lin(x)


@pytest.mark.parametrize("cls", [_Appends, _BumpsBuffers])
def test_tracing_writes_nothing_into_the_model(cls: type[nn.Module], tmp_path: Any) -> None:
    torch.manual_seed(0)
    model = cls()
    before = model_state(model)
    x = torch.randn(2, 4)
    fxprobe.sites(model)
    tapped = fxprobe.tap(model, ops="lin")
    with pytest.raises(fxprobe.TraceError):
        fxprobe.extractor(model)
    fxprobe.to_dot(model)
    fxprobe.render(model, tmp_path / "m.dot")
    assert states_equal(before, model_state(model))
    assert getattr(model, "seen", []) == []
    (fb,) = tapped.fallbacks
    assert fb.path == ""
    reference = copy.deepcopy(model)
    with torch.no_grad():
        assert torch.equal(tapped(x), reference(x))
    assert torch.equal(tapped.taps["lin"], reference.lin(x))


class _Twice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(x))


def test_a_forward_patched_on_the_instance_is_the_one_that_runs() -> None:
    torch.manual_seed(0)
    model = _Twice()

    def patched(self: _Twice, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(x) * 3)

    model.forward = types.MethodType(patched, model)  # type: ignore[method-assign]
    block = model.block
    block._old_forward = block.forward  # accelerate's way: wrap the bound forward

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        return block._old_forward(*args, **kwargs) + 1

    block.forward = wrapped  # type: ignore[method-assign]
    x = torch.randn(2, 4)
    tapped = fxprobe.tap(model, ops=["head", "block"])
    with torch.no_grad():
        expected = model(x)
        got = tapped(x)
        head_in = (model.block[1](model.block[0](x)) + 1) * 3
    assert torch.equal(got, expected)
    assert torch.equal(tapped.taps["head"], model.head(head_in))
    # tracer="auto": dynamo traces both patched forwards (run on the copy), nothing falls back.
    assert not tapped.fallbacks
    assert model.forward.__func__ is patched and block.forward is wrapped
