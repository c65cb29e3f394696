"""Capture modes: history, offload, interventions, gradients, custom reductions, bad combos."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import zoo
from nosync import forbid_sync
from reference import same
from torch import nn

import fxprobe


def test_keep_n_is_a_ring_of_the_last_forwards() -> None:
    model, (x,), _ = zoo.make("shared")
    tapped = fxprobe.tap(model, ops="out", keep=2)
    with torch.no_grad():
        for scale in (1.0, 2.0, 3.0):
            tapped(x * scale)
        expected = [model(x * 2.0), model(x * 3.0)]
    assert len(tapped.history) == 2
    for frame, value in zip(tapped.history, expected, strict=True):
        assert torch.equal(frame["out"], value)
    assert torch.equal(tapped.taps["out"], expected[-1])
    every = fxprobe.tap(model, ops="out", keep="all")
    with torch.no_grad():
        for _ in range(5):
            every(x)
    assert len(every.history) == 5


def test_offload_to_cpu_keeps_values() -> None:
    model, (x,), _ = zoo.make("resnet")
    tapped = fxprobe.tap(model, ops=[nn.Conv2d, torch.flatten], to="cpu")
    with torch.no_grad():
        tapped(x)
        flat = torch.flatten(model.avgpool(model.layer2(model.layer1(
            model.maxpool(model.relu(model.bn1(model.conv1(x))))))), 1)
    assert tapped.taps["flatten"].device.type == "cpu"
    assert torch.equal(tapped.taps["flatten"], flat)


class _Hand(nn.Module):
    """A hand-edited copy of zoo.ResNetish whose first residual add is multiplied by 0.5."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.m = copy.deepcopy(model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = self.m
        x = m.maxpool(m.relu(m.bn1(m.conv1(x))))
        b = m.layer1[0]
        out = b.bn2(b.conv2(b.relu(b.bn1(b.conv1(x)))))
        out = (out + x) * 0.5
        x = F.relu(out)
        x = m.layer2(m.layer1[1](x))
        return m.fc(torch.flatten(m.avgpool(x), 1))


def test_fn_replaces_a_functional_value_downstream() -> None:
    model, (x,), _ = zoo.make("resnet")
    calls = []

    def halve(site: fxprobe.Site, value: torch.Tensor) -> torch.Tensor | None:
        calls.append(site.name)
        return value * 0.5 if site.name == "layer1.0.add" else None

    tapped = fxprobe.tap(model, ops=["layer1.0.add", "fc"], fn=halve)
    with torch.no_grad():
        got = tapped(x)
        expected = _Hand(model)(x)
        untouched = model(x)
    assert calls == ["layer1.0.add", "fc"]
    assert torch.equal(got, expected) and not torch.equal(got, untouched)
    assert tapped.taps.replaced == {"layer1.0.add"}


def test_fn_on_hook_sites(dynamo_fails: None) -> None:
    model, (x,), _ = zoo.make("data_dependent")
    bad = fxprobe.tap(model, ops=["gate.pos", "gate.neg.1"], fn=lambda s, v: True)
    with pytest.raises(fxprobe.InterventionError, match="returned bool"):
        bad(x)
    zeroing = fxprobe.tap(model, ops=["gate.pos", "gate.neg.1"],
                          fn=lambda s, v: torch.zeros_like(v))
    with torch.no_grad():
        got = zeroing(x)
        expected = torch.relu(model.head(torch.zeros(3, 8)))
    assert torch.equal(got, expected)
    how = {s.name: s.how for s in zeroing.sites}
    (name,) = zeroing.taps.replaced  # one branch ran: its site was replaced
    assert name in ("gate.pos", "gate.neg.1") and how[name] == ("hook" if name == "gate.pos"
                                                               else "fx")


def test_fn_returning_the_wrong_shape_names_the_site() -> None:
    model, (x,), _ = zoo.make("encoder")
    tapped = fxprobe.tap(model, ops="gelu", fn=lambda s, v: v[:, :1])
    with pytest.raises(fxprobe.InterventionError) as err:
        tapped(x)
    assert "'gelu'" in str(err.value) and "shape" in str(err.value)


