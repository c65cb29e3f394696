"""One-pass statistics of float CPU tensors with numba: the fast path of
:func:`capture.stats.cpu.stats_row` and :func:`~capture.stats.cpu.table` (the CPU counterpart
of :mod:`fxprobe.capture.stats.triton`).

Used when ``import numba`` works, ``FXPROBE_NUMBA`` is not ``0`` (:data:`ENABLED`), and the
kernels have not failed here before: :func:`summary` for a large float32 or float64 tensor
(over threads from :data:`PARALLEL_MIN` elements, on the calling thread below), and
:func:`summaries` for the small tensors of a forward laid end to end, in one serial call.
numba is optional and never imported with fxprobe: :mod:`fxprobe.capture.stats.numba_kernels`, which
holds the kernels (and says how they work), is imported the first time a tensor needs them.
numba caches their machine code on disk, so the first call in a process costs about 0.4 s
(loading) and about 3 s on a machine's first use (compiling).

This module keeps the switch, the lock (numba's workqueue threading layer must not be entered
by two threads at once; a second caller takes the torch path instead of waiting), the fork
check, and the fallback: a kernel that fails warns once and the torch path is used from then
on. A NaN makes the min and max NaN, an Inf makes one of them infinite, so finite ones prove
that every element is finite; other rows go to the general path.
"""

from __future__ import annotations

import math
import os
import threading
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
import torch

from .triton import importable

ENABLED = os.environ.get("FXPROBE_NUMBA", "1") != "0"
"""Whether large float CPU tensors may take the numba kernel (``FXPROBE_NUMBA=0``: never;
the benchmark flips it to time both paths)."""

CHUNK = 4096
"""Elements per chunk: a chunk's partial sums stay in the input's dtype (float32 lanes of a
few hundred elements each), chunks are merged in float64."""

PARALLEL_MIN = 1 << 18
"""From this many elements (1 MiB of float32) the kernel spreads chunks over threads; below,
one thread reads about as fast as waking numba's thread pool costs. Measured on 2 cores with
two torch matmuls between calls (as between a model's sites): 512 KiB 19 us on one thread, 17
on two; 1 MiB 32 and 21; 4 MiB 116 and 64."""

_TINY = {np.float32: 2.0 ** -40, np.float64: 2.0 ** -400}
"""Below this absmax, squares of deviations would come near the dtype's smallest normal
numbers; such a tensor is scaled by a power of two first (a second pass, exact)."""

_broken: list[str] = []
"""The error of a kernel that failed to compile or run; then the torch path is used."""

_lock = threading.Lock()
"""numba's ``workqueue`` threading layer must not be entered by two threads at once; a
second caller takes the torch path instead of waiting."""

_PID = os.getpid()
"""GNU OpenMP (numba's ``omp`` layer) cannot run in a process forked after it started."""


def available() -> bool:
    """Whether the kernel may be used: enabled, numba imports (checked once), no failure."""
    return ENABLED and not _broken and os.getpid() == _PID and importable("numba")


_T = TypeVar("_T")
Summary = tuple[float, float, float, float, int]
"""``(mean, sum of squared deviations from the mean, min, max, zero count)``."""


def summary(a: np.ndarray) -> Summary | None:
    """The one-pass summary of a non-empty 1-D contiguous float32 or float64 array, or None
    (with one warning the first time) when the kernel fails in this setup or another thread
    is running it. NaN or Inf elements give a non-finite min or max."""
    return _guarded(lambda: _summary(a))


def summaries(x: np.ndarray, offsets: np.ndarray, limit: float
              ) -> tuple[np.ndarray, np.ndarray | None] | None:
    """The stats rows (:data:`fxprobe.capture.stats.math.FIELDS` order, float64) of the segments
    ``x[offsets[i]:offsets[i + 1]]`` (each non-empty) of a contiguous 1-D float32 or float64
    array, by one serial kernel call (a forward's small tensors laid end to end), and which
    rows are good: not those with NaN or Inf or squares that could overflow ``limit``, to be
    taken from the general path (None: all of them). None as for :func:`summary`."""

    def run() -> tuple[np.ndarray, np.ndarray | None]:
        out = np.empty((offsets.size - 1, 8))
        flags = np.empty(offsets.size - 1, np.int8)
        tiny = _TINY[x.dtype.type]
        if not _kernels().segments(x, offsets, CHUNK, limit, tiny, out, flags):
            return out, None
        for i in np.flatnonzero(flags == 2):  # squares would lose bits: the scaled pass
            out[i] = row(_summary(x[offsets[i]:offsets[i + 1]]), offsets[i + 1] - offsets[i])
        return out, flags != 1

    return _guarded(run)


def row(found: Summary, n: int, dtype: type = np.float64) -> np.ndarray:
    """The stats row (:data:`capture.stats.math.FIELDS` order, ``dtype``) of a summary of ``n``
    all-finite elements."""
    mean, squared, lo, hi, zeros = found
    std = math.sqrt(squared / (n - 1)) if n > 1 else math.nan
    return np.array([mean, std, lo, hi, max(-lo, hi), zeros / n, 0.0, 0.0], dtype=dtype)


def _guarded(run: Callable[[], _T]) -> _T | None:
    """``run()`` under the kernels' lock; None when another thread holds it, or (with one
    warning, and the torch path from then on) when the kernel fails."""
    if not _lock.acquire(blocking=False):
        return None
    try:
        return run()
    except Exception as e:  # a numba/LLVM mismatch must not break a forward
        _broken.append(f"{type(e).__name__}: {e}")
        warnings.warn(f"fxprobe: the numba statistics kernel failed ({type(e).__name__}: "
                      f"{str(e)[:300]}); using the torch path from now on", stacklevel=4)
        return None
    finally:
        _lock.release()


def _summary(a: np.ndarray) -> Summary:
    kernels = _kernels()
    threads = torch.get_num_threads()
    if a.size >= PARALLEL_MIN and threads > 1:
        _use_threads(threads)
        kernel = kernels.stats
    else:
        kernel = kernels.serial
    mean, m2, lo, hi, zeros = kernel(a, CHUNK)
    absmax = max(-lo, hi)
    if 0 < absmax < _TINY[a.dtype.type]:  # squares would lose bits: scale by 2**k, exact
        k = -math.frexp(absmax)[1]
        mean, m2, lo, hi, zeros = kernel(np.ldexp(a, k), CHUNK)
        mean, m2 = math.ldexp(mean, -k), math.ldexp(m2, -2 * k)
        lo, hi = math.ldexp(lo, -k), math.ldexp(hi, -k)
    return float(mean), float(m2), float(lo), float(hi), int(zeros)


def _use_threads(threads: int) -> None:
    """As many numba threads as torch uses (numba's setting is per calling thread; setting it
    costs about 2 us, so it is set again only when torch's count changed)."""
    key = threading.get_ident()
    if _threads_set.get(key) != threads:
        import numba

        numba.set_num_threads(max(1, min(threads, numba.config.NUMBA_NUM_THREADS)))  # type: ignore[attr-defined]
        _threads_set[key] = threads


_threads_set: dict[int, int] = {}
"""The torch thread count last given to numba, per calling thread."""


def _kernels() -> Any:
    """The kernels module (importing it loads numba and the compiled kernels), kept."""
    global _loaded
    if _loaded is None:
        from . import numba_kernels as _stats_numba_kernels

        _loaded = _stats_numba_kernels
    return _loaded


_loaded: Any = None
