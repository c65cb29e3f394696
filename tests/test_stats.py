"""Tests of fxprobe.capture.stats against numpy (float64) computed on the whole tensor.

``FXPROBE_TEST_DEVICE=cuda`` runs the statistics tests on a GPU (the Triton kernel where Triton
is installed, the torch fallback otherwise); the default is the CPU.
"""


from __future__ import annotations

import contextlib
import math
import os
from typing import Any

import numpy as np
import pytest
import torch
from nosync import SyncError, forbid_sync, record_ops

from fxprobe.capture.stats.batch import StatsBatch
from fxprobe.capture.stats.math import FIELDS, stats_vector, stats_vectors
from fxprobe.capture.stats.sampling import sample_vector
from fxprobe.core.errors import ConfigError

NAN, INF = float("nan"), float("inf")

DEVICE = torch.device(os.environ.get("FXPROBE_TEST_DEVICE", "cpu"))


def reference(t: torch.Tensor) -> list[float]:
    """The eight statistics, by numpy in float64, following the documented rules."""
    a = t.detach().to(torch.float64).reshape(-1).numpy()
    finite = a[np.isfinite(a)]
    nan_count = float(np.isnan(a).sum())
    inf_count = float(np.isinf(a).sum())
    zero_frac = float((a == 0).sum() / a.size) if a.size else NAN
    if finite.size == 0:
        return [NAN] * 5 + [zero_frac, nan_count, inf_count]
    std = float(finite.std(ddof=1)) if finite.size > 1 else NAN
    return [float(finite.mean()), std, float(finite.min()), float(finite.max()),
            float(np.abs(finite).max()), zero_frac, nan_count, inf_count]


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


