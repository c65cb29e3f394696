"""Statistics of CPU tensors, where reading a value waits for nothing: the host-read branch of
:func:`capture.stats.math.stats_vector` and :func:`~capture.stats.math.stats_vectors`.

With numba installed (:mod:`fxprobe.capture.stats.numba`), an all-finite float tensor takes one pass
of a numba kernel, and :func:`table` reduces the small tensors of a batch (a forward's, laid
end to end) in one kernel call. Without it: four passes (min/max, sum, sum of squares, zero
count) and host arithmetic in float64, torch's threads for large tensors, numpy for small ones
(many of one size as one matrix, tiny ones of many sizes laid end to end). A tensor holding NaN
or Inf, or whose squares could overflow, gets None here (a row flagged not good), and
:mod:`capture.stats.math` takes its branch-free device path instead. The sum, min and max read
every element, and any NaN or Inf makes one of them non-finite, so finite results prove that
every element is finite.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
import torch

from . import numba as _stats_numba

WIDTH = 8
"""Entries of a stats vector (``len(fxprobe.capture.stats.math.FIELDS)``)."""
_F64_MAX = float(torch.finfo(torch.float64).max)
_F32_MAX = float(torch.finfo(torch.float32).max)

CPU_HOST_READS = True
"""Whether :func:`stats_vector` may read values on the host for a CPU tensor (its fast path).

On a CPU, reading a tensor's value is a memory read, not a wait for a device, so a branch on
values costs nothing there and lets the common case (every element finite) skip the
NaN/Inf bookkeeping. ``tests/nosync.py`` turns it off while it emulates a GPU on a CPU, so the
path a GPU takes is the one checked for host synchronisation."""


def host_reads_free(x: torch.Tensor) -> bool:
    """True for a plain CPU tensor in eager mode: reading its values waits for nothing."""
    return (CPU_HOST_READS and x.device.type == "cpu" and type(x) is torch.Tensor
            and not torch.compiler.is_compiling()
            and not torch._C._functorch.is_functorch_wrapped_tensor(x))


_CONDITIONED = 0.8
"""One-pass variance ``(sum x^2 - n mean^2) / (n - 1)`` is used while ``n mean^2`` is at most
this fraction of ``sum x^2`` (cancellation magnifies rounding at most 5x); beyond, two passes."""


def stats_row(x: torch.Tensor, dtype: torch.dtype) -> np.ndarray | None:
    """The stats of a non-empty CPU tensor as a numpy row (float64; float32 from the numba
    kernel for a float32 tensor, as :func:`stats_vector` returns it), or None when an element is
    not finite or the squares could overflow: numpy for small tensors, where a numpy call costs
    a microsecond and a torch op several; for larger float32/float64 ones one pass of the numba
    kernel where numba is installed (:mod:`fxprobe.capture.stats.numba`), else torch (threads)."""
    n = x.numel()
    if n <= NUMPY_MAX:
        return _cpu_stats_small(_float64_array(x))
    if _stats_numba.available():
        if x.dtype == dtype:  # float32 or float64: read as it is
            a = x.numpy().reshape(-1) if x.is_contiguous() else x.reshape(-1).numpy()
        else:  # integers, bool, half types: as float32 (exact for all but large integers)
            a = x.reshape(-1).to(dtype).numpy()
        found = _stats_numba.summary(a)
        if found is not None:
            return _from_summary(found, n, _F64_MAX if dtype == torch.float64 else _F32_MAX)
    return _cpu_stats_vector(x.reshape(-1).to(dtype), dtype)


def _from_summary(found: _stats_numba.Summary, n: int, limit: float) -> np.ndarray | None:
    """The stats row from the numba kernel's summary, with :func:`_finish`'s contract: None
    when an element is not finite (then the min or the max is not) or the squares could
    overflow ``limit``. float32 when ``limit`` is float32's (as :func:`stats_vector` returns
    it), else float64."""
    lo, hi = found[2], found[3]
    absmax = max(-lo, hi)
    if not (math.isfinite(lo) and math.isfinite(hi) and absmax * absmax * n < limit / 4):
        return None
    return _stats_numba.row(found, n, np.float32 if limit == _F32_MAX else np.float64)


NUMPY_MAX = 1 << 13
"""Up to this many elements numpy computes a CPU tensor's statistics (measured crossover)."""