def test_grads_match_autograd_on_the_same_intermediate_values() -> None:
    model, (x,), _ = zoo.make("encoder")
    tapped = fxprobe.tap(model, ops=["fc1", "gelu", "attn.softmax"], grad=True)
    out = tapped(x)
    out.pow(2).sum().backward()
    live = fxprobe.tap(model, ops=["fc1", "gelu", "attn.softmax"], detach=False)
    values = live(x)
    refs = torch.autograd.grad(values.pow(2).sum(), [live.taps[n] for n in
                                                     ("fc1", "gelu", "attn.softmax")])
    for name, ref in zip(("fc1", "gelu", "attn.softmax"), refs, strict=True):
        assert torch.allclose(tapped.grads[name], ref), name
        assert tapped.taps[name].grad_fn is None  # captures stay detached


def test_grad_fn_clips_one_layers_gradient() -> None:
    model, (x,), _ = zoo.make("encoder")
    clip = fxprobe.tap(model, ops="gelu", grad_fn=lambda s, g: g.clamp(-1e-3, 1e-3))
    clip(x).pow(2).sum().backward()
    clipped = model.fc1.weight.grad.clone()
    model.zero_grad()
    ref = copy.deepcopy(model)

    class Clip(torch.autograd.Function):
        @staticmethod
        def forward(ctx: object, t: torch.Tensor) -> torch.Tensor:
            return t.view_as(t)

        @staticmethod
        def backward(ctx: object, g: torch.Tensor) -> torch.Tensor:
            return g.clamp(-1e-3, 1e-3)

    h = x + ref.attn(ref.norm1(x))
    out = h + ref.fc2(Clip.apply(F.gelu(ref.fc1(ref.norm2(h)))))
    out.pow(2).sum().backward()
    assert torch.allclose(clipped, ref.fc1.weight.grad)
    assert model.fc1.weight.grad is None or not model.fc1.weight.grad.any()


def test_hook_site_grads() -> None:
    model, (x,), _ = zoo.make("untraceable_top")
    tapped = fxprobe.tap(model, ops="norm", grad=True)
    tapped(x).sum().backward()
    assert torch.allclose(tapped.grads["norm"], torch.ones(4, 8))


def test_custom_reducer_runs_where_the_value_is_produced() -> None:
    model, (x,), _ = zoo.make("inplace")
    tapped = fxprobe.tap(model, ops=["bn", "relu_"], reduce=lambda t: t.amin())
    with torch.no_grad():
        tapped(x)
        bn = model.bn(model.lin(x))
    assert torch.equal(tapped.taps["bn"], bn.amin())  # before the in-place ReLU
    assert tapped.taps["bn"] < 0
    assert tapped.copied == tapped.outplaced == frozenset()  # a reduction needs no copy


@pytest.mark.parametrize("kwargs,match", [
    ({"reduce": "stats", "detach": False}, "detach=False"),
    ({"reduce": "mean"}, "reduce="),
    ({"to": "tpu9"}, "to='tpu9'"),
    ({"keep": 0}, "keep=0"),
    ({"keep": "some"}, "keep='some'"),
    ({"grad": True, "capture": "input"}, "capture='output'"),
    ({"fn": 3}, "fn=3"),
    ({"leaf_modules": [3]}, "leaf_modules"),
])
def test_bad_combinations(kwargs: dict[str, object], match: str) -> None:
    model, _, _ = zoo.make("shared")
    with pytest.raises(fxprobe.ConfigError, match=match):
        fxprobe.tap(model, **kwargs)  # type: ignore[arg-type]


def test_modes_leave_the_output_unchanged() -> None:
    model, (x,), _ = zoo.make("lstm")
    with torch.no_grad():
        expected = model(x)
        for kwargs in ({"keep": 3}, {"to": "cpu"}, {"fn": lambda s, v: None},
                       {"reduce": lambda t: t.float().mean()}):
            assert same(fxprobe.tap(model, **kwargs)(x), expected), kwargs


def _numpy_stats(t: torch.Tensor) -> dict[str, float]:
    a = t.detach().double().numpy().ravel()
    return {"mean": a.mean(), "std": a.std(ddof=1), "min": a.min(), "max": a.max(),
            "absmax": np.abs(a).max(), "zero_frac": float((a == 0).mean())}


