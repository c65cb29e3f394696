# mypy: disable-error-code="call-arg"
"""The numba kernels behind :mod:`capture.stats.numba` (which imports this module only when a
tensor first needs them: importing it imports numba and loads or compiles the kernels).

Module-level functions, so that ``cache=True`` finds them again: the machine code is written
beside this file (or in numba's user-wide cache where the package is not writable) and the
next process loads it instead of compiling.

Per chunk, one loop keeps in SIMD lanes, in the input's dtype: the min and max
(``llvm.minimum``/``llvm.maximum``, which propagate NaN and vectorise without assuming that
there is none), the count of zeros, and the sum and sum of squares of ``x - c`` (``c``: the
mean of the chunk's first 16 elements, so the squares do not cancel for data far from zero).
Chunks are merged in float64 (Chan et al.'s formula for groups). The fast-math flags allow
reassociation (vector lanes), contraction (FMA) and ignoring the sign of zero, never
``nnan``/``ninf``: a NaN makes the min and max NaN, an Inf makes one of them infinite.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
from llvmlite import ir
from numba.core import cgutils
from numba.core.extending import intrinsic

FASTMATH = {"reassoc", "contract", "nsz", "arcp"}  # never nnan/ninf: NaN must show


def _binary(name: str) -> Any:
    """An LLVM float intrinsic of two operands (``llvm.minimum``: NaN-propagating)."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        ty = context.get_value_type(signature.return_type)
        suffix = "f32" if ty == ir.FloatType() else "f64"
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ty, [ty, ty]), f"{name}.{suffix}")
        return builder.call(fn, args)

    return codegen


@intrinsic
def minimum(typingctx: Any, a: Any, b: Any) -> Any:
    return a(a, b), _binary("llvm.minimum")


@intrinsic
def maximum(typingctx: Any, a: Any, b: Any) -> Any:
    return a(a, b), _binary("llvm.maximum")


@numba.njit(fastmath=FASTMATH, nogil=True, cache=True)
def chunk(y: Any) -> Any:
    """``(mean, sum of squared deviations, min, max, zeros)`` of a non-empty 1-D slice."""
    # y[i] over range(y.size) of a slice: numba proves the index in bounds and non-negative,
    # and LLVM vectorises the loop (x[i] over range(a, b) it does not).
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


@numba.njit(fastmath=FASTMATH, nogil=True, cache=True)
def _merge(means: Any, m2s: Any, los: Any, his: Any, zeros: Any, n: int, size: int) -> Any:
    """Chunks (of ``size`` elements, the last one shorter) merged in float64."""
    total = 0.0
    for j in range(means.size):
        total += means[j] * (min(n, (j + 1) * size) - j * size)
    mean = total / n
    m2 = 0.0
    lo, hi = los[0], his[0]
    for j in range(means.size):
        d = means[j] - mean
        m2 += m2s[j] + d * d * (min(n, (j + 1) * size) - j * size)
        lo = minimum(lo, los[j])  # NaN stays NaN
        hi = maximum(hi, his[j])
    return mean, m2, lo, hi, zeros.sum()


@numba.njit(parallel=True, fastmath=FASTMATH, nogil=True, cache=True)
def stats(x: Any, size: int) -> Any:
    """The summary of a non-empty contiguous 1-D array, chunks spread over threads."""
    n = x.size
    chunks = (n + size - 1) // size
    means, m2s = np.empty(chunks), np.empty(chunks)
    los, his = np.empty(chunks), np.empty(chunks)
    zeros = np.empty(chunks, np.int64)
    for j in numba.prange(chunks):
        mean_j, m2_j, lo_j, hi_j, z_j = chunk(x[j * size:min(n, (j + 1) * size)])
        means[j], m2s[j], los[j], his[j], zeros[j] = mean_j, m2_j, lo_j, hi_j, int(z_j)
    return _merge(means, m2s, los, his, zeros, n, size)


@numba.njit(fastmath=FASTMATH, nogil=True, cache=True)
def serial(x: Any, size: int) -> Any:
    """:func:`stats` on the calling thread only (no thread pool to wake: smaller tensors)."""
    n = x.size
    if n <= size:  # one chunk: nothing to merge, nothing to allocate
        mean, m2, lo, hi, z = chunk(x)
        return mean, m2, lo, hi, np.int64(z)
    chunks = (n + size - 1) // size
    means, m2s = np.empty(chunks), np.empty(chunks)
    los, his = np.empty(chunks), np.empty(chunks)
    zeros = np.empty(chunks, np.int64)
    for j in range(chunks):
        mean_j, m2_j, lo_j, hi_j, z_j = chunk(x[j * size:min(n, (j + 1) * size)])
        means[j], m2s[j], los[j], his[j], zeros[j] = mean_j, m2_j, lo_j, hi_j, int(z_j)
    return _merge(means, m2s, los, his, zeros, n, size)


@numba.njit(fastmath=FASTMATH, nogil=True, cache=True)
def segments(x: Any, offsets: Any, size: int, limit: float, tiny: float, out: Any,
             flags: Any) -> int:
    """The eight statistics of each segment ``x[offsets[i]:offsets[i + 1]]`` (non-empty) into
    row ``i`` of ``out`` (float64): many small tensors laid end to end, one call. ``flags[i]``
    is 0 for a row done, 1 for a segment with NaN or Inf or squares that could overflow
    ``limit``, 2 for one whose absmax is below ``tiny`` (squares would lose bits). Returns
    how many rows are not done (flags not 0)."""
    flagged = 0
    for i in range(offsets.size - 1):
        a, b = offsets[i], offsets[i + 1]
        n = b - a
        mean, m2, lo, hi, z = serial(x[a:b], size)
        lo64, hi64 = np.float64(lo), np.float64(hi)
        absmax = max(-lo64, hi64)
        out[i, 0] = mean
        out[i, 1] = np.sqrt(m2 / (n - 1)) if n > 1 else np.nan
        out[i, 2], out[i, 3], out[i, 4] = lo64, hi64, absmax
        out[i, 5] = z / n
        out[i, 6], out[i, 7] = 0.0, 0.0
        if not (np.isfinite(lo64) and np.isfinite(hi64) and absmax * absmax * n < limit / 4):
            flags[i] = 1
        elif 0 < absmax < tiny:
            flags[i] = 2
        else:
            flags[i] = 0
        flagged += flags[i] != 0
    return flagged
