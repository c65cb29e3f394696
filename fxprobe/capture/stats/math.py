"""Summary statistics of captured tensors, computed on their device without stalling the host.

:func:`stats_vector` reduces a tensor to eight numbers. On an accelerator it runs tensor ops
only: no ``.item()``, no branching on values, nothing that waits for the device (on CUDA with
Triton: one fused kernel, :mod:`capture.stats.triton`). On a CPU, where reading a value waits
for nothing, it branches: an all-finite tensor (the common case) takes one pass of a numba
kernel (:mod:`capture.stats.numba`, large float tensors, numba installed) or four torch passes
and a few host operations (numpy for small tensors), and only a tensor with NaN or Inf pays for the
finite-only bookkeeping of the device path. :func:`stats_vectors` reduces many tensors with
few ops (small ones of one size stacked into a matrix). The rest of the statistics live beside
this module: :mod:`.batch` (:class:`~.batch.StatsBatch`: the vectors of one forward, brought to
the host in one transfer), :mod:`.sampling` (:func:`~.sampling.sample_vector`) and :mod:`.table`
(:func:`~.table.stats_table`); ``fxprobe.StatsLogger`` is a sink (:mod:`fxprobe.sinks.statslog`).

Semantics (tested against numpy in float64):

- ``nan_count`` and ``inf_count`` count NaN and ±Inf elements.
- ``mean``, ``std``, ``min``, ``max`` and ``absmax`` are taken over the *finite* elements only,
  so one overflow does not hide the rest of the distribution; they are NaN when no element is
  finite. ``std`` uses Bessel's correction like ``torch.std`` (NaN for a single finite element).
- ``zero_frac`` is the fraction of *all* elements that equal zero (NaN is not zero).
- An empty tensor gives NaN for every statistic but the two counts, which are 0.
- Integer and bool tensors are cast to floating point. The vector is float64 for float64 input
  and float32 otherwise (so counts above 2**24 are rounded, a relative error below 6e-8).
- Squares are taken of deviations scaled by a power of two, so ``std`` does not overflow for
  huge values; the finite sum itself is accumulated in the vector's dtype (float32 values
  near its maximum, summed, overflow to Inf as they always have).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ...core.errors import ConfigError
from . import cpu as _stats_cpu
from .cpu import sum_of_squares
from .fused import fused_stats_vector

FIELDS = ("mean", "std", "min", "max", "absmax", "zero_frac", "nan_count", "inf_count")
"""The order of the entries of a stats vector."""


@dataclass(frozen=True)
class Stats:
    """Summary statistics of one captured tensor (see the module docstring for NaN/Inf rules)."""

    shape: tuple[int, ...]
    """The tensor's shape."""
    dtype: str
    """The tensor's dtype, as ``str(torch.float32)`` spells it."""
    numel: int
    """Number of elements."""
    mean: float
    """Mean of the finite elements (NaN if there are none)."""
    std: float
    """Standard deviation of the finite elements, with Bessel's correction (NaN below two)."""
    min: float
    """Smallest finite element (NaN if there are none)."""
    max: float
    """Largest finite element (NaN if there are none)."""
    absmax: float
    """Largest absolute value of a finite element (NaN if there are none)."""
    zero_frac: float
    """Fraction of all elements that are exactly zero (NaN for an empty tensor)."""
    nan_count: int
    """Number of NaN elements."""
    inf_count: int
    """Number of +Inf and -Inf elements."""


def stats_vector(t: torch.Tensor) -> torch.Tensor:
    """The eight statistics of ``t`` as a 1-D tensor on its device, in :data:`FIELDS` order.

    On an accelerator it runs tensor ops only, so it never blocks the host; the result is
    detached from autograd. On CUDA, with Triton installed and outside ``torch.compile``, one
    Triton kernel reads ``t`` once (:mod:`fxprobe.capture.stats.triton`); while
    ``torch.compile`` traces it, reductions that inductor fuses into one loop, into the
    kernel that produced ``t`` where it can (:mod:`fxprobe.capture.stats.fused`; float64
    keeps the path below); elsewhere about a dozen
    torch reductions and in-place ops over one temporary, with no branch on values. On a CPU
    in eager mode (not under ``torch.compile`` or a functorch transform), where a branch on
    values costs nothing, a tensor whose elements are all finite takes one numba pass (large
    float tensors, numba installed) or four passes instead.

    Args:
        t: a real tensor of any dtype (bool and integers are cast), any shape, any device.

    Returns:
        ``[mean, std, min, max, absmax, zero_frac, nan_count, inf_count]``, float64 when ``t``
        is float64 and float32 otherwise.

    Raises:
        ConfigError: ``t`` is not a tensor, or is complex.

    Example:
        >>> stats_vector(torch.tensor([1.0, 2.0, float("nan")]))
        tensor([1.5000, 0.7071, 1.0000, 2.0000, 2.0000, 0.0000, 1.0000, 0.0000])
    """
    _check(t)
    dtype = _out_dtype(t)
    numel = t.numel()  # metadata: reading it does not synchronise
    if numel == 0:  # a fill, not torch.tensor([...]): a copy from the host would synchronise
        empty = torch.full((len(FIELDS),), float("nan"), dtype=dtype, device=t.device)
        empty[6:] = 0.0
        return empty
    x = t.detach()
    if torch.compiler.is_compiling():
        if dtype == torch.float32:  # one fused pass (see capture.stats.fused)
            return fused_stats_vector(x)
        return _general_stats(x, dtype)
    if x.is_cuda:
        from . import triton as _stats_triton

        if _stats_triton.available():
            fused = _stats_triton.try_stats_vector(x, dtype)
            if fused is not None:
                return fused
    if _stats_cpu.host_reads_free(x):
        row = _stats_cpu.stats_row(x, dtype)
        if row is not None:
            return torch.from_numpy(row.astype(_NP_DTYPE[dtype], copy=False))
    return _general_stats(x, dtype)


