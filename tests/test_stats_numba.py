"""The numba kernel of the CPU statistics (capture.stats.numba) against numpy in float64, and
its fallbacks: NaN/Inf, numba missing or failing, switched off."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from fxprobe.capture.stats import cpu as _stats_cpu
from fxprobe.capture.stats import numba as _stats_numba
from fxprobe.capture.stats.math import stats_vector

NAN, INF = float("nan"), float("inf")
N = _stats_cpu.NUMPY_MAX + 1  # the smallest size that takes the kernel
CHUNK = _stats_numba.CHUNK


def reference(t: torch.Tensor) -> np.ndarray:
    """The eight statistics of an all-finite tensor, by numpy in float64."""
    a = t.detach().to(torch.float64).reshape(-1).numpy()
    return np.array([a.mean(), a.std(ddof=1), a.min(), a.max(), np.abs(a).max(),
                     (a == 0).sum() / a.size, 0.0, 0.0])


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(n: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(n, generator=_gen(seed), dtype=dtype)


CASES = {
    "randn": lambda: _randn(1 << 20, 0) * 2 + 0.5,
    "large_mean": lambda: _randn(1 << 20, 1) * 0.01 + 1e4,
    "large_mean_float64": lambda: _randn(300_001, 2, torch.float64) * 1e-3 + 1e6,
    "relu": lambda: _randn(1 << 20, 3).relu(),
    "mostly_zero": lambda: torch.zeros(50_000).index_fill_(0, torch.arange(0, 50_000, 997), 3.0),
    "tiny": lambda: _randn(40_000, 4) * 1e-30,
    "subnormal": lambda: _randn(40_000, 5) * 1e-40,
    "huge": lambda: _randn(40_000, 6) * 1e15,
    "huge_float64": lambda: _randn(40_000, 7, torch.float64) * 1e150,
    "float64": lambda: _randn(123_457, 8, torch.float64) * 3 - 1,
    "odd_tail_of_one": lambda: _randn(3 * CHUNK + 1, 9) + 5,
    "smallest": lambda: _randn(N, 10) - 2,
    "constant": lambda: torch.full((100_000,), 3.25),
    "sorted": lambda: torch.linspace(-1, 1e3, 200_000),
    "non_contiguous": lambda: _randn(600 * 400, 11).view(600, 400).t()[::2],
    "outlier_first": lambda: torch.cat([torch.tensor([1e4]), _randn(CHUNK * 4, 12).relu()]),
}


@pytest.fixture
def kernel(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The kernel, switched on. Where numba is installed (it is in the dev extras and is the
    default CPU path) a kernel that fails must fail these tests, not skip them: before the
    test (it failed earlier) and after it (it failed during the test, which the fallback to
    the torch path would otherwise hide)."""
    pytest.importorskip("numba", reason="numba is not installed: the kernel cannot run")
    monkeypatch.setattr(_stats_numba, "ENABLED", True)  # also under FXPROBE_NUMBA=0
    broken = _stats_numba._broken  # a test that breaks the kernel on purpose replaces it
    assert not broken, f"numba imports but the kernel failed: {broken}"
    assert _stats_numba.available()
    yield
    assert not broken, f"numba imports but the kernel failed: {broken}"


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_matches_numpy_float64(name: str, kernel: None,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    t = CASES[name]()
    calls = []
    summary = _stats_numba.summary

    def spy(a: np.ndarray) -> _stats_numba.Summary | None:
        found = summary(a)
        calls.append((a.size, found is not None))
        return found

    monkeypatch.setattr(_stats_numba, "summary", spy)
    v = stats_vector(t)
    assert calls == [(t.numel(), True)]  # the kernel ran and gave the result
    want = reference(t)
    got = v.double().numpy()
    rtol = 1e-12 if t.dtype == torch.float64 else 2e-6
    atol = 1e-7 * np.abs(want[:5]).max()  # a mean of about zero: relative to the spread
    if t.dtype == torch.float32:  # the float32 result itself: subnormals have fewer bits
        atol = max(atol, float(np.finfo(np.float32).smallest_subnormal))
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol)
    assert got[5] == np.float32(want[5]) or t.dtype == torch.float64  # the exact count


@pytest.mark.parametrize("value", [NAN, INF, -INF])
@pytest.mark.parametrize("where", [0, 1, 15, 16, CHUNK - 1, CHUNK, 5 * CHUNK + 3, -1])
def test_nan_and_inf_anywhere_fall_back(value: float, where: int, kernel: None) -> None:
    t = _randn(5 * CHUNK + 7, 13)
    t[where] = value
    assert _stats_numba.summary(t.numpy()) is not None
    assert _stats_cpu.stats_row(t, torch.float32) is None  # the general path takes it
    v = stats_vector(t).double().numpy()
    finite = t[torch.isfinite(t)].double().numpy()
    np.testing.assert_allclose(v[:5], [finite.mean(), finite.std(ddof=1), finite.min(),
                                       finite.max(), np.abs(finite).max()], rtol=2e-5)
    assert (v[6], v[7]) == ((1.0, 0.0) if value != value else (0.0, 1.0))