def _cpu_stats_vector(flat: torch.Tensor, dtype: torch.dtype) -> np.ndarray | None:
    """:func:`stats_vector` of a large 1-D float CPU tensor, by torch's threads (see
    :func:`_finish`); the sum of squares by :func:`_cpu_sum_of_squares`."""
    lo_t, hi_t = torch.aminmax(flat)
    return _finish(
        lo_t.item(), hi_t.item(), lambda: flat.sum().item(), torch.finfo(dtype).max,
        lambda shift: _cpu_sum_of_squares(flat - shift if shift else flat), flat.numpy())


def _float64_array(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor's elements as a new 1-D float64 numpy array."""
    return _numpy_view(t.detach()).reshape(-1).astype(np.float64)


def _cpu_sum_of_squares(flat: torch.Tensor) -> float:
    """Batched dots of 4096 elements (:func:`sum_of_squares`). One BLAS dot over all of them
    drifts in float32: 2e-5 relative at 2**18 integer-valued elements, which the one-pass
    variance magnifies up to 5x (:data:`_CONDITIONED`)."""
    return float(sum_of_squares(flat, None))


def _cpu_stats_small(a: np.ndarray) -> np.ndarray | None:
    """The stats of a small 1-D float64 array, by numpy (a microsecond a call, where a torch
    op costs several; see :func:`_finish`)."""

    def squares(shift: float) -> float:
        d = a - shift if shift else a
        return float(np.dot(d, d))

    return _finish(float(a.min()), float(a.max()), lambda: float(a.sum()), _F64_MAX, squares,
                   a)


def _finish(lo: float, hi: float, total: Callable[[], float], limit: float,
            squares: Callable[[float], float], values: np.ndarray) -> np.ndarray | None:
    """The stats row of ``values`` (``n`` elements) from its min and max, or None when an
    element is not finite (NaN or Inf makes the min or the max so) or the squares could
    overflow ``limit``. ``total`` is the sum, asked for only then; ``squares(shift)`` the sum
    of ``(x - shift)**2``: one pass about 0, a second about the mean only when the mean is far
    from zero (:data:`_CONDITIONED`)."""
    n = values.size
    absmax = max(-lo, hi)
    if not (math.isfinite(lo) and math.isfinite(hi) and absmax * absmax * n < limit / 4):
        return None
    s = total()
    mean = s / n
    squared = squares(0.0)
    if n * mean * mean > _CONDITIONED * squared:  # far from zero: subtract the mean first
        squared = squares(mean)
    else:
        squared = max(squared - s * mean, 0.0)
    std = math.sqrt(squared / (n - 1)) if n > 1 else math.nan
    zeros = 0 if lo > 0 or hi < 0 else int(np.count_nonzero(values == 0))
    return np.array([mean, std, lo, hi, absmax, zeros / n, 0.0, 0.0])


def _whole_batch(tensors: Sequence[torch.Tensor]
                 ) -> tuple[np.ndarray, np.ndarray | None] | None:
    """:func:`table`'s first step: every tensor small, one numba call for all of them (as
    :func:`_numba_segments` returns it); else None. The end of every forward that takes
    statistics runs it, right after the model: the fewer steps, the fewer of them run from
    cold caches."""
    if not _stats_numba.available():
        return None
    for t in tensors:
        if t.numel() > NUMPY_MAX or not t.numel():
            return None
    return _numba_segments(tensors)


def table(tensors: Sequence[torch.Tensor],
          general: Callable[[torch.Tensor], np.ndarray]) -> np.ndarray:
    """:func:`stats_vectors` on a CPU, rows in float64: the small tensors together, by one
    numba call (up to :data:`BATCHED_MAX` elements each) or one numpy call per statistic (up
    to :data:`NUMPY_MAX`, :func:`_cpu_stats_segments`); the larger ones one by one."""
    whole = _whole_batch(tensors)
    if whole is not None and whole[1] is None:  # the common case: every row at once
        return whole[0]
    out = np.empty((len(tensors), WIDTH))
    if whole is not None:  # some rows need the general path
        _fill(out, list(range(len(tensors))), tensors, general, whole)
        return out

    def one_by_one(i: int) -> None:
        t = tensors[i].detach()
        row = stats_row(t, _out_dtype(t)) if t.numel() else None
        out[i] = row if row is not None else general(t)

    numba = _stats_numba.available()
    limit = BATCHED_MAX if numba else NUMPY_MAX
    small = []
    copied = 0  # elements laid end to end so far: the copy is worth it up to _COPY_MAX
    for i, t in enumerate(tensors):
        n = t.numel()
        if 0 < n and (n <= NUMPY_MAX or (n <= limit and copied + n <= _COPY_MAX)):
            small.append(i)
            copied += n
        else:
            one_by_one(i)
    if small and numba:  # end to end, one kernel call for all of them
        found = _numba_segments([tensors[i].detach() for i in small])
        if found is not None:
            _fill(out, small, tensors, general, found)
            return out
    groups: dict[tuple[torch.dtype, int], list[int]] = {}
    for i in small:
        groups.setdefault((tensors[i].dtype, tensors[i].numel()), []).append(i)
    single = []
    for members in groups.values():
        if len(members) < _ROWS or tensors[members[0]].numel() > _ROWS_MAX:
            single.extend(members)
        else:  # same size: one matrix, a numpy call per statistic
            stacked = torch.stack([tensors[i].detach().reshape(-1) for i in members])
            _fill(out, members, tensors, general, _cpu_stats_rows(_numpy_view(stacked)))
    tiny = sum(tensors[i].numel() for i in single) <= _SEGMENTS_MAX
    if len(single) >= _SEGMENTS and tiny:  # many tiny ones of many sizes: end to end
        found = _cpu_stats_segments([tensors[i].detach() for i in single])
        _fill(out, single, tensors, general, found)
    else:
        for i in single:
            one_by_one(i)
    return out


def _fill(out: np.ndarray, members: list[int], tensors: Sequence[torch.Tensor],
          general: Callable[[torch.Tensor], np.ndarray],
          found: tuple[np.ndarray, np.ndarray | None]) -> None:
    rows, good = found
    out[members] = rows
    if good is None:  # every row
        return
    for j in np.flatnonzero(~good):  # NaN, Inf, or squares that could overflow
        out[members[j]] = general(tensors[members[j]].detach())


BATCHED_MAX = 1 << 16
"""With numba, tensors up to this many elements are reduced at the end of the forward, laid
end to end in one kernel call (copying them costs less than a call each); without, up to
:data:`NUMPY_MAX`."""


_COPY_MAX = 1 << 18
"""... and laid end to end while they hold this many elements in all (1 MiB of float32); the
one serial kernel call would read more than one thread should (the rest go one by one)."""


def batched_max() -> int:
    """How large a CPU tensor may be to wait for the end of the forward (see
    :data:`BATCHED_MAX`)."""
    return BATCHED_MAX if _stats_numba.available() else NUMPY_MAX


def _numba_segments(tensors: Sequence[torch.Tensor]
                    ) -> tuple[np.ndarray, np.ndarray | None] | None:
    """The stats of many small non-empty CPU tensors by one numba call over their elements
    laid end to end (in float64 if one of them is float64, else float32), as
    :func:`_cpu_stats_segments` returns them (``good`` None: every row); None where the
    kernel cannot run. Lean: it runs at the end of every forward that takes statistics."""
    offsets = [0]
    end = 0
    for t in tensors:
        end += t.numel()
        offsets.append(end)
    # float64 if one of them is float64, else float32; each tensor of another dtype is cast
    # on its own (torch.cat's type promotion would round integers to a half type beside one).
    wide = any(t.dtype == torch.float64 for t in tensors)
    dtype = torch.float64 if wide else torch.float32
    parts = [t.reshape(-1) if t.dtype == dtype else t.reshape(-1).to(dtype) for t in tensors]
    flat = torch.cat(parts) if len(parts) > 1 else parts[0].contiguous()  # one torch call
    if flat.requires_grad:  # stats_vectors of tensors that require grad: no graph here
        flat = flat.detach()
    return _stats_numba.summaries(flat.numpy(), np.array(offsets, dtype=np.int64),
                                  _F64_MAX if wide else _F32_MAX)


_ROWS = 4
"""On a CPU, from this many small tensors of one size on, they are reduced as one matrix."""
_ROWS_MAX = 1 << 12
"""... of at most this many elements each (larger ones cost as much one by one)."""
_SEGMENTS_MAX = 1 << 14
"""... and small tensors of many sizes laid end to end when they hold this many elements at
most in all (beyond, the float64 copy costs more than the calls it saves)."""


def _cpu_stats_rows(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The stats of each row of a matrix of same-size tensors (as :func:`_cpu_stats_segments`
    returns them): reductions along rows in the tensors' own float dtype, sums accumulated in
    float64, two passes."""
    if a.dtype not in (np.float32, np.float64):
        a = a.astype(np.float32)
    r, n = a.shape
    out = np.empty((r, WIDTH))
    with np.errstate(all="ignore"):  # the rows with NaN or Inf are recomputed anyway
        out[:, 2] = a.min(axis=1)
        out[:, 3] = a.max(axis=1)
        absmax = np.maximum(-out[:, 2], out[:, 3], out=out[:, 4])
        good = np.isfinite(absmax) & (absmax * absmax * n < _F64_MAX / 4)  # NaN fails
        mean = np.divide(a.sum(axis=1, dtype=np.float64), n, out=out[:, 0])
        dev = a - mean.astype(a.dtype)[:, None]
        squares = np.einsum("ij,ij->i", dev, dev, dtype=np.float64)
        out[:, 1] = np.sqrt(squares / (n - 1)) if n > 1 else np.nan
        out[:, 5] = np.count_nonzero(a == 0, axis=1) / n
    out[:, 6:] = 0.0
    return out, good


_SEGMENTS = 8
"""On a CPU, tiny tensors of many sizes are reduced together from this many on."""


def _cpu_stats_segments(tensors: Sequence[torch.Tensor]) -> tuple[np.ndarray, np.ndarray]:
    """The stats of many small non-empty CPU tensors of any sizes, as ``(rows, good)``: their
    elements laid end to end in one float64 array and reduced segment by segment
    (``np.minimum.reduceat`` and the like), two passes in float64. ``good`` is False for the
    rows to take from the general path instead (an element not finite, or squares that
    could overflow)."""
    sizes = np.array([t.numel() for t in tensors])
    offsets = np.zeros(len(sizes), dtype=np.int64)
    np.cumsum(sizes[:-1], out=offsets[1:])
    a = np.concatenate([_numpy_view(t).reshape(-1) for t in tensors], dtype=np.float64)
    out = np.empty((len(sizes), WIDTH))
    with np.errstate(all="ignore"):  # the rows with NaN or Inf are recomputed anyway
        lo = np.minimum.reduceat(a, offsets, out=out[:, 2])
        hi = np.maximum.reduceat(a, offsets, out=out[:, 3])
        absmax = np.maximum(-lo, hi, out=out[:, 4])
        good = np.isfinite(absmax) & (absmax * absmax * sizes < _F64_MAX / 4)  # NaN fails
        mean = np.divide(np.add.reduceat(a, offsets), sizes, out=out[:, 0])
        dev = a - np.repeat(mean, sizes)
        np.sqrt(np.add.reduceat(dev * dev, offsets) / (sizes - 1), out=out[:, 1])
        out[sizes == 1, 1] = np.nan
        out[:, 5] = np.add.reduceat(a == 0, offsets, dtype=np.int64) / sizes
    out[:, 6:] = 0.0
    return out, good


def _numpy_view(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor's elements as numpy sees them (bfloat16, which numpy lacks, as float32)."""
    return (t.float() if t.dtype == torch.bfloat16 else t).numpy()


_DOT = 4096
"""Length of the dot products that :func:`sum_of_squares` adds up."""


def sum_of_squares(x: torch.Tensor, dim: int | None) -> torch.Tensor:
    """Sum of squares, in place for rows; for a whole tensor, batched BLAS dot products of
    4096 elements then a cascade sum: as fast as one ``dot`` but without its drift (one dot
    over 16M float32 values is off by ~1e-4 relative, these by ~1e-8)."""
    if dim is not None:
        return x.square_().sum(dim=dim)
    flat = x.reshape(-1)
    rows = flat.numel() // _DOT
    head = flat[: rows * _DOT].view(rows, 1, _DOT)
    tail = flat[rows * _DOT:]
    return torch.bmm(head, head.transpose(1, 2)).sum() + torch.dot(tail, tail)


def _out_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32