@pytest.mark.parametrize("name", ["resnet", "encoder", "inplace"])
def test_stats_match_numpy_on_the_captured_tensors(name: str) -> None:
    model, args, kwargs = zoo.make(name)
    full = fxprobe.tap(model)
    stats = fxprobe.tap(model, reduce="stats")
    with torch.no_grad():
        expected = full(*args, **kwargs)
        assert same(stats(*args, **kwargs), expected)
    assert set(stats.taps) == set(full.taps)
    for site, value in full.taps.items():
        if not isinstance(value, torch.Tensor) or not value.is_floating_point():
            continue
        s = stats.taps[site]
        assert isinstance(s, fxprobe.Stats) and s.shape == tuple(value.shape), site
        for key, ref in _numpy_stats(value).items():
            assert getattr(s, key) == pytest.approx(ref, rel=1e-4, abs=1e-5), (site, key)
        assert s.nan_count == 0 and s.inf_count == 0


def test_stats_forward_does_not_synchronise() -> None:
    model, (x,), _ = zoo.make("resnet")
    tapped = fxprobe.tap(model, ops=[nn.Conv2d, nn.BatchNorm2d, "layer1.*.add"],
                         reduce="stats")
    with torch.no_grad():
        tapped(x)  # the first forward builds nothing more, but warm up anyway
        with forbid_sync():
            tapped(x)
    assert tapped.taps["conv1"].numel == x.shape[0] * 8 * 16 * 16


def test_stats_history_and_table() -> None:
    model, (x,), _ = zoo.make("shared")
    tapped = fxprobe.tap(model, reduce="stats", keep=2)
    with torch.no_grad():
        tapped(x)
        tapped(x * 0)
    assert tapped.history[1]["x"].absmax == 0 and tapped.history[0]["x"].absmax > 0
    table = fxprobe.stats_table(tapped.taps)
    assert "fc_1" in table and "absmax" in table