def _general_stats(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The tensor-op path of :func:`stats_vector` (no branch on values, any device)."""
    if x.numel() <= _SMALL:  # launch-bound: float64 needs no overflow guard, so fewer ops
        return _stats_of(x.reshape(-1).to(torch.float64), None, scaled=False).to(dtype)
    return _stats_of(x.reshape(-1).to(dtype), None)

_F64_MAX = float(torch.finfo(torch.float64).max)
_NP_DTYPE = {torch.float32: np.float32, torch.float64: np.float64}


def stats_vectors(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The statistics of many tensors at once: row ``i`` is ``stats_vector(tensors[i])``.

    Small tensors (up to 65,536 elements) of the same size and dtype are stacked into one
    matrix and reduced row by row, so a forward's hundreds of small activations cost a few
    dozen ops instead of a couple of dozen each. Larger tensors go through
    :func:`stats_vector` one by one (a Triton kernel on CUDA). No op waits for the device.

    Args:
        tensors: real tensors, all on one device, of any dtypes and shapes.

    Returns:
        A ``(len(tensors), 8)`` tensor on that device, columns in :data:`FIELDS` order; float64
        if any input is float64, float32 otherwise. ``(0, 8)`` float32 on the CPU for none.

    Raises:
        ConfigError: an element is not a tensor, or is complex.
        ValueError: the tensors live on more than one device.

    Example:
        >>> stats_vectors([torch.ones(3), torch.arange(4)])[:, 0]  # the means
        tensor([1.0000, 1.5000])
    """
    tensors = list(tensors)
    for t in tensors:
        _check(t)
    if not tensors:
        return torch.empty((0, len(FIELDS)))
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise ValueError(
            f"stats_vectors needs tensors on one device, got {sorted(map(str, devices))}; "
            "call it once per device"
        )
    return checked_vectors(tensors)


def checked_vectors(tensors: list[torch.Tensor]) -> torch.Tensor:
    """:func:`stats_vectors` of tensors already checked: real, on one device, at least one
    (the end of a forward, where every microsecond counts)."""
    out_dtype = (torch.float64 if any(t.dtype == torch.float64 for t in tensors)
                 else torch.float32)
    if _stats_cpu.host_reads_free(tensors[0].detach()):
        return torch.from_numpy(cpu_table(tensors)).to(out_dtype)
    rows: list[torch.Tensor | None] = [None] * len(tensors)
    groups: dict[tuple[torch.dtype, int], list[int]] = {}  # same dtype and size: stackable
    for i, t in enumerate(tensors):
        n = t.numel()
        if n > _SMALL or n == 0:
            rows[i] = stats_vector(t)
        else:
            groups.setdefault((t.dtype, n), []).append(i)
    for (_, n), members in groups.items():
        if len(members) == 1:
            rows[members[0]] = stats_vector(tensors[members[0]])
            continue
        stacked = torch.stack([tensors[i].detach().reshape(n) for i in members])
        result = _stats_of(stacked.to(torch.float64), 1, scaled=False)
        for j, i in enumerate(members):
            rows[i] = result[j]
    return torch.stack([r.to(out_dtype) for r in rows if r is not None])




def cpu_table(tensors: Sequence[torch.Tensor]) -> np.ndarray:
    """:func:`checked_vectors` of CPU tensors (``host_reads_free``) as float64 numpy rows."""
    return _stats_cpu.table(tensors, _general_or_empty)


def _general_or_empty(t: torch.Tensor) -> np.ndarray:
    if t.numel() == 0:
        return stats_vector(t).double().numpy()
    return _general_stats(t, _out_dtype(t)).double().numpy()


_SMALL = 1 << 16
"""Tensors with at most this many elements are batched by :func:`stats_vectors`."""


def _check(t: object) -> None:
    if not isinstance(t, torch.Tensor):
        raise ConfigError(f"stats_vector needs a torch.Tensor, got {type(t).__name__}; pass "
                          "torch.as_tensor(...) of it")
    if t.is_complex():
        raise ConfigError(
            f"stats_vector does not summarise complex tensors ({t.dtype}); pass t.abs() or "
            "torch.view_as_real(t)"
        )


def _out_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _stats_of(x: torch.Tensor, dim: int | None, scaled: bool = True) -> torch.Tensor:
    """The stats of ``x`` (float32/64): of all of it (``dim=None``, shape ``(8,)``) or of each
    row of a 2-D ``x`` (``dim=1``, shape ``(r, 8)``).

    Every reduction runs over the finite values with non-finite ones replaced by a neutral
    value, so nothing branches on data: zeros for the sum; once the mean is known, the
    deviations ``(x - mean) / s`` with 0 (the mean) in their place, which moves neither the
    min, the max nor the sum of squares. ``s`` is a power of two at least twice the largest
    finite magnitude: the scaling is exact and the squares cannot overflow (``scaled=False``
    skips it: for small tensors computed in float64, where a dozen fewer tiny ops matter
    more). Whole-tensor
    reductions are used for one tensor: on a CPU they are several times faster than ``dim=``
    ones (``count_nonzero(dim=)`` is a comparison plus an int64 sum, ``aminmax(dim=)`` is slow).
    """
    numel = x.numel() if dim is None else x.shape[dim]
    buf = torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)  # the one temporary
    # NaN and Inf are not zero: nonzero(x) - nonzero(buf) counts the non-finite values.
    counts = torch.stack([_count_nonzero(x, dim), _count_nonzero(buf, dim),
                          _count_nonzero(x != x, dim)], dim=-1).to(x.dtype)
    nonzero, nonfinite, nan_count = counts.unbind(-1)
    nonfinite = nonzero - nonfinite
    n = numel - nonfinite
    mean = _sum(buf, dim) / n  # 0/0 = NaN when nothing is finite
    # A 1-element operand, not a 0-d one: on a CPU, ops with 0-d tensor operands are slow.
    column = mean.reshape(-1, 1) if dim is not None else mean.reshape(1)
    if scaled:
        # A power of two >= 2 * the largest finite magnitude; NaN (and so every statistic but
        # the counts) when nothing is finite.
        lo0, hi0 = _aminmax(buf, dim)
        big = (torch.maximum(lo0.abs(), hi0.abs()).clamp_min(torch.finfo(x.dtype).tiny)
               + mean * 0)
        scale = torch.exp2(torch.floor(torch.log2(big)) + 2)
        inv = scale.reciprocal()
    # buf := (x - mean) [/ scale, exact], then 0 (the mean) where x is not finite.
    torch.sub(x, column, out=buf)
    if scaled:
        buf.mul_(inv.reshape(-1, 1) if dim is not None else inv.reshape(1))
    buf.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
    lo_d, hi_d = _aminmax(buf, dim)
    if scaled:
        lo, hi = lo_d * scale + mean, hi_d * scale + mean
        std = scale * torch.sqrt(sum_of_squares(buf, dim) / (n - 1))  # NaN for one value
    else:
        lo, hi = lo_d + mean, hi_d + mean  # NaN when nothing is finite: mean is NaN
        std = torch.sqrt(_sum(buf.square_(), dim) / (n - 1))
    # With nothing finite, n - 1 = -1 and the square root of -0.0: NaN said explicitly, since
    # inductor folds the "+ mean * 0" that would carry mean's NaN (and gave -0.0).
    std = torch.where(n > 0, std, torch.nan)
    absmax = torch.maximum(lo.abs(), hi.abs())
    return torch.stack([mean, std, lo, hi, absmax, (numel - nonzero) / numel, nan_count,
                        nonfinite - nan_count], dim=-1)


def _count_nonzero(x: torch.Tensor, dim: int | None) -> torch.Tensor:
    return torch.count_nonzero(x) if dim is None else torch.count_nonzero(x, dim=dim)


def _sum(x: torch.Tensor, dim: int | None) -> torch.Tensor:
    return x.sum() if dim is None else x.sum(dim=dim)


def _aminmax(x: torch.Tensor, dim: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    if dim is None:
        lo, hi = torch.aminmax(x)
        return lo, hi
    return x.amin(dim=dim), x.amax(dim=dim)
