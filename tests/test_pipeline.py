"""The tap pipeline: gradients, interventions and input capture, by graph taps and hooks alike."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import zoo
from torch import nn

import fxprobe


def _resnet_by_hand(m: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """zoo.ResNetish with no in-place op, keeping the values whose gradients are tested."""
    keep: dict[str, torch.Tensor] = {}
    h = keep["bn1"] = m.bn1(m.conv1(x))
    h = m.maxpool(F.relu(h))
    for i, block in enumerate([*m.layer1, *m.layer2]):
        prefix = f"layer{1 + i // 2}.{i % 2}"
        out = keep[f"{prefix}.bn1"] = block.bn1(block.conv1(h))
        out = block.bn2(block.conv2(F.relu(out)))
        identity = block.downsample(h) if block.downsample is not None else h
        out = keep[f"{prefix}.add"] = out + identity
        h = F.relu(out)
    return m.fc(torch.flatten(m.avgpool(h), 1)), keep


@pytest.mark.parametrize("copy", ["auto", "always"])
def test_grad_is_taken_at_the_value_a_later_inplace_op_overwrites(copy: str) -> None:
    model, (x,), _ = zoo.make("resnet")
    names = ["bn1", "layer1.0.bn1", "layer1.0.add", "layer2.0.add", "layer2.1.bn1"]
    tapped = fxprobe.tap(model, ops=names, grad=True, copy=copy)
    out = tapped(x)
    out.square().sum().backward()
    ref_out, keep = _resnet_by_hand(model, x)
    expected = torch.autograd.grad(ref_out.square().sum(), [keep[n] for n in names])
    for name, g in zip(names, expected, strict=True):
        # The ReLU after each of these zeroes part of the gradient: a hook that followed the
        # tensor onto the in-place ReLU would report d loss/d ReLU output instead.
        torch.testing.assert_close(tapped.grads[name], g, rtol=1e-5, atol=1e-6)
        assert bool((g == 0).any()), name


def test_grad_fn_replaces_the_gradient_at_the_value() -> None:
    model, (x,), _ = zoo.make("resnet")
    tapped = fxprobe.tap(model, ops="bn1", grad_fn=lambda s, g: torch.zeros_like(g))
    tapped(x).sum().backward()
    # bn1 feeds conv1's output only: with its gradient zeroed, conv1's weight gets none.
    assert model.conv1.weight.grad is not None
    assert torch.count_nonzero(model.conv1.weight.grad) == 0


class _Seq(nn.Sequential):
    pass


def test_fn_on_an_input_site_replaces_what_flows_from_it() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    x = torch.randn(3, 4)
    seen = []

    def double_input(site: fxprobe.Site, value: torch.Tensor) -> torch.Tensor:
        seen.append(site.name)
        return value * 2

    tapped = fxprobe.tap(model, ops="input", fn=double_input)
    with torch.no_grad():
        got = tapped(x)
        expected = model(x * 2)
    assert seen == ["input"]
    assert torch.equal(got, expected)
    assert tapped.taps.replaced == {"input"}
    assert torch.equal(tapped.taps["input"], x * 2)


def test_fn_sees_one_site_record_and_replaced_is_per_forward() -> None:
    model, (x,), _ = zoo.make("resnet")
    calls: list[fxprobe.Site] = []
    flip = {"on": True}

    def fn(site: fxprobe.Site, value: torch.Tensor) -> torch.Tensor | None:
        calls.append(site)
        return value * 0 if flip["on"] and site.name == "layer1.0.add" else None

    tapped = fxprobe.tap(model, ops=["layer1.0.add", "fc"], fn=fn)
    with torch.no_grad():
        tapped(x)
        assert tapped.taps.replaced == {"layer1.0.add"}
        flip["on"] = False
        tapped(x)
    assert tapped.taps.replaced == frozenset()
    assert calls[0] == tapped.sites[0] and calls[0].name == "layer1.0.add"


class _Recursive(nn.Module):
    """Calls itself while its first call is still running (and cannot be traced)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, depth: int = 1) -> torch.Tensor:
        if x.sum() > 1e9:  # data-dependent: fx gives up, so this module is hooked
            return x
        y = self.lin(x)
        return self(y, depth - 1) + 1 if depth > 0 else y


class _Holder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rec = _Recursive()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 1e9:
            return x
        return self.rec(x)


def test_reentered_hooked_module_keeps_each_calls_inputs(dynamo_fails: None) -> None:
    torch.manual_seed(0)
    model = _Holder()
    x = torch.randn(2, 4)
    tapped = fxprobe.tap(model, ops="rec", capture="both")
    assert [s.how for s in tapped.sites] == ["hook"]
    with torch.no_grad():
        out = tapped(x)
        inner_in = model.rec.lin(x)
        inner_out = model.rec.lin(inner_in)
    assert torch.equal(out, inner_out + 1)
    # The inner call returns first: it is "rec", the outer one "rec_1".
    assert torch.equal(tapped.taps["rec"].inputs[0], inner_in)
    assert torch.equal(tapped.taps["rec"].output, inner_out)
    assert torch.equal(tapped.taps["rec_1"].inputs[0], x)
    assert torch.equal(tapped.taps["rec_1"].output, out)