CASES = {
    "float32": torch.randn(4, 5, 6, generator=_gen()) * 3 + 1,
    "float64": torch.randn(7, 9, generator=_gen(1), dtype=torch.float64),
    "float16": (torch.randn(50, generator=_gen(2)) * 10).half(),
    "bfloat16": (torch.randn(50, generator=_gen(3)) * 10).bfloat16(),
    "relu_zeros": torch.relu(torch.randn(100, generator=_gen(4))),
    "nan_and_inf": torch.tensor([1.0, NAN, -2.0, INF, 0.0, -INF, 3.5, NAN, 0.0]),
    "all_nan": torch.full((3, 2), NAN),
    "all_inf": torch.tensor([INF, -INF]),
    "one_finite_among_nan": torch.tensor([NAN, 4.0, INF]),
    "one_element": torch.tensor([2.5]),
    "scalar": torch.tensor(-7.0),
    "empty": torch.empty(0, 3),
    "int64": torch.randint(-50, 50, (8, 8), generator=_gen(5)),
    "int32": torch.randint(0, 3, (40,), generator=_gen(6), dtype=torch.int32),
    "uint8": torch.randint(0, 255, (30,), generator=_gen(7), dtype=torch.uint8),
    "bool": torch.rand(33, generator=_gen(8)) > 0.3,
    "non_contiguous": torch.randn(6, 5, generator=_gen(9)).t()[::2],
    "large_offset": torch.randn(1000, generator=_gen(10), dtype=torch.float64) + 1e6,
    "large_offset_float32": torch.randn(5000, generator=_gen(11)) * 0.01 + 1000.0,
    "inf_mix": torch.tensor([INF, -INF, INF, 5.0, -1.0, 0.0, -INF]),
    "inf_and_nan_only": torch.tensor([INF, NAN, -INF, NAN]),
    "positive_with_nan": torch.tensor([NAN, 3.0, 7.0, INF, 5.0]),  # min is not the fill
    "negative_with_inf": torch.tensor([-3.0, INF, -7.0, -INF, -5.0]),
    "huge_float32": torch.tensor([1e30, -2e30, 3e30, 0.0, 5e29]),
    "huge_float64": torch.tensor([1e150, -2e150, 3e150], dtype=torch.float64),
    "tiny_float32": torch.tensor([1e-40, -3e-41, 2e-38, 0.0]),  # subnormals
    "constant": torch.full((1000,), 3.25),
    "float16_inf": torch.tensor([60000.0, -60000.0, 1.0, INF], dtype=torch.float16),
    "int_bool_one_element": torch.tensor([True]),
    "big_float32_nan_inf": torch.cat([torch.randn(300_000, generator=_gen(12)) * 2 + 0.5,
                                      torch.tensor([NAN, INF, 0.0, -INF] * 3)]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_stats_vector_matches_numpy_without_sync(name: str) -> None:
    t = CASES[name].to(DEVICE)
    with forbid_sync():
        v = stats_vector(t)
    want_dtype = torch.float64 if t.dtype == torch.float64 else torch.float32
    assert v.dtype == want_dtype and v.shape == (len(FIELDS),) and v.device == t.device
    _assert_close(v, CASES[name])


@pytest.mark.parametrize("name", [*CASES, "relu_2mib", "offset_2mib"])
def test_cpu_stats_vector_with_host_reads_matches_numpy(name: str) -> None:
    # On a CPU, outside forbid_sync(), stats_vector may branch on values (its fast path for
    # all-finite tensors, with the general path as the fallback): the same numbers.
    t = CASES.get(name)
    if t is None:
        base = torch.randn(512 * 1024, generator=_gen(14))
        t = base.relu() if name == "relu_2mib" else base * 0.5 + 300.0  # two-pass variance
    v = stats_vector(t)
    want_dtype = torch.float64 if t.dtype == torch.float64 else torch.float32
    assert v.dtype == want_dtype and v.shape == (len(FIELDS),)
    _assert_close(v, t)


def test_cpu_fast_path_is_taken_only_where_host_reads_are_free() -> None:
    from fxprobe.capture.stats import cpu as _stats_cpu

    assert _stats_cpu.WIDTH == len(FIELDS)
    t = torch.randn(10_000, generator=_gen(15)).relu()
    with record_ops() as ops:
        fast = stats_vector(t)
    assert {"tolist", "numpy"} & set(ops)  # values read on the host: the CPU path
    with forbid_sync() as ops:  # emulating a GPU: the device path, no reads
        slow = stats_vector(t)
    assert not {"tolist", "numpy"} & set(ops)
    torch.testing.assert_close(fast, slow, rtol=2e-6, atol=0)
    zeros = int((t == 0).sum())
    assert fast[5] == torch.tensor(zeros / t.numel())  # the exact count, as float32


LARGE = {  # above the sizes batched and computed in float64 (2**16): the large-tensor paths
    "float64": torch.randn(300_001, generator=_gen(16), dtype=torch.float64) * 3 - 1,
    "float64_offset": torch.randn(100_003, generator=_gen(17), dtype=torch.float64) + 1e4,
    # Small enough that n - 1 against n (7e-6 relative) shows in float32.
    "float32": torch.randn(70_001, generator=_gen(18)) * 2 + 0.5,
}


@pytest.mark.parametrize("path", ["device", "torch", "numba"])
@pytest.mark.parametrize("name", list(LARGE))
def test_std_of_large_tensors_on_every_cpu_path(name: str, path: str,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """std with Bessel's correction (numpy's ``ddof=1``) for large tensors, to the precision
    of their dtype, by each path a CPU takes for them: the tensor ops a GPU runs too, torch
    with host reads (numba off or busy), the numba kernel. One at a time and in a batch."""
    from fxprobe.capture.stats import numba as _stats_numba

    t = LARGE[name]
    ran = []
    if path == "numba":
        pytest.importorskip("numba", reason="numba is not installed: the kernel cannot run")
        monkeypatch.setattr(_stats_numba, "ENABLED", True)
        summary = _stats_numba.summary

        def spy(a: np.ndarray) -> Any:
            found = summary(a)
            ran.append(found is not None)
            return found

        monkeypatch.setattr(_stats_numba, "summary", spy)
    else:
        monkeypatch.setattr(_stats_numba, "ENABLED", False)
    with forbid_sync() if path == "device" else contextlib.nullcontext():
        one = stats_vector(t)
        batch = stats_vectors([t, t.flip(0)])
    assert ran == ([True] * 3 if path == "numba" else [])
    want = t.double().numpy().std(ddof=1)
    rtol = 1e-12 if t.dtype == torch.float64 else 1e-6
    np.testing.assert_allclose(float(one[1]), want, rtol=rtol)
    np.testing.assert_allclose(float(batch[0, 1]), want, rtol=rtol)
    np.testing.assert_allclose(float(batch[1, 1]), want, rtol=rtol)
    _assert_close(one, t)
    _assert_close(batch[0], t)


def _assert_close(v: torch.Tensor, t: torch.Tensor) -> None:
    rtol = 1e-10 if v.dtype == torch.float64 else 2e-5
    got, want = v.double().cpu().numpy(), np.array(reference(t))
    # A relative tolerance for huge values, an absolute one (scaled) for tiny ones.
    atol = 1e-6 * min(1.0, float(np.nanmax(np.abs(want[:5]), initial=1.0)))
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol, equal_nan=True)


@pytest.mark.parametrize("host_reads", [False, True], ids=["device path", "cpu host reads"])
def test_stats_vectors_rows_match_numpy_without_sync(host_reads: bool) -> None:
    names = list(CASES)
    tensors = [CASES[n].to(DEVICE) for n in names]
    tensors.append(torch.randn(70_000, generator=_gen(13)).to(DEVICE))  # above the batch size
    names.append("randn_70000")
    # Same-size groups mixing finite rows with NaN/Inf ones (numpy rows and the fallback).
    for i in range(3):
        odd = [NAN, 0.0] if i == 1 else [INF, 3.0] if i == 2 else [0.0, 3.0]
        tensors.append(torch.tensor([1.0 + i, odd[0], -2.0, odd[1]]))
        names.append(f"group_{i}")
    with contextlib.nullcontext() if host_reads else forbid_sync():
        rows = stats_vectors(tensors)
    assert rows.shape == (len(tensors), len(FIELDS)) and rows.device == tensors[0].device
    assert rows.dtype == torch.float64  # one float64 input widens all rows
    for name, t, row in zip(names, tensors, rows, strict=True):
        want_dtype = torch.float64 if t.dtype == torch.float64 else torch.float32
        # Each row is the tensor's own vector, widened: same numbers as one at a time.
        _assert_close(row.to(want_dtype), t.cpu())
        assert torch.equal(row.to(want_dtype).isnan(), stats_vector(t).isnan()), name


def test_stats_vectors_same_size_batch_and_edges() -> None:
    ts = [torch.randn(16, generator=_gen(i)).to(DEVICE) for i in range(50)]
    ts[7] = torch.full((16,), NAN, device=DEVICE)
    rows = stats_vectors(ts)
    assert rows.dtype == torch.float32 and rows.shape == (50, 8)
    for t, row in zip(ts, rows, strict=True):
        _assert_close(row, t.cpu())
    empty = stats_vectors([])
    assert empty.shape == (0, 8)
    with pytest.raises(ConfigError, match="complex"):
        stats_vectors([torch.ones(2), torch.ones(2, dtype=torch.complex64)])


def test_stats_vectors_refuses_several_devices() -> None:
    meta = torch.empty(3, device="meta")
    with pytest.raises(ValueError, match="one device"):
        stats_vectors([torch.ones(3), meta])


def test_stats_vector_compiles_without_graph_breaks() -> None:
    torch._dynamo.reset()
    t = CASES["nan_and_inf"].to(DEVICE)
    explained = torch._dynamo.explain(stats_vector)(t)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0)
    compiled = torch.compile(stats_vector, backend="eager", fullgraph=True)
    _assert_close(compiled(t), CASES["nan_and_inf"])
    torch._dynamo.reset()


def _triton_ready() -> bool:
    from fxprobe.capture.stats import triton as _stats_triton

    return torch.cuda.is_available() and _stats_triton.available()


@pytest.mark.skipif(not _triton_ready(), reason="needs CUDA and Triton")
@pytest.mark.parametrize("name", list(CASES))
def test_triton_kernel_matches_numpy_and_the_torch_fallback(name: str) -> None:
    from fxprobe.capture.stats import triton as _stats_triton
    from fxprobe.capture.stats.math import _stats_of

    t = CASES[name]
    if t.numel() == 0:
        pytest.skip("stats_vector answers empty tensors without a kernel")
    x = t.cuda()
    dtype = torch.float64 if t.dtype == torch.float64 else torch.float32
    with forbid_sync():
        fused = _stats_triton.stats_vector(x, dtype)
        fallback = _stats_of(x.to(dtype), None)
    _assert_close(fused, t)
    _assert_close(fallback, t)


@pytest.mark.skipif(not _triton_ready(), reason="needs CUDA and Triton")
def test_triton_kernel_on_many_programs() -> None:
    from fxprobe.capture.stats import triton as _stats_triton

    t = torch.randn(3_000_001, generator=_gen(14)) * 3 + 1
    t[::1000] = 0.0
    t[17] = NAN
    t[12345] = -INF
    _assert_close(_stats_triton.stats_vector(t.cuda(), torch.float32), t)


def test_stats_vector_is_detached_and_rejects_complex() -> None:
    x = torch.randn(5, requires_grad=True)
    assert not stats_vector(x * 2).requires_grad
    with pytest.raises(ConfigError, match="complex.*t.abs"):  # an fxprobe error, with a fix
        stats_vector(torch.randn(3, dtype=torch.complex64))
    with pytest.raises(ConfigError, match="needs a torch.Tensor, got list.*as_tensor"):
        stats_vector([1.0, 2.0])  # type: ignore[arg-type]


def test_nan_and_inf_rules_spelled_out() -> None:
    v = stats_vector(torch.tensor([1.0, NAN, 3.0, INF, -INF])).tolist()
    mean, std, lo, hi, absmax, zero_frac, nan_count, inf_count = v
    assert (mean, lo, hi, absmax) == (2.0, 1.0, 3.0, 3.0)  # finite values only
    assert std == pytest.approx(math.sqrt(2.0))
    assert (zero_frac, nan_count, inf_count) == (0.0, 1.0, 2.0)


@pytest.mark.parametrize("op", [
    lambda t: t.sum().item(),
    lambda t: bool(t.sum()),
    lambda t: float(t[0]),
    lambda t: int(t[0]),
    lambda t: t.tolist(),
    lambda t: t.cpu(),
    lambda t: t.to("cpu"),
    lambda t: t.numpy(),
    lambda t: t[t > 0],
    lambda t: t.nonzero(),
    lambda t: repr(t),
], ids=["item", "bool", "float", "int", "tolist", "cpu", "to_cpu", "numpy", "mask", "nonzero",
        "repr"])
def test_forbid_sync_catches_host_reads(op: object) -> None:
    t = torch.randn(4)
    with pytest.raises(SyncError), forbid_sync():
        op(t)  # type: ignore[operator]


@pytest.mark.parametrize("seeding", [_gen, int], ids=["generator", "int seed"])
def test_sample_vector_reproducible_without_sync(seeding: Any) -> None:
    t = torch.arange(10_000, dtype=torch.float32).reshape(100, 100)
    with forbid_sync():
        a = sample_vector(t, 64, seeding(3))
        b = sample_vector(t, 64, seeding(3))
        c = sample_vector(t, 64, seeding(4))
    assert a.shape == (64,) and a.dtype == t.dtype
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert set(a.tolist()) <= set(t.reshape(-1).tolist())
    assert len(set(a.tolist())) > 50  # spread over the tensor, not one block


def test_hashed_positions_are_uniform() -> None:
    from fxprobe.capture.stats.sampling import hashed_positions

    counts = torch.bincount(hashed_positions(100, 100_000, 7, torch.device("cpu")), minlength=100)
    # 1000 expected per bin; a binomial's std is ~31, so 6 sigma is far from these bounds.
    assert counts.min() > 800 and counts.max() < 1200


def test_sample_vector_small_tensor_keeps_all_as_a_copy() -> None:
    t = torch.tensor([[1, 2], [3, 4]])
    s = sample_vector(t, 4)
    assert torch.equal(s, torch.tensor([1, 2, 3, 4]))
    t.zero_()
    assert s.tolist() == [1, 2, 3, 4]
    with pytest.raises(ConfigError, match="positive int"):
        sample_vector(t, 0)


def _values() -> dict[str, torch.Tensor]:
    return {"a": CASES["float32"], "b": CASES["nan_and_inf"], "c": CASES["int64"],
            "d": CASES["empty"], "e": CASES["float64"]}


def test_stats_batch_one_transfer_and_cached() -> None:
    values = _values()
    with forbid_sync():
        batch = StatsBatch.from_tensors(values)
    assert batch.stacked.shape == (5, 8)
    assert batch.stacked.dtype == torch.float64  # one float64 site widens the stack
    assert list(batch) == list(values) and len(batch) == 5 and "a" in batch
    with record_ops() as ops:
        first = batch["b"]
        everything = batch.fetch()
        again = batch["e"]
    assert ops.count("cpu") == 1  # reading one site fetched all; later reads are cached
    assert everything is batch.fetch() and again is everything["e"]
    assert first == everything["b"]
    for name, t in values.items():
        s = everything[name]
        assert s.shape == tuple(t.shape) and s.dtype == str(t.dtype) and s.numel == t.numel()
        got = [getattr(s, f) for f in FIELDS]
        np.testing.assert_allclose(got, reference(t), rtol=2e-5, atol=1e-6, equal_nan=True)
    assert isinstance(everything["b"].nan_count, int) and everything["b"].inf_count == 2
    with pytest.raises(KeyError):
        batch["zz"]


def test_compiled_statistics_of_nothing_finite_have_nan_std() -> None:
    """torch.compile (inductor) of the tensor-op path, small (float64, unscaled) and large
    (scaled) tensors with no finite element: std is NaN, as in eager (inductor folded the
    ``+ mean * 0`` that carried the NaN, and gave -0.0)."""
    torch._dynamo.reset()
    compiled = torch.compile(stats_vector)
    for t in (torch.full((5,), float("nan")), torch.full((1 << 17,), float("inf"))):
        got = compiled(t)
        assert torch.isnan(got[:5]).all(), got
        assert got[6:].tolist() == ([5.0, 0.0] if t.numel() == 5 else [0.0, float(1 << 17)])
    torch._dynamo.reset()


def test_compiled_stats_equal_numpy_and_eager_for_every_case() -> None:
    """Under torch.compile (inductor), float32 and narrower tensors take the fused one-pass
    formulation (capture.stats.fused), float64 the scaled device path: every case (NaN, Inf,
    empty, integers, bool, half types, huge, subnormal, a constant) against numpy in float64
    and against eager, in one compiled function (one compile for all)."""
    names = list(CASES)
    tensors = [CASES[n].to(DEVICE) for n in names]
    torch._dynamo.reset()
    compiled = torch.compile(lambda ts: [stats_vector(t) for t in ts], fullgraph=True)
    got = compiled(tensors)
    for name, t, v in zip(names, tensors, got, strict=True):
        assert v.dtype == (torch.float64 if t.dtype == torch.float64 else torch.float32), name
        _assert_close(v, CASES[name])
        eager = stats_vector(t)
        np.testing.assert_allclose(v.double().cpu().numpy(), eager.double().cpu().numpy(),
                                   rtol=2e-5, atol=1e-6, equal_nan=True, err_msg=name)
    torch._dynamo.reset()


def test_fused_stats_vector_is_what_compiled_statistics_run() -> None:
    """The fused formulation itself, in eager (the same ops inductor compiles): equal to numpy
    on the cases it takes, and a mean 1e4 standard deviations from zero keeps its std (the
    shifted sums lose nothing to cancellation)."""
    from fxprobe.capture.stats.fused import fused_stats_vector

    for t in CASES.values():
        if t.numel() and t.dtype != torch.float64:
            _assert_close(fused_stats_vector(t.to(DEVICE)), t)
    far = torch.randn(100_000, generator=_gen(20)) * 1e-2 + 100.0
    got = fused_stats_vector(far.to(DEVICE)).double().cpu().numpy()
    assert abs(got[1] / far.double().std().item() - 1) < 1e-6

