"""In-place cases found in review: writes through attributes, aliases and opaque code, and
out-of-place runs that keep the dtype and the errors eager has."""


from __future__ import annotations

import copy
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from reference import hook_values

import fxprobe

FRONTENDS = ["fx", "dynamo", "script", "export"]


def _tap_with(frontend: str, model: torch.nn.Module, args: tuple[Any, ...], **kw: Any) -> Any:
    if frontend == "fx":
        return fxprobe.tap(model, **kw)
    if frontend in ("dynamo", "auto", "hooks"):
        return fxprobe.tap(model, tracer=frontend, **kw)
    if frontend == "script":
        return fxprobe.tap(torch.jit.script(model), **kw)
    return fxprobe.tap(torch.export.export(model, _copies(args)), **kw)


def _copies(args: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)


def _identical(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_identical(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _against_eager(make: Callable[[], torch.nn.Module], args: tuple[Any, ...], frontend: str,
                   **kw: Any) -> Any:
    """Tap ``make()`` with ``frontend``: the same output (or error), inputs and state as eager.
    Returns the tapped module (None where eager raised)."""
    torch.manual_seed(0)
    model = make()
    eager_model, tapped_model = copy.deepcopy(model), copy.deepcopy(model)
    eager_args, tapped_args = _copies(args), _copies(args)
    try:
        want = eager_model(*eager_args)
    except RuntimeError as e:  # dynamo and export raise their own tracing errors
        match = re.escape(str(e)[:40]) if frontend in ("fx", "script") else None
        with pytest.raises(RuntimeError, match=match):
            _tap_with(frontend, tapped_model, args, **kw)(*tapped_args)
        return None
    tapped = _tap_with(frontend, tapped_model, args, **kw)
    got = tapped(*tapped_args)
    assert _identical(got, want), (got, want)
    assert all(_identical(a, b) for a, b in zip(tapped_args, eager_args, strict=True))
    if frontend == "script":
        state = dict(tapped.script_module.model.state_dict())
    elif frontend == "export":
        state = {**tapped.exported().state_dict, **tapped.exported().constants}
    else:
        state = tapped_model.state_dict()
    for name, value in eager_model.state_dict().items():
        assert _identical(state[name], value), name
    return tapped


class _AugmentedThroughAttribute(torch.nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * 1
        v = getattr(h, self.how)
        v += 1
        return h


class _AugmentedIntoInputData(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        v = x.data
        v += 1
        return x * 2


@pytest.mark.parametrize("tracer", ["fx", "dynamo"])
@pytest.mark.parametrize("how", ["T", "mT", "data", "real"])
def test_review_augmented_assignment_through_an_attribute_view(how: str, tracer: str) -> None:
    """Finding 1: ``v = h.T; v += 1`` writes ``h`` (fx recorded ``+``: ``h`` stayed 0)."""
    tapped = _against_eager(lambda: _AugmentedThroughAttribute(how), (torch.zeros(2, 2),), tracer)
    assert torch.equal(tapped.taps["mul"], torch.zeros(2, 2))
    _against_eager(_AugmentedIntoInputData, (torch.zeros(2),), tracer)


class _WriteThroughAlias(torch.nn.Module):
    def __init__(self, fn: str) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * 1
        if self.fn == "broadcast_tensors":
            a = torch.broadcast_tensors(h, x)[0]
        else:
            a = getattr(torch, self.fn)(h)
        a.add_(1)
        return h * 2


class _AsTensorOfInput(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.as_tensor(x)
        h += 1
        return h * 2


@pytest.mark.parametrize("tracer", ["fx", "dynamo"])
@pytest.mark.parametrize("fn", ["broadcast_tensors", "as_tensor", "conj", "atleast_1d",
                                "atleast_2d", "atleast_3d", "positive", "resolve_conj",
                                "resolve_neg"])
def test_review_a_write_through_an_unknown_alias_reaches_its_base(fn: str, tracer: str) -> None:
    """Finding 2: a function that returns an alias the engine does not know about; the write
    through it was run out of place, so ``h`` never got it."""
    x = torch.tensor([0.0, 1.0])
    tapped = _against_eager(lambda: _WriteThroughAlias(fn), (x,), tracer)
    assert torch.equal(tapped.taps["mul"], x)
    _against_eager(_AsTensorOfInput, (x,), tracer)
    for kw in ({"copy": "never"}, {"ops": "mul"}):
        _against_eager(lambda: _WriteThroughAlias(fn), (x,), tracer, **kw)


class _Cache(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("buf", torch.zeros(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > -1e30:  # data-dependent: fx cannot trace it
            return self.buf
        return self.buf


class _WritesReturnedState(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.cache = _Cache()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.cache(x * 1)
        return c.add_(x.sum(0)) * 2


@pytest.mark.parametrize("how", ["leaf", "auto"])
def test_review_a_write_into_state_that_opaque_code_returned(how: str) -> None:
    """Finding 3: a leaf module returns its buffer; the write into it must stay in place."""
    kw: dict[str, Any] = {"leaf_modules": [_Cache]} if how == "leaf" else {"tracer": "auto"}
    torch.manual_seed(0)
    model = _WritesReturnedState()
    eager = copy.deepcopy(model)
    x = torch.ones(2, 3)
    want = eager(x)
    tapped = fxprobe.tap(model, **kw)
    assert torch.equal(tapped(x), want)
    assert torch.equal(model.cache.buf, eager.cache.buf) and torch.equal(eager.cache.buf,
                                                                          torch.full((3,), 2.0))
    assert torch.equal(tapped.taps["cache"], torch.zeros(3))  # as the module returned it


class _AddsIntoProduct(torch.nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = x * 2
        h += y
        return h


class _AddsIntoProductByMethod(torch.nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = x * 2
        return h.add_(y)


@pytest.mark.parametrize("frontend", FRONTENDS)
@pytest.mark.parametrize("make", [_AddsIntoProduct, _AddsIntoProductByMethod])
def test_review_an_outplaced_write_keeps_the_written_dtype(
        frontend: str, make: Callable[[], torch.nn.Module]) -> None:
    """Finding 4: ``h += y`` with ``h`` float16 and ``y`` float32 stays float16 (eager casts the
    result into ``h``); run out of place it was float32."""
    x = torch.randn(3, generator=torch.Generator().manual_seed(0)).half()
    y = torch.randn(3, generator=torch.Generator().manual_seed(1))
    tapped = _against_eager(make, (x, y), frontend)
    assert torch.equal(tapped.taps["mul"], x * 2)


class _AddsFloat(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * 2
        h += 0.5
        return h


class _AddsFloatByMethod(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * 2
        return h.add_(0.5) * 1


class _Divides(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * 2
        h /= 3
        return h


class _FloorDivides(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * 2
        h.div_(3, rounding_mode="floor")
        return h * 1


class _SigmoidInPlace(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * 2
        return torch.sigmoid_(h) * 1


@pytest.mark.parametrize("frontend", FRONTENDS)
@pytest.mark.parametrize("make", [_AddsFloat, _AddsFloatByMethod, _Divides, _FloorDivides,
                                  _SigmoidInPlace])
def test_review_an_outplaced_write_raises_what_eager_raises(
        frontend: str, make: Callable[[], torch.nn.Module]) -> None:
    """Finding 5: ``h += 0.5`` on an integer tensor raises in eager (a float result cannot be
    cast into ``h``); run out of place it returned a value. ``div_(rounding_mode="floor")``
    keeps the integer dtype and works in both."""
    _against_eager(make, (torch.tensor([1, 2]),), frontend)


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_review_an_outplaced_write_raises_on_a_larger_broadcast(frontend: str) -> None:
    """Finding 5: ``h += y`` where ``h + y`` broadcasts to more than ``h`` raises in eager."""
    _against_eager(_AddsIntoProduct, (torch.ones(3), torch.ones(2, 3)), frontend)


class _HookedBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = torch.nn.Linear(3, 3)
        self.block = torch.nn.Sequential(torch.nn.ReLU(inplace=True), torch.nn.Linear(3, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(self.stem(x))


@pytest.mark.parametrize("how", ["hooked", "leaf"])
def test_review_a_container_leaf_may_write_what_it_is_given(how: str) -> None:
    """Finding 6: a ``Sequential`` leaf holds ``ReLU(inplace=True)``: it writes its input."""
    torch.manual_seed(0)
    model = _HookedBlock()
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(2))
    kw: dict[str, Any] = {}
    if how == "hooked":
        model.block.register_forward_hook(lambda *a: None)
    else:
        kw["leaf_modules"] = [torch.nn.Sequential]
    with torch.no_grad():
        want, seen = hook_values(model, ["stem"], x)
        tapped = fxprobe.tap(model, **kw)
        assert torch.equal(tapped(x), want)
    assert torch.equal(tapped.taps["stem"], seen["stem"])


class _WritesThroughAttribute(torch.nn.Module):
    def __init__(self, returned: bool) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)
        self.register_buffer("buf", torch.zeros(2, 3))
        self.returned = returned

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        self.buf = h
        if self.returned:
            return self.buf.relu_() * 2
        self.buf.mul_(2)
        return h + 1


@pytest.mark.parametrize("returned", [True, False])
def test_review_a_write_through_a_script_attribute_that_holds_a_value(returned: bool) -> None:
    """Finding 7: after ``self.buf = h`` (``prim::SetAttr``), ``self.buf.relu_()`` writes ``h``."""
    model = _WritesThroughAttribute(returned)
    x = torch.randn(2, 3, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want, seen = hook_values(copy.deepcopy(model), ["lin"], x)
        tapped = fxprobe.tap(torch.jit.script(model), ops="lin")
        assert torch.equal(tapped(x), want)
    assert torch.equal(tapped.taps["lin"], seen["lin"]) and "lin" in tapped.copied


class _MetadataInPlace(torch.nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * 2
        if self.how == "requires_grad_":
            return h.requires_grad_().sum()
        if self.how == "resize_":
            return h.resize_(4) * 1
        return h.t_() * 1


@pytest.mark.parametrize("tracer", ["fx", "dynamo"])
@pytest.mark.parametrize("how", ["requires_grad_", "resize_", "t_"])
def test_review_a_metadata_inplace_op_is_never_run_out_of_place(how: str, tracer: str) -> None:
    """Finding 8: ``requires_grad_`` and ``resize_`` have no out-of-place twin (``Tensor.
    requires_grad`` is a property, ``Tensor.resize`` another op); ``t_`` changes the shape."""
    x = torch.arange(6.0).reshape(2, 3)
    tapped = _against_eager(lambda: _MetadataInPlace(how), (x,), tracer)
    assert torch.equal(tapped.taps["mul"], x * 2)


class _ClampsItsWeight(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor([0.5, 2.0, -3.0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * self.w
        with torch.no_grad():
            self.w.clamp_(-1, 1)
        return y


class _RenormedEmbedding(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(4, 3)
        with torch.no_grad():
            self.emb.weight.mul_(10)

    def forward(self, i: torch.Tensor) -> torch.Tensor:
        return F.embedding(i, self.emb.weight, max_norm=1.0) * 1


def test_review_a_parameter_written_later_is_shown_as_read() -> None:
    """Finding 9: a tapped parameter that a later op writes is copied (and detached)."""
    with torch.no_grad():  # fx records no ``with torch.no_grad()`` inside forward
        tapped = _against_eager(_ClampsItsWeight, (torch.ones(3),), "fx")
    assert torch.equal(tapped.taps["w"], torch.tensor([0.5, 2.0, -3.0]))
    assert not isinstance(tapped.taps["w"], torch.nn.Parameter)
    torch.manual_seed(0)
    emb = _RenormedEmbedding()
    before = emb.emb.weight.detach().clone()
    tapped = fxprobe.tap(emb)
    with torch.no_grad():
        out = tapped(torch.tensor([0, 1]))
    assert torch.equal(tapped.taps["emb_weight"], before)
    assert not torch.equal(emb.emb.weight[:2], before[:2])  # renormed in place, as eager does
    assert torch.allclose(out.norm(dim=1), torch.ones(2))