class _Functional(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight).tanh()


def test_gradient_hooks_on_a_parameter_site_live_one_forward_and_not_on_the_model() -> None:
    torch.manual_seed(0)
    model = _Functional()
    x = torch.randn(3, 4)
    (expected,) = torch.autograd.grad(F.linear(x, model.weight).tanh().sum(), [model.weight])
    doubled = fxprobe.tap(model, ops="weight", grad=True, grad_fn=lambda s, g: g * 2)
    for _ in range(3):
        out = doubled(x)
    out.sum().backward()
    torch.testing.assert_close(doubled.grads["weight"], expected)
    torch.testing.assert_close(model.weight.grad, 2 * expected)  # doubled once, not 2**3
    # The model's own backward, after tapping, is not touched by fxprobe's gradient hooks.
    (plain,) = torch.autograd.grad(model(x).sum(), [model.weight])
    torch.testing.assert_close(plain, expected)


def test_deferred_stats_of_small_values_are_those_of_the_values_as_produced() -> None:
    from test_inplace import _hand_computed

    model, (x,), _ = zoo.make("inplace")
    tapped = fxprobe.tap(model, reduce="stats")
    with torch.no_grad():
        tapped(x)
    expected = _hand_computed(model, x)
    for name, value in expected.items():
        got = tapped.taps[name]
        v = value.double()
        assert got.mean == pytest.approx(v.mean().item(), rel=1e-5, abs=1e-6), name
        assert got.max == pytest.approx(v.max().item(), rel=1e-6), name
        assert got.zero_frac == pytest.approx((v == 0).double().mean().item()), name


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x).relu() + x


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.block = _Block()

    def forward(self, a: torch.Tensor) -> torch.Tensor:
        return self.block(self.lin(a)) * 2


@pytest.mark.parametrize("tracer", ["fx", "dynamo", "hooks"])
def test_inputs_of_a_module_call_after_an_intervention_are_the_replacement(tracer: str) -> None:
    """capture="both" with fn= replacing ``lin``'s output: the inputs recorded for the module
    calls after it (``block``, ``block.fc``) are what they ran on, the replacement (fx and
    dynamo read them from metadata that the intervention had not rewritten), as hooks on a
    hand-patched model see them."""
    torch.manual_seed(0)
    model = _Net().eval()
    a = torch.randn(3, 4)
    seen: dict[str, torch.Tensor] = {}
    handles = [
        model.lin.register_forward_hook(lambda m, i, o: torch.zeros_like(o)),
        model.block.register_forward_pre_hook(lambda m, i: seen.update(block=i[0].clone())),
        model.block.fc.register_forward_pre_hook(lambda m, i: seen.update(fc=i[0].clone())),
    ]
    with torch.no_grad():
        expected = model(a)
    for h in handles:
        h.remove()
    tapped = fxprobe.tap(model, ops=["lin", "block", "block.fc"], capture="both", tracer=tracer,
                         fn=lambda s, v: torch.zeros_like(v) if s.name == "lin" else None)
    with torch.no_grad():
        assert torch.equal(tapped(a), expected)
    assert torch.equal(tapped.taps["block"].inputs[0], seen["block"])
    assert torch.equal(tapped.taps["block.fc"].inputs[0], seen["fc"])
    assert torch.equal(tapped.taps["lin"].output, torch.zeros(3, 4))


class _ReluInPlaceUnassigned(nn.Module):
    def __init__(self, module: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.act = nn.ReLU(inplace=True)
        self.module = module

    def forward(self, a: torch.Tensor) -> torch.Tensor:
        x = self.lin(a)
        if self.module:
            self.act(x)  # in place; the result not assigned: x is what is read after
        else:
            x.relu_()
        return x * 2


@pytest.mark.parametrize(("module", "tracer", "site"), [
    (False, "fx", "relu_"), (True, "fx", "act"), (True, "hooks", "act"), (True, "dynamo", "act")])
def test_fn_on_an_inplace_op_reaches_the_tensor_it_wrote(module: bool, tracer: str,
                                                          site: str) -> None:
    """``x.relu_()`` or ``self.act(x)`` (ReLU(inplace=True)) with its result not assigned: a
    replacement by fn= must reach the code after it, which reads ``x`` (it reached only the
    op's unused result, while taps.replaced said it was applied), as in a hand-patched
    model."""
    model = _ReluInPlaceUnassigned(module).eval()
    a = torch.randn(3, 4, generator=torch.Generator().manual_seed(7))
    tapped = fxprobe.tap(model, ops=site, tracer=tracer,
                         fn=lambda s, v: torch.full_like(v, 0.5))
    with torch.no_grad():
        out = tapped(a)
    assert torch.equal(out, torch.full((3, 4), 1.0))  # (0.5) * 2 everywhere
    assert site in tapped.taps.replaced