def test_squares_that_could_overflow_fall_back(kernel: None) -> None:
    t = _randn(N, 14) * 1e18  # squares of float32 values near 1e37 per element
    assert _stats_cpu.stats_row(t, torch.float32) is None
    np.testing.assert_allclose(stats_vector(t).double().numpy(), reference(t), rtol=2e-5)


def test_failing_kernel_warns_once_and_falls_back(kernel: None,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    def broken() -> None:
        raise RuntimeError("no LLVM here")

    monkeypatch.setattr(_stats_numba, "_kernels", broken)
    monkeypatch.setattr(_stats_numba, "_broken", [])
    t = _randn(N, 15)
    with pytest.warns(UserWarning, match="numba statistics kernel failed"):
        v = stats_vector(t)
    assert not _stats_numba.available()
    np.testing.assert_allclose(v.double().numpy(), reference(t), rtol=2e-5, atol=1e-7)


def test_switched_off_takes_the_torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_stats_numba, "ENABLED", False)
    monkeypatch.setattr(_stats_numba, "summary", lambda a: pytest.fail("kernel used"))
    t = _randn(N, 16)
    np.testing.assert_allclose(stats_vector(t).double().numpy(), reference(t), rtol=2e-5,
                               atol=1e-7)


def test_importing_fxprobe_does_not_import_numba() -> None:
    code = "import sys, fxprobe, fxprobe.capture.stats.math; print('numba' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"


def _full_reference(t: torch.Tensor) -> np.ndarray:
    """All eight statistics by numpy in float64, NaN and Inf counted and left out of the rest."""
    a = t.detach().to(torch.float64).reshape(-1).numpy()
    f = a[np.isfinite(a)]
    std = f.std(ddof=1) if f.size > 1 else np.nan
    return np.array([f.mean(), std, f.min(), f.max(), np.abs(f).max(), (a == 0).sum() / a.size,
                     np.isnan(a).sum(), np.isinf(a).sum()])


def test_small_tensors_of_a_forward_go_through_one_kernel_call(
        kernel: None, monkeypatch: pytest.MonkeyPatch) -> None:
    from fxprobe.capture.stats.math import stats_vectors

    tensors = [
        _randn(512, 20), _randn(512, 21).relu(), _randn(256, 22) * 1e-2 + 1e4, _randn(10, 23),
        torch.ones(1), _randn(15, 24, torch.float64).view(3, 5) * 3, _randn(100, 25) * 1e-42,
        torch.arange(6), _randn(N - 1, 26).bfloat16(), _randn(4 * CHUNK - 3, 27)[::2] - 7,
        torch.tensor([1.0, NAN, 2.0, INF, 0.0]), torch.tensor([-INF, 3.0]),
        _randn(64, 28) * 1e18,  # float32 squares that could overflow: the general path
    ]
    calls = []
    summaries = _stats_numba.summaries
    monkeypatch.setattr(_stats_numba, "summaries",
                        lambda *a: calls.append(a[1].size - 1) or summaries(*a))
    got = stats_vectors(tensors).double().numpy()
    assert calls == [len(tensors)]  # every one of them small: one call
    for i, t in enumerate(tensors):
        want = _full_reference(t)
        rtol = 1e-12 if t.dtype == torch.float64 else 2e-6
        atol = 1e-7 * np.nanmax(np.abs(want[:5]))
        atol = max(atol, float(np.finfo(np.float32).smallest_subnormal))
        np.testing.assert_allclose(got[i], want, rtol=rtol, atol=atol, err_msg=f"tensor {i}")