class _Scale(nn.Module):
    """Its one site (``mul``) returns the input itself, so a sampled value names its position."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 1.0


def _positions(n: int = 10_000, shape: tuple[int, ...] = (100, 100)) -> torch.Tensor:
    return torch.arange(n, dtype=torch.float64).reshape(shape)


def test_default_sample_is_with_replacement_at_the_same_positions() -> None:
    x = _positions()
    tapped = fxprobe.tap(_Scale(), ops="mul", reduce="sample", sample_size=400, seed=3)
    with torch.no_grad():
        tapped(x)
        first = tapped.taps["mul"].clone()
        tapped(x)
    assert torch.equal(first, tapped.taps["mul"])  # fixed positions
    assert first.unique().numel() < 400  # with replacement (birthday collisions: ~392)
    assert torch.equal(first, x.reshape(-1)[first.long()])


def test_sample_without_replacement_gives_distinct_fresh_positions() -> None:
    x = _positions()
    tapped = fxprobe.tap(_Scale(), ops="mul", reduce=fxprobe.Sample(400, seed=3))
    draws = []
    with torch.no_grad():
        for _ in range(3):
            tapped(x)
            draws.append(tapped.taps["mul"].clone())
    for d in draws:
        assert d.shape == (400,) and d.unique().numel() == 400
        assert torch.equal(d, x.reshape(-1)[d.long()])  # the tensor's own elements
    assert not torch.equal(draws[0], draws[1]) and not torch.equal(draws[1], draws[2])
    overlap = np.intersect1d(draws[0].numpy(), draws[1].numpy()).size
    assert overlap < 60  # independent draws share ~16 of 10,000 positions, not all of them
    # Reproducible: the same seed draws the same sequence in another tapped module.
    again = fxprobe.tap(_Scale(), ops="mul", reduce=fxprobe.Sample(400, seed=3))
    with torch.no_grad():
        again(x)
    assert torch.equal(again.taps["mul"], draws[0])


def test_sample_fixed_without_replacement_and_fresh_with_replacement() -> None:
    x = _positions()
    fixed = fxprobe.Sample(400, replace=False, fresh=False, seed=1)
    a, b = fixed(x), fixed(x)
    assert torch.equal(a, b) and a.unique().numel() == 400
    fresh = fxprobe.Sample(400, replace=True, fresh=True, seed=1)
    c, d = fresh(x), fresh(x)
    assert not torch.equal(c, d)
    assert c.unique().numel() < 400 or d.unique().numel() < 400


def test_fresh_positions_are_uniform() -> None:
    x = torch.arange(100, dtype=torch.float64)
    sample = fxprobe.Sample(10, seed=0)
    counts = np.bincount(torch.cat([sample(x) for _ in range(2000)]).long().numpy(),
                         minlength=100)
    assert counts.sum() == 20_000 and counts.min() > 140 and counts.max() < 260  # mean 200


def test_sample_along_a_dim_keeps_whole_columns() -> None:
    x = _positions(6 * 50, (6, 50))
    tapped = fxprobe.tap(_Scale(), ops="mul", reduce=fxprobe.Sample(8, dim=-1, seed=2))
    with torch.no_grad():
        tapped(x)
        first = tapped.taps["mul"].clone()
        tapped(x)
    assert first.shape == (6, 8)
    cols = (first[0] % 50).long()
    assert cols.unique().numel() == 8  # distinct columns
    assert torch.equal(first, x[:, cols])  # each one whole
    assert not torch.equal(first, tapped.taps["mul"])  # new columns next forward
    small = fxprobe.Sample(80, dim=1)(x)
    assert torch.equal(small, x)  # fewer columns than k: all of them, in order


@pytest.mark.parametrize("kwargs, match", [
    ({"k": 0}, "k must be a positive int"),
    ({"k": 4, "replace": 1}, "replace=1"),
    ({"k": 4, "dim": "cols"}, "dim='cols'"),
    ({"k": 4, "fresh": False, "seed": None}, "fixed positions need an int seed"),
])
def test_bad_sample_is_refused(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(fxprobe.ConfigError, match=match):
        fxprobe.Sample(**kwargs)  # type: ignore[arg-type]
    with pytest.raises(fxprobe.ConfigError, match="dim=2 is out of range"):
        fxprobe.Sample(4, dim=2)(torch.ones(3, 3))


class _GradBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.bn(self.conv(x)) + x)  # x read twice: conv's share is not x's


def _grad_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), _GradBlock(), _GradBlock(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 5)).eval()


@pytest.mark.parametrize("tracer", ["fx", "hooks", "auto"])
def test_grad_with_capture_both_equals_full_backward_hooks(tracer: str) -> None:
    model = _grad_model()
    x = torch.randn(2, 3, 8, 8)
    names = ["1", "1.conv", "2.bn", "5"]
    want: dict[str, tuple[tuple[torch.Tensor | None, ...], torch.Tensor]] = {}
    handles = [model.get_submodule(n).register_full_backward_hook(
        lambda m, gi, go, n=n: want.__setitem__(
            n, (tuple(None if g is None else g.clone() for g in gi), go[0].clone())))
        for n in names]
    try:
        model(x).logsumexp(1).sum().backward()
    finally:
        for h in handles:
            h.remove()
    param_grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad()
    ops = names if tracer == "hooks" else [*names, "1.add"]
    tapped = fxprobe.tap(model, ops=ops, capture="both", grad=True, tracer=tracer)
    out = tapped(x)
    with torch.no_grad():
        assert torch.equal(out, model(x))
    out.logsumexp(1).sum().backward()
    for n in names:
        g = tapped.grads[n]
        assert isinstance(g, fxprobe.InOut), n
        inputs, output = want[n]
        torch.testing.assert_close(g.output, output)
        assert len(g.inputs) == len(inputs)
        for got, ref in zip(g.inputs, inputs, strict=True):
            torch.testing.assert_close(got, ref)
    # The block's grad_input is conv's share plus the residual's, not either alone.
    assert not torch.allclose(tapped.grads["1"].inputs[0], tapped.grads["1.conv"].inputs[0])
    if tracer != "hooks":  # an op: both inputs of x + y get grad_output (hand-computed)
        add = tapped.grads["1.add"]
        assert len(add.inputs) == 2
        for g in add.inputs:
            torch.testing.assert_close(g, add.output)
    for k, p in model.named_parameters():  # the backward itself is unchanged
        torch.testing.assert_close(p.grad, param_grads[k])
    model.zero_grad()
    tapped.remove()


def test_grad_with_capture_input_is_still_refused() -> None:
    with pytest.raises(fxprobe.ConfigError, match="capture='output' or 'both'"):
        fxprobe.tap(_grad_model(), ops="1", capture="input", grad=True)
