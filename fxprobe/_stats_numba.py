"""One-pass statistics of a large float CPU tensor with numba: the fast path of
:func:`fxprobe._stats_cpu.stats_row` (the CPU counterpart of :mod:`fxprobe._stats_triton`).

Used when ``import numba`` works, ``FXPROBE_NUMBA`` is not ``0`` (:data:`ENABLED`), the tensor
is float32 or float64 with more than :data:`fxprobe._stats_cpu.NUMPY_MAX` elements, and the
kernel has not failed here before. numba is optional: it is imported, and the kernel compiled,
the first time a tensor takes this path (about 2 to 3 s, in every process: ``cache=True``
does not hit for these closures, whose intrinsics numba cannot key, and only wrote a new
cache entry per process), never when fxprobe is imported.

The kernel reads the tensor once, in chunks of :data:`CHUNK` elements spread over threads
(``numba.prange``, as many as torch uses). Per chunk, one loop keeps in SIMD lanes, in the
input's dtype: the min and max (``llvm.minimum``/``llvm.maximum``, which propagate NaN and
vectorise without assuming that there is none), the count of zeros, and the sum and sum of
squares of ``x - c`` (``c``: the mean of the chunk's first 16 elements, so the squares do not
cancel for data far from zero). The chunks' means and sums of squared deviations are then
merged in float64 (Chan et al.'s formula for groups). The fast-math flags allow reassociation
(vector lanes), contraction (FMA) and ignoring the sign of zero, never ``nnan``/``ninf``: a
NaN makes the min and max NaN, an Inf makes one of them infinite, so finite ones prove that
every element is finite.
"""

from __future__ import annotations

import functools
import math
import os
import threading
import warnings
from typing import Any

import numpy as np
import torch

ENABLED = os.environ.get("FXPROBE_NUMBA", "1") != "0"
"""Whether large float CPU tensors may take the numba kernel (``FXPROBE_NUMBA=0``: never;
the benchmark flips it to time both paths)."""

CHUNK = 4096
"""Elements per chunk: a chunk's partial sums stay in the input's dtype (float32 lanes of a
few hundred elements each), chunks are merged in float64."""

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
    return ENABLED and not _broken and os.getpid() == _PID and _importable()


@functools.cache
def _importable() -> bool:
    try:
        import numba  # noqa: F401
    except ImportError:
        return False
    return True


Summary = tuple[float, float, float, float, int]
"""``(mean, sum of squared deviations from the mean, min, max, zero count)``."""


def summary(a: np.ndarray) -> Summary | None:
    """The one-pass summary of a non-empty 1-D contiguous float32 or float64 array, or None
    (with one warning the first time) when the kernel fails in this setup or another thread
    is running it. NaN or Inf elements give a non-finite min or max."""
    if not _lock.acquire(blocking=False):
        return None
    try:
        import numba

        numba.set_num_threads(max(1, min(torch.get_num_threads(),
                                         numba.config.NUMBA_NUM_THREADS)))  # type: ignore[attr-defined]
        mean, m2, lo, hi, zeros = _kernel()(a, CHUNK)
        absmax = max(-lo, hi)
        if 0 < absmax < _TINY[a.dtype.type]:  # squares would lose bits: scale by 2**k, exact
            k = -math.frexp(absmax)[1]
            mean, m2, lo, hi, zeros = _kernel()(np.ldexp(a, k), CHUNK)
            mean, m2 = math.ldexp(mean, -k), math.ldexp(m2, -2 * k)
            lo, hi = math.ldexp(lo, -k), math.ldexp(hi, -k)
        return float(mean), float(m2), float(lo), float(hi), int(zeros)
    except Exception as e:  # a numba/LLVM mismatch must not break a forward
        _broken.append(f"{type(e).__name__}: {e}")
        warnings.warn(f"fxprobe: the numba statistics kernel failed ({type(e).__name__}: "
                      f"{str(e)[:300]}); using the torch path from now on", stacklevel=3)
        return None
    finally:
        _lock.release()


@functools.cache
def _kernel() -> Any:
    """The compiled kernel (compiled at the first call)."""
    import numba
    from llvmlite import ir
    from numba.core import cgutils
    from numba.core.extending import intrinsic

    def binary(name: str) -> Any:
        """An LLVM float intrinsic of two operands (``llvm.minimum``: NaN-propagating)."""

        @intrinsic
        def op(typingctx: Any, a: Any, b: Any) -> Any:
            def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
                ty = context.get_value_type(signature.return_type)
                suffix = "f32" if ty == ir.FloatType() else "f64"
                fn = cgutils.get_or_insert_function(
                    builder.module, ir.FunctionType(ty, [ty, ty]), f"{name}.{suffix}")
                return builder.call(fn, args)

            return a(a, b), codegen

        return op

    minimum, maximum = binary("llvm.minimum"), binary("llvm.maximum")
    prange = numba.prange
    fastmath = {"reassoc", "contract", "nsz", "arcp"}  # never nnan/ninf: NaN must show

    @numba.njit(fastmath=fastmath, nogil=True, cache=False)
    def chunk(y: Any) -> Any:
        # y[i] over range(y.size) of a slice: numba proves the index in bounds and
        # non-negative, and LLVM vectorises the loop (x[i] over range(a, b) it does not).
        zero, one = y.dtype.type(0), y.dtype.type(1)
        k = min(16, y.size)
        c = zero
        for i in range(k):
            c += y[i]
        c = c / y.dtype.type(k)
        lo, hi, s, q, z = y[0], y[0], zero, zero, zero
        for i in range(y.size):
            v = y[i]
            lo = minimum(lo, v)
            hi = maximum(hi, v)
            z += one if v == zero else zero
            d = v - c
            s += d
            q += d * d
        n = y.size
        s64 = np.float64(s)
        return np.float64(c) + s64 / n, max(np.float64(q) - s64 * s64 / n, 0.0), lo, hi, z

    @numba.njit(parallel=True, fastmath=fastmath, nogil=True, cache=False)
    def stats(x: Any, size: int) -> Any:
        n = x.size
        chunks = (n + size - 1) // size
        means = np.empty(chunks)
        m2s = np.empty(chunks)
        los = np.empty(chunks)
        his = np.empty(chunks)
        zeros = np.empty(chunks, np.int64)
        for j in prange(chunks):
            mean_j, m2_j, lo_j, hi_j, z_j = chunk(x[j * size:min(n, (j + 1) * size)])
            means[j], m2s[j], los[j], his[j], zeros[j] = mean_j, m2_j, lo_j, hi_j, int(z_j)
        total = 0.0
        for j in range(chunks):
            total += means[j] * (min(n, (j + 1) * size) - j * size)
        mean = total / n
        m2 = 0.0
        lo, hi = los[0], his[0]
        for j in range(chunks):
            d = means[j] - mean
            m2 += m2s[j] + d * d * (min(n, (j + 1) * size) - j * size)
            lo = minimum(lo, los[j])  # NaN stays NaN
            hi = maximum(hi, his[j])
        return mean, m2, lo, hi, zeros.sum()

    return stats