def test_batch_is_right_when_the_kernel_is_busy(kernel: None,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Another thread holding the kernel makes ``summaries`` return None: the batch, chosen
    for the kernel (mid-size tensors, an empty one), then takes the numpy and torch paths."""
    from fxprobe.capture.stats.math import stats_vectors

    tensors = [_randn(512, 30), torch.empty(0), _randn(30_000, 31) + 2, _randn(16, 32),
               _randn(65_536, 33).relu(), _randn(N, 34)]
    monkeypatch.setattr(_stats_numba, "summaries", lambda *a: None)
    got = stats_vectors(tensors).double().numpy()
    assert np.isnan(got[1, :6]).all() and (got[1, 6:] == 0).all()  # the empty one
    for i, t in enumerate(tensors):
        if t.numel():
            np.testing.assert_allclose(got[i], _full_reference(t), rtol=2e-5, atol=1e-6,
                                       err_msg=f"tensor {i}")


class _Mixed(torch.nn.Module):
    """Small outputs of several dtypes in one forward: float32, float64, an integer tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(16, 40)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = torch.relu(self.fc(x))
        b = a.double() * 1e3 + 7
        c = torch.arange(x.shape[0] * 5) * 2
        return b.sum() + c.sum()


@pytest.mark.parametrize("grad", [False, True])
def test_tapped_forward_statistics_of_small_tensors(kernel: None, grad: bool,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The end of a tapped CPU forward: its small tensors (float32, float64, int64) go through
    one kernel call, and each site reads the numpy float64 statistics of its own value, at its
    own precision (float64 rows for float64 values), also when autograd records the forward."""
    import fxprobe

    model = _Mixed()
    x = torch.randn(3, 16, generator=_gen(40))
    values = fxprobe.tap(model, copy="always")
    values(x)
    kept = {k: v for k, v in values.taps.items() if isinstance(v, torch.Tensor)}
    assert {str(v.dtype) for v in kept.values()} == {"torch.float32", "torch.float64",
                                                     "torch.int64"}
    calls = []
    summaries = _stats_numba.summaries
    monkeypatch.setattr(_stats_numba, "summaries",
                        lambda *a: calls.append(a[1].size - 1) or summaries(*a))
    stats = fxprobe.tap(model, reduce="stats")
    with torch.set_grad_enabled(grad):
        out = stats(x)
    assert torch.equal(out, model(x))
    assert calls == [len(kept)]  # all of them in the one call at the end of the forward
    got = dict(stats.taps)
    assert set(got) >= set(kept)
    for name, value in kept.items():
        s = got[name]
        assert s.dtype == str(value.dtype) and s.shape == tuple(value.shape), name
        want = _full_reference(value)
        rtol = 1e-12 if value.dtype == torch.float64 else 2e-6
        row = np.array([getattr(s, f) for f in ("mean", "std", "min", "max", "absmax",
                                                  "zero_frac", "nan_count", "inf_count")])
        np.testing.assert_allclose(row, want, rtol=rtol, atol=1e-6, err_msg=name)


def test_integers_beside_a_half_type_keep_their_values(kernel: None) -> None:
    """Small tensors laid end to end for one kernel call: each is cast to float32 on its own
    (torch.cat's promotion would round int64 beside bfloat16 or float16 to the half type,
    3001..3010 read as 3008). Also through a tapped forward."""
    from fxprobe.capture.stats.math import stats_vectors

    ints = torch.arange(3001, 3011)
    for half in (torch.bfloat16, torch.float16):
        other = torch.tensor([0.5, 1.5], dtype=half)
        got = stats_vectors([ints, other]).double().numpy()
        np.testing.assert_allclose(got[0], reference(ints), rtol=2e-6, err_msg=str(half))
        np.testing.assert_allclose(got[1], reference(other), rtol=2e-6, err_msg=str(half))

    class IdsAndHalf(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            ids = torch.argsort(x)  # int64, 0..999
            return x.bfloat16() * 2 + ids.sum()

    import fxprobe

    x = torch.randn(1000, generator=_gen(41))
    tapped = fxprobe.tap(IdsAndHalf(), ops=[torch.argsort, torch.mul], reduce="stats")
    tapped(x)
    s = tapped.taps["argsort"]
    want = reference(torch.argsort(x))
    np.testing.assert_allclose([s.mean, s.std, s.min, s.max], want[:4], rtol=2e-6)


@pytest.mark.parametrize("busy", [False, True])
@pytest.mark.parametrize("dtype", [torch.int64, torch.uint8, torch.bfloat16, torch.float32])
def test_large_integer_valued_tensors_to_float32_precision(kernel: None, busy: bool,
                                                           dtype: torch.dtype) -> None:
    """A large tensor of integer values (ids, counts, quantised data), where the one-pass
    variance magnifies the error of the sum of squares: std within 2e-6 of numpy, by the
    kernel (integers and half types cast to float32 first) and by the torch path (another
    thread in the kernel; was one float32 BLAS dot, 8e-5 off)."""
    t = (torch.rand((1 << 18) - 1, generator=_gen(42)) * 200).floor().to(dtype)
    if busy:
        _stats_numba._lock.acquire()
    try:
        got = stats_vector(t).double().numpy()
    finally:
        if busy:
            _stats_numba._lock.release()
    np.testing.assert_allclose(got, reference(t), rtol=2e-6)
