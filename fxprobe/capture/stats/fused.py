"""Statistics under ``torch.compile``: one pass of plain reductions that inductor fuses into the
loop producing the value.

:func:`fused_stats_vector` is what :func:`capture.stats.math.stats_vector` computes while
dynamo traces (``torch.compiler.is_compiling()``): the Triton kernel, the numba kernel and
the host reads of the eager paths are opaque to dynamo or would break the graph, and the
branch-free device path (:func:`capture.stats.math._stats_of`) needs the mean before the
squares, writes into ``out=`` buffers and sums squares by ``bmm``, which inductor runs as
several loops and an extern call. Here every statistic is a reduction over the same
elements, with no op between them that needs a finished reduction, so inductor makes one
loop of them, and puts that loop into the kernel that produced the value when one reads it
there (on a CPU: ``relu(linear(x)) + x`` and the statistics of ``linear(x)`` in one kernel).
The eight numbers come out of the same kernel's epilogue; nothing waits for the device.

One pass over the elements, as shifted sums: ``d = x - k`` over the finite elements, with
``k`` the first element (0 if it is not finite), then ``sum d`` and ``sum d**2`` in float64,
so that the variance ``(sum d**2 - (sum d)**2 / n) / (n - 1)`` loses nothing to cancellation
that float32 data can show (a mean 10**4 standard deviations away loses about 1e-8). The
same NaN/Inf rules as :func:`~capture.stats.math.stats_vector`: mean, std, min, max and
absmax over the finite elements (NaN when none is), counts of NaN and Inf, ``zero_frac``
over all elements.
"""

from __future__ import annotations

import torch

_ACC = torch.float64
"""Accumulation dtype of the sums (the counts are integers: int32 below 2**31 elements)."""


def fused_stats_vector(x: torch.Tensor) -> torch.Tensor:
    """The eight statistics of a non-empty, non-float64 tensor as a float32 vector, in
    :data:`~capture.stats.math.FIELDS` order, by reductions that inductor fuses into one loop.

    Args:
        x: a detached real tensor with at least one element, not float64 (float64 keeps the
            scaled device path: its squares could overflow float64 accumulators).

    Returns:
        ``[mean, std, min, max, absmax, zero_frac, nan_count, inf_count]``, float32.
    """
    flat = x.reshape(-1)
    numel = flat.numel()
    if not flat.is_floating_point():  # integers and bool: exact in float64
        flat = flat.to(_ACC)
    # x - x is 0 for a finite x and NaN for NaN and +-Inf: one compare, vectorised (isfinite
    # and isnan are scalar loops in inductor's CPU code).
    finite = (flat - flat) == 0
    # int32 counts where they cannot overflow: half the vector work of int64 ones.
    counts = torch.int32 if numel < 2**31 else torch.int64
    n = finite.sum(dtype=counts)
    nan_count = (flat != flat).sum(dtype=counts)
    zeros = (flat == 0).sum(dtype=counts)
    lo = torch.where(finite, flat, float("inf")).amin()
    hi = torch.where(finite, flat, float("-inf")).amax()
    shift = flat[0].to(_ACC)
    shift = torch.where((shift - shift) == 0, shift, 0.0)
    d = torch.where(finite, flat.to(_ACC) - shift, 0.0)
    s1 = d.sum()
    s2 = (d * d).sum()
    count = n.to(_ACC)
    mean_d = s1 / count  # 0/0 = NaN when nothing is finite
    variance = ((s2 - s1 * mean_d) / (count - 1)).clamp_min(0.0)
    std = torch.where(n > 1, torch.sqrt(variance), torch.nan)
    lo = torch.where(n > 0, lo.to(_ACC), torch.nan)
    hi = torch.where(n > 0, hi.to(_ACC), torch.nan)
    nans = nan_count.to(_ACC)
    return torch.stack([
        mean_d + shift, std, lo, hi, torch.maximum(lo.abs(), hi.abs()), zeros.to(_ACC) / numel,
        nans, numel - count - nans,
    ]).to(torch.float32)
