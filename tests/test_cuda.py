"""The CUDA paths: offload in one transfer, statistics, gradients and out-of-place rewrites on
the device. Skipped where no CUDA device is present (CI); run on a lent GPU machine with
``python -m pytest tests/test_cuda.py``."""

from __future__ import annotations

import pytest
import torch
import zoo
from reference import hook_values

import fxprobe

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _resnet_cuda() -> tuple[torch.nn.Module, torch.Tensor]:
    model, (x,), _ = zoo.make("resnet")
    return model.cuda(), x.cuda()


def test_reference_capture_on_cuda_shows_values_as_produced() -> None:
    model, x = _resnet_cuda()
    tapped = fxprobe.tap(model, ops=["bn1", "layer1.0.bn1", "layer1.0.add", "fc"])
    with torch.no_grad():
        out = tapped(x)
        expected, ref = hook_values(model, ["bn1", "layer1.0.bn1", "fc"], x)
    assert torch.equal(out, expected)
    assert torch.equal(tapped.taps["bn1"], ref["bn1"])  # a hook clone: before the ReLU
    assert torch.equal(tapped.taps["layer1.0.bn1"], ref["layer1.0.bn1"])
    assert {"bn1", "layer1.0.bn1", "layer1.0.add"} <= tapped.outplaced


def test_offload_moves_a_forward_in_one_transfer_per_dtype() -> None:
    model, x = _resnet_cuda()
    names = ["conv1", "bn1", "layer1.0.add", "layer2.1.add", "fc"]
    tapped = fxprobe.tap(model, ops=names, to="cpu")
    with torch.no_grad():
        tapped(x)
        _, ref = hook_values(model, ["conv1", "bn1", "fc"], x)
    values = {n: tapped.taps[n] for n in names}
    assert all(v.device.type == "cpu" and v.is_pinned() for v in values.values())
    for n in ("conv1", "bn1", "fc"):
        assert torch.equal(values[n], ref[n].cpu()), n
    storages = {v.untyped_storage().data_ptr() for v in values.values()}
    assert len(storages) == 1  # one pinned buffer, one device-to-host copy


def test_stats_on_cuda_equal_stats_on_cpu_without_a_sync() -> None:
    from nosync import forbid_sync

    model, x = _resnet_cuda()
    tapped = fxprobe.tap(model, ops=torch.nn.Conv2d, reduce="stats")
    with torch.no_grad(), forbid_sync():
        tapped(x)
    cpu_model, (cpu_x,), _ = zoo.make("resnet")
    ref = fxprobe.tap(cpu_model, ops=torch.nn.Conv2d, reduce="stats")
    with torch.no_grad():
        ref(cpu_x)
    for name in ref.taps:
        a, b = tapped.taps[name], ref.taps[name]
        assert a.numel == b.numel and a.nan_count == b.nan_count
        for field in ("mean", "std", "min", "max", "absmax", "zero_frac"):
            assert getattr(a, field) == pytest.approx(getattr(b, field), rel=1e-4, abs=1e-5)


def test_grads_on_cuda_are_taken_at_the_value() -> None:
    model, x = _resnet_cuda()
    tapped = fxprobe.tap(model, ops="bn1", grad=True)
    tapped(x).square().sum().backward()
    bn1 = model.bn1(model.conv1(x))
    out = model.fc(torch.flatten(model.avgpool(model.layer2(model.layer1(
        model.maxpool(torch.relu(bn1))))), 1))
    (g,) = torch.autograd.grad(out.square().sum(), [bn1])
    torch.testing.assert_close(tapped.grads["bn1"], g, rtol=1e-4, atol=1e-5)


def test_disk_writes_cuda_values_as_keep_all_holds_them(tmp_path) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("safetensors")
    model, x = _resnet_cuda()
    names = ["bn1", "layer1.0.add", "fc"]
    memory = fxprobe.tap(model, ops=names, keep="all")
    with torch.no_grad(), fxprobe.tap(model, ops=names, to=fxprobe.Disk(tmp_path / "a")) as t:
        for i in range(3):
            t(x * (i + 1))
            memory(x * (i + 1))
    caps = fxprobe.open_captures(tmp_path / "a")
    assert len(caps) == 3
    for i, frame in enumerate(memory.history):
        for name in names:
            assert torch.equal(caps.forward(i)[name], frame[name].cpu()), (i, name)


@pytest.mark.parametrize("reduce", [None, "stats"])
def test_cuda_graphs_keep_every_forward_of_the_history(reduce: str | None) -> None:
    """torch.compile(mode="reduce-overhead"): each replay writes the graph's outputs into the
    same memory; the keep=3 history holds three different forwards, each equal to eager."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 16)).cuda().eval()
    tapped = fxprobe.tap(model, ops=torch.nn.Linear, keep=3, reduce=reduce)
    reference = fxprobe.tap(model, ops=torch.nn.Linear, keep=3, reduce=reduce)
    torch._dynamo.reset()
    compiled = torch.compile(tapped, mode="reduce-overhead")
    inputs = [torch.randn(8, 64, device="cuda") * (i + 1) for i in range(6)]
    with torch.no_grad():
        for inp in inputs:  # warm-up, recording, then replays
            torch.compiler.cudagraph_mark_step_begin()
            out = compiled(inp).clone()
            torch.testing.assert_close(out, model(inp), rtol=1e-4, atol=1e-5)
            reference(inp)
    assert len(tapped.history) == 3
    firsts = []
    for got, expected in zip(tapped.history, reference.history, strict=True):
        for name in ("0", "2"):
            if reduce is None:
                torch.testing.assert_close(got[name], expected[name], rtol=1e-4, atol=1e-5)
            else:
                assert got[name].mean == pytest.approx(expected[name].mean, rel=1e-4, abs=1e-6)
                assert got[name].std == pytest.approx(expected[name].std, rel=1e-4, abs=1e-6)
        firsts.append(got["0"].sum().item() if reduce is None else got["0"].mean)
    assert len(set(firsts)) == 3
    torch._dynamo.reset()
