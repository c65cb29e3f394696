"""In-place safety: a tap shows the value as produced, and copies only where needed."""

from __future__ import annotations

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

