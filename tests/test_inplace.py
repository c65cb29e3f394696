"""In-place safety: a tap shows the value as produced, and copies only where needed."""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import zoo
from reference import hook_values

import fxprobe


def _hand_computed(model: torch.nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        lin = model.lin(x)
        bn = model.bn(lin)
        act = torch.relu(bn)
        mul = act * 2
        relu_ = torch.relu(mul)
        view = relu_.reshape(-1)
        add_ = relu_ + 1.0
        sigmoid = torch.sigmoid(add_.reshape(-1))
        relu = torch.relu(sigmoid)
        add = relu + 1
    return {"lin": lin, "bn": bn, "act": act, "mul": mul, "relu_": relu_, "view": view,
            "add_": add_, "sigmoid": sigmoid, "relu": relu, "add": add,
            "reshape": add.reshape(-1, 8)}


def test_every_value_is_shown_as_produced() -> None:
    model, (x,), _ = zoo.make("inplace")
    tapped = fxprobe.tap(model)
    with torch.no_grad():
        tapped(x)
    for name, value in _hand_computed(model, x).items():
        assert torch.equal(tapped.taps[name], value), name


def test_copies_only_where_a_later_op_writes() -> None:
    model, (x,), _ = zoo.make("inplace")
    tapped = fxprobe.tap(model)
    # bn <- ReLU(inplace) module; sigmoid <- F.relu(inplace=True): each is overwritten by one
    # op that nothing else sees, which runs out of place instead. mul <- relu_() and add_()
    # (two writers); relu_ and view <- add_() through the view z (aliasing that others see):
    # copied. Nothing else is written after it is produced.
    assert tapped.outplaced == {"bn", "sigmoid"}
    assert tapped.copied == {"mul", "relu_", "view"}
    always = fxprobe.tap(model, copy="always")
    assert always.outplaced == frozenset()


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _real_outputs(model: torch.nn.Module, paths: list[str]
                  ) -> tuple[dict[str, torch.Tensor], list[torch.utils.hooks.RemovableHandle]]:
    """The modules' outputs themselves (not copies), by forward hooks: tensors the model, or
    its caller, may write later."""
    seen: dict[str, torch.Tensor] = {}
    handles = [model.get_submodule(p).register_forward_hook(
        lambda m, a, out, p=p: seen.__setitem__(p, out)) for p in paths]
    return seen, handles


def _assert_kept_apart(taps: dict[str, torch.Tensor], written: list[torch.Tensor]) -> None:
    """No kept value shares storage with another, nor with a tensor that may be written."""
    kept = {name: _storage(v) for name, v in taps.items()}
    assert len(set(kept.values())) == len(kept), kept
    shared = {name for name, ptr in kept.items() if ptr in {_storage(t) for t in written}}
    assert not shared


def test_copy_always_keeps_overwritten_values_as_produced_in_their_own_storage() -> None:
    """copy="always": every kept value is a copy taken where it was produced, also of the
    values a later op overwrites (bn under the in-place ReLU, y through its view z): equal to
    what cloning forward hooks and the code written out by hand see, and untouched when the
    model's own tensors, its input and its output are written afterwards."""
    model, (x,), _ = zoo.make("inplace")
    _, ref = hook_values(model, ["lin", "bn", "act"], x)
    want = _hand_computed(model, x)
    real, handles = _real_outputs(model, ["lin", "bn", "act"])
    try:
        tapped = fxprobe.tap(model, copy="always")
        with torch.no_grad():
            out = tapped(x)
    finally:
        for h in handles:
            h.remove()
    taps = dict(tapped.taps)
    assert set(taps) == {"x", *want} and tapped.outplaced == frozenset()
    assert (ref["bn"] < 0).any()  # the in-place ReLU did overwrite it
    _assert_kept_apart(taps, [x, out, *real.values()])
    given = x.clone()
    for t in (x, out, *real.values()):
        t.add_(100.0)
    assert torch.equal(taps["x"], given)
    for name in ("lin", "bn", "act"):
        assert torch.equal(taps[name], ref[name]), name
    for name, value in want.items():
        assert torch.equal(taps[name], value), name


@pytest.mark.parametrize("tracer", ["fx", "hooks", "dynamo"])
def test_copy_always_copies_values_nothing_overwrites(tracer: str) -> None:
    """copy="always" on a model with no in-place op (where "auto" copies nothing): the kept
    values share storage with none of the model's tensors, its input or its output, so
    writing those afterwards leaves them as cloning forward hooks saw them."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.ReLU(),
                                torch.nn.Linear(5, 3)).eval()
    x = torch.randn(2, 4)
    paths = ["0", "1", "2"]
    _, ref = hook_values(model, paths, x)
    real, handles = _real_outputs(model, paths)
    try:
        tapped = fxprobe.tap(model, copy="always", tracer=tracer)
        with torch.no_grad():
            out = tapped(x)
    finally:
        for h in handles:
            h.remove()
    taps = dict(tapped.taps)
    assert set(taps) >= set(paths)
    _assert_kept_apart(taps, [x, out, *real.values()])
    expected = x.clone()
    for t in (x, out, *real.values()):
        t.mul_(0)
    for name in paths:
        assert torch.equal(taps[name], ref[name]), name
    if "input" in taps:
        assert torch.equal(taps["input"], expected)


def test_resnet_batchnorm_before_inplace_relu() -> None:
    model, (x,), _ = zoo.make("resnet")
    tapped = fxprobe.tap(model, ops=["bn1", "layer1.0.bn1", "conv1", "layer1.0.add"])
    with torch.no_grad():
        tapped(x)
        bn1 = model.bn1(model.conv1(x))
    assert (bn1 < 0).any()
    assert torch.equal(tapped.taps["bn1"], bn1)
    assert (tapped.taps["layer1.0.bn1"] < 0).any()
    assert (tapped.taps["layer1.0.add"] < 0).any()
    assert "conv1" not in tapped.copied | tapped.outplaced  # never written in place
    assert {"bn1", "layer1.0.bn1", "layer1.0.add"} <= tapped.outplaced


@pytest.mark.parametrize("how", ["dynamo", "hook"])
def test_hook_sites_copy_under_auto(how: str, request: pytest.FixtureRequest) -> None:
    if how == "hook":
        request.getfixturevalue("dynamo_fails")  # the module runs as written, hooked
    class Opaque(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.lin(x)
            if y.sum() > -1e9:  # data-dependent: not traceable
                y.mul_(0)
            return y

    model = Opaque()
    x = torch.randn(2, 4)
    tapped = fxprobe.tap(model, ops="lin")
    with torch.no_grad():
        tapped(x)
        assert torch.equal(tapped.taps["lin"], model.lin(x))
        assert tapped.taps["lin"].abs().sum() > 0  # the copy matters: mul_(0) zeroes y
    assert tapped.sites[0].how == how


def test_functional_inplace_on_input_placeholder() -> None:
    class M(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            F.relu(x, inplace=True)
            return x * 2

    x = torch.randn(3, 3)
    ref = x.clone()
    tapped = fxprobe.tap(M(), ops="x")
    tapped(x)
    assert torch.equal(tapped.taps["x"], ref)


class _ReadsAfterWrite(torch.nn.Module):
    """Reads a value again after an in-place op wrote it: eager sees the written value."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.act = torch.nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.lin(x)
        b = self.act(a)
        return a + b  # a is relu(a) by now


def test_an_inplace_op_whose_aliasing_is_seen_is_not_run_out_of_place() -> None:
    torch.manual_seed(0)
    model = _ReadsAfterWrite()
    x = torch.randn(3, 4)
    tapped = fxprobe.tap(model, ops="lin")
    with torch.no_grad():
        out = tapped(x)
        lin = model.lin(x)
        expected = model(x)
    assert torch.equal(out, expected) and torch.equal(expected, 2 * torch.relu(lin))
    assert torch.equal(tapped.taps["lin"], lin) and (lin < 0).any()
    assert tapped.copied == {"lin"} and tapped.outplaced == frozenset()


class _WritesWhatItGets(torch.nn.Module):
    """Untraceable code that writes in place into what a traced child returned."""

    def __init__(self) -> None:
        super().__init__()
        self.block = torch.nn.Sequential(torch.nn.Linear(4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.block(x)
        if y.sum() > -1e9:  # data-dependent: this forward runs as written
            y.relu_()
        return y


def test_a_value_returned_to_untraced_code_is_kept_as_produced() -> None:
    torch.manual_seed(0)
    model = _WritesWhatItGets()
    x = torch.randn(3, 4)
    tapped = fxprobe.tap(model, ops="block.0")
    with torch.no_grad():
        out = tapped(x)
        lin = model.block[0](x)
    assert (lin < 0).any() and torch.equal(out, torch.relu(lin))
    # The caller fxprobe cannot see writes into it after the traced block returns.
    assert torch.equal(tapped.taps["block.0"], lin)


class _Accumulate(torch.nn.Module):
    """Adds into a state tensor its caller owns (``state.add_``): the caller sees the sum."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        return state.add_(self.lin(x))


@pytest.mark.parametrize("tracer", ["fx", "dynamo", "auto"])
def test_an_inplace_write_into_a_model_input_stays_in_place(tracer: str) -> None:
    """Tapping an input that the model writes in place (every site, inputs included): the
    write must still reach the caller's tensor (it was run out of place under fx, so a state
    the model accumulates stopped accumulating), and the input as given is what is shown."""
    model = _Accumulate().eval()
    xs = [torch.randn(2, 4, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    tapped = fxprobe.tap(model, tracer=tracer)
    state, expected_state = torch.zeros(2, 4), torch.zeros(2, 4)
    with torch.no_grad():
        for x in xs:
            before = state.clone()
            assert torch.equal(tapped(x, state), model(x, expected_state))
            if tracer != "dynamo":  # the dynamo frontend has no input sites
                assert torch.equal(tapped.taps["state"], before)
    assert torch.equal(state, expected_state) and not tapped.outplaced

    relu = torch.nn.Sequential(torch.nn.ReLU(inplace=True))
    x = torch.randn(2, 4)
    mine, theirs = x.clone(), x.clone()
    fxprobe.tap(relu, tracer=tracer)(mine)
    relu(theirs)
    assert torch.equal(mine, theirs)


class _WriteThroughAttribute(torch.nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.how = how

    def forward(self, a: torch.Tensor) -> torch.Tensor:
        x = self.lin(a)
        if self.how == "T":
            x.T.relu_()
        elif self.how == "mT":
            x.mT.fill_(1.0)
        elif self.how == "data":
            x.data.zero_()
        else:
            F.relu(x.real, inplace=True)
        return x * 2


@pytest.mark.parametrize("tracer", ["fx", "dynamo"])
@pytest.mark.parametrize("how", ["T", "mT", "data", "real"])
def test_a_write_through_an_attribute_view_is_seen(how: str, tracer: str) -> None:
    """``x.T``, ``x.mT``, ``x.data`` and ``x.real`` share ``x``'s storage: an in-place op on
    them overwrites a tapped ``x``, which must be shown as produced (a cloning hook's value)."""
    model = _WriteThroughAttribute(how).eval()
    a = torch.randn(4, 4, generator=torch.Generator().manual_seed(3))
    seen: dict[str, torch.Tensor] = {}
    handle = model.lin.register_forward_hook(lambda m, i, o: seen.update(lin=o.clone()))
    with torch.no_grad():
        expected = model(a)
    handle.remove()
    tapped = fxprobe.tap(model, ops="lin", tracer=tracer)
    with torch.no_grad():
        assert torch.equal(tapped(a), expected)
    assert torch.equal(tapped.taps["lin"], seen["lin"]) and "lin" in tapped.copied


class _ScaleInPlace(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(2)
        return x


class _ScaledNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.scale = _ScaleInPlace()

    def forward(self, a: torch.Tensor) -> torch.Tensor:
        return self.scale(self.lin(a)) + 1


@pytest.mark.parametrize("tracer", ["fx", "auto", "hooks"])
@pytest.mark.parametrize("capture", ["output", "both"])
def test_a_module_that_writes_its_input_and_returns_it(tracer: str, capture: str) -> None:
    """``scale`` returns its input after writing it in place: tap() raised KeyError under fx,
    and the call's site must show the value it returns (after the write), ``lin`` the value
    before it, as cloning hooks see them."""
    model = _ScaledNet().eval()
    a = torch.randn(2, 4, generator=torch.Generator().manual_seed(5))
    seen: dict[str, torch.Tensor] = {}
    handles = [
        model.lin.register_forward_hook(lambda m, i, o: seen.update(lin=o.clone())),
        model.scale.register_forward_pre_hook(lambda m, i: seen.update(scale_in=i[0].clone())),
        model.scale.register_forward_hook(lambda m, i, o: seen.update(scale=o.clone())),
    ]
    with torch.no_grad():
        expected = model(a)
    for h in handles:
        h.remove()
    tapped = fxprobe.tap(model, ops=["lin", "scale"], tracer=tracer, capture=capture)
    with torch.no_grad():
        assert torch.equal(tapped(a), expected)
    got = tapped.taps
    if capture == "output":
        assert torch.equal(got["lin"], seen["lin"]) and torch.equal(got["scale"], seen["scale"])
    else:
        assert torch.equal(got["lin"].output, seen["lin"])
        assert torch.equal(got["scale"].output, seen["scale"])
        assert torch.equal(got["scale"].inputs[0], seen["scale_in"])


class _WriteAfterBreak(torch.nn.Module):
    """``h`` enters the graph of ``lin`` as an input; after a graph break, code in the next
    graph writes it in place."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = torch.nn.Linear(4, 4)
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, a: torch.Tensor) -> torch.Tensor:
        h = self.stem(a)
        torch._dynamo.graph_break()
        y = self.lin(h)
        torch._dynamo.graph_break()
        h.mul_(0)
        return y + h


@pytest.mark.parametrize("tracer", ["dynamo", "auto", "hooks"])
def test_a_graph_input_written_after_a_graph_break_is_shown_as_given(tracer: str) -> None:
    """The captured input of ``lin`` is an input of its dynamo graph, which the graph after
    the next break zeroes in place: it must be shown as ``lin`` received it (it showed the
    zeros: only what a graph returns counted as exposed to the code around it)."""
    model = _WriteAfterBreak().eval()
    a = torch.randn(2, 4, generator=torch.Generator().manual_seed(6))
    seen: dict[str, torch.Tensor] = {}
    handle = model.lin.register_forward_pre_hook(lambda m, i: seen.update(x=i[0].clone()))
    with torch.no_grad():
        expected = model(a)
    handle.remove()
    tapped = fxprobe.tap(model, ops="lin", capture="both", tracer=tracer)
    with torch.no_grad():
        assert torch.equal(tapped(a), expected)
    assert torch.equal(tapped.taps["lin"].inputs[0], seen["x"])


class _AddIntoViewed(torch.nn.Module):
    """``x += 1`` writes ``x``'s storage: the view ``v`` made before it sees the update."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, a: torch.Tensor) -> torch.Tensor:
        x = self.lin(a)
        v = x.view(-1)
        x += 1
        return v * 2


class _AliasedResidual(torch.nn.Module):
    """A residual whose branch hands its input back (``body`` is an Identity): ``out`` is
    ``identity``, so ``out += identity`` doubles ``identity`` too."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)
        self.body = torch.nn.Identity()

    def forward(self, a: torch.Tensor) -> torch.Tensor:
        identity = self.fc(a)
        out = self.body(identity)
        out += identity
        return out + identity  # 2 * fc + 2 * fc in eager


class _AddsIntoInput(torch.nn.Module):
    """``x += bias`` on a tensor the caller gave: eager updates the caller's tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        x += bias
        return self.fc(x)


@pytest.mark.parametrize("ops", [None, ["lin"]])
def test_augmented_assignment_updates_a_view_made_before_it(ops: list[str] | None) -> None:
    """``x += 1`` is ``x.add_(1)`` in eager: fx recorded it as ``x + 1``, so ``v`` missed the
    update and the tapped output was ``2 * lin`` instead of the model's ``2 * (lin + 1)``."""
    model = _AddIntoViewed().eval()
    a = torch.randn(2, 4, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        expected, seen = hook_values(model, ["lin"], a)
        tapped = fxprobe.tap(model, ops=ops)
        out = tapped(a)
    lin = seen["lin"]
    assert torch.equal(expected, 2 * (lin.reshape(-1) + 1))
    assert torch.equal(out, expected)
    assert torch.equal(tapped.taps["lin"], lin)  # as produced, before the +=
    if ops is None:
        assert torch.equal(tapped.taps["view"], lin.reshape(-1))
        assert torch.equal(tapped.taps["add"], lin + 1)
        assert torch.equal(tapped.taps["mul"], expected)
        assert {"lin", "view"} <= tapped.copied  # v reads the storage after the +=


@pytest.mark.parametrize("tracer", ["fx", "auto"])
def test_a_residual_add_into_an_aliased_identity(tracer: str) -> None:
    """``out += identity`` where ``out`` is ``identity``: the output was ``3 * fc`` instead of
    ``4 * fc``; ``fc`` and ``body`` are shown as produced, as cloning hooks see them."""
    model = _AliasedResidual().eval()
    a = torch.randn(2, 4, generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        expected, seen = hook_values(model, ["fc", "body"], a)
        tapped = fxprobe.tap(model, tracer=tracer)
        out = tapped(a)
    assert torch.equal(expected, 4 * seen["fc"])
    assert torch.equal(out, expected)
    assert torch.equal(tapped.taps["fc"], seen["fc"])
    assert torch.equal(tapped.taps["body"], seen["body"])
    assert torch.equal(tapped.taps["add"], 2 * seen["fc"])
    assert torch.equal(tapped.taps["add_1"], expected)
    assert {"fc", "body"} <= tapped.copied


def test_augmented_assignment_into_a_model_input_reaches_the_caller() -> None:
    """``x += bias`` on a model input: eager changes the caller's tensor; the tapped module
    did not (fx made it ``x + bias``). The input is shown as given, and the write into it is
    never run out of place (storage the graph does not own)."""
    model = _AddsIntoInput().eval()
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(9))
    bias = torch.ones(4)
    mine, theirs = x.clone(), x.clone()
    tapped = fxprobe.tap(model)
    with torch.no_grad():
        out = tapped(mine, bias)
        expected, seen = hook_values(model, ["fc"], theirs, bias)
    assert torch.equal(theirs, x + 1)  # the model's own behaviour
    assert torch.equal(out, expected) and torch.equal(mine, theirs)
    assert torch.equal(tapped.taps["x"], x)
    assert torch.equal(tapped.taps["add"], x + 1)
    assert torch.equal(tapped.taps["fc"], seen["fc"])
    assert "x" in tapped.copied and not tapped.outplaced


class _SizeArithmetic(torch.nn.Module):
    """``n += 1`` on a number: a new value; ``m``, a second name of the old one, keeps it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.size(0)
        m = n
        n += 1
        y = x.new_ones(m, n)
        y *= 3  # on a tensor, in place
        return y


def test_augmented_assignment_on_a_number_makes_a_new_value() -> None:
    model = _SizeArithmetic()
    x = torch.randn(2, 4)
    tapped = fxprobe.tap(model)
    out = tapped(x)
    assert out.shape == (2, 3) and torch.equal(out, model(x))
    assert torch.equal(tapped.taps["new_ones"], torch.ones(2, 3))  # before the *=


def test_an_inplace_add_before_an_inplace_relu_runs_out_of_place() -> None:
    """A ResNet block taps every site without a copy where fx used to: ``bn2`` is written by
    ``out += identity`` and ``add`` by ``ReLU(inplace=True)``, each the first write that
    nothing else sees, so each runs out of place; the values are as cloning hooks see them."""
    model, (x,), _ = zoo.make("resnet")
    model.eval()
    paths = ["layer1.0.bn2", "layer1.0.relu"]
    with torch.no_grad():
        expected, seen = hook_values(model, paths, x)
        tapped = fxprobe.tap(model)
        out = tapped(x)
    assert torch.equal(out, expected)
    assert torch.equal(tapped.taps["layer1.0.bn2"], seen["layer1.0.bn2"])
    assert torch.equal(tapped.taps["layer1.0.relu_1"], seen["layer1.0.relu_1"])
    assert {"layer1.0.bn2", "layer1.0.add"} <= tapped.outplaced
    assert not {n for n in tapped.copied if n.startswith("layer1.0.")}


# -- review findings: each model against its eager twin -----------------------------------------
#
# Each case runs a model eagerly and tapped (on copies, with copies of the inputs) and compares
# what eager leaves behind: the output (dtype included) or the error, the caller's tensors
# written in place, and the state after the forward; taps against cloning hooks or values
# computed by hand.

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
