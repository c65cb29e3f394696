"""One-pass statistics of a CUDA tensor with Triton: the fast path of :func:`stats_vector`.

Used only when the tensor is on CUDA, ``import triton`` works and no ``torch.compile`` is
tracing (inductor fuses the torch fallback itself). Two launches per tensor, nothing read back
by the host:

- ``_partials``: each program walks a contiguous run of tiles once and keeps, per lane, the
  finite count, the sum and sum of squares of ``x - c`` (``c``: the mean of the finite values
  of its first tile, so the squares do not cancel), the finite min and max, and the zero, NaN
  and Inf counts: counts in int32, sums, min and max in float32 (float64 for float64 input),
  squares in float64 (no overflow for any float32 value); it writes one row of nine float64
  numbers.
- ``_finalize``: one program merges the rows (Chan et al.'s pairwise update of mean and sum
  of squared deviations) and writes the eight statistics in :data:`capture.stats.math.FIELDS`
  order, in the output dtype.
"""

from __future__ import annotations

import functools
import importlib
import warnings
from typing import Any

import torch

_BLOCK = 1024
"""Elements per tile (one tile per loop step of a program)."""
_MAX_PROGRAMS = 1024
"""At most this many partial rows; ``_finalize`` merges them in one block."""


_broken: list[str] = []
"""The error of a kernel that failed to compile or launch; then the torch fallback is used."""


def available() -> bool:
    """Whether Triton imports (checked once) and its kernels have not failed here."""
    return not _broken and importable("triton")


@functools.cache
def importable(module: str) -> bool:
    """Whether an optional dependency imports (tried once per process; also used by
    :mod:`fxprobe.capture.stats.numba` for numba)."""
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


def try_stats_vector(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """:func:`stats_vector`, or None (with one warning) if the kernels fail in this setup."""
    try:
        return stats_vector(x, dtype)
    except Exception as e:  # a Triton/driver mismatch must not break a forward
        _broken.append(f"{type(e).__name__}: {e}")
        warnings.warn(f"fxprobe: the Triton statistics kernel failed ({type(e).__name__}: "
                      f"{str(e)[:300]}); using the torch fallback from now on", stacklevel=3)
        return None


@functools.cache
def _kernels() -> tuple[Any, Any]:
    import triton
    import triton.language as tl

    @triton.jit
    def _partials(x_ptr, part_ptr, n_elements, tiles_per_program, BLOCK: tl.constexpr,
                  WIDE: tl.constexpr):
        # Per lane, the running sums stay in the input's precision class (float32, or float64
        # for float64 input), counts in int32, and only the squares in float64 (no overflow
        # for any float32 value): fewer float64 registers and ops than a float64 pass.
        acc_ty = tl.float64 if WIDE else tl.float32
        pid = tl.program_id(0)
        lanes = tl.arange(0, BLOCK)
        start = pid.to(tl.int64) * tiles_per_program * BLOCK
        idx = start + lanes
        inb = idx < n_elements
        v = tl.load(x_ptr + idx, mask=inb, other=0.0).to(acc_ty)
        fin = inb & (v == v) & (tl.abs(v) != float("inf"))
        first_n = tl.sum(fin.to(tl.float64), axis=0)
        c = (tl.sum(tl.where(fin, v, 0.0).to(tl.float64), axis=0)
             / tl.maximum(first_n, 1.0)).to(acc_ty)
        acc_n = tl.zeros([BLOCK], dtype=tl.int32)
        acc_z = tl.zeros([BLOCK], dtype=tl.int32)
        acc_nan = tl.zeros([BLOCK], dtype=tl.int32)
        acc_bad = tl.zeros([BLOCK], dtype=tl.int32)
        acc_s = tl.zeros([BLOCK], dtype=acc_ty)
        acc_q = tl.zeros([BLOCK], dtype=tl.float64)
        acc_lo = tl.full([BLOCK], float("inf"), dtype=acc_ty)
        acc_hi = tl.full([BLOCK], float("-inf"), dtype=acc_ty)
        for t in range(0, tiles_per_program):
            idx = start + t * BLOCK + lanes
            inb = idx < n_elements
            v = tl.load(x_ptr + idx, mask=inb, other=0.0).to(acc_ty)
            is_nan = v != v
            is_inf = tl.abs(v) == float("inf")
            fin = inb & (v == v) & (tl.abs(v) != float("inf"))
            d = tl.where(fin, v - c, 0.0)
            dq = d.to(tl.float64)
            acc_n += fin.to(tl.int32)
            acc_bad += (inb & (is_nan | is_inf)).to(tl.int32)
            acc_nan += (inb & is_nan).to(tl.int32)
            acc_z += (inb & (v == 0.0)).to(tl.int32)
            acc_s += d
            acc_q += dq * dq
            acc_lo = tl.minimum(acc_lo, tl.where(fin, v, float("inf")))
            acc_hi = tl.maximum(acc_hi, tl.where(fin, v, float("-inf")))
        n = tl.sum(acc_n.to(tl.float64), axis=0)
        s = tl.sum(acc_s.to(tl.float64), axis=0)
        q = tl.sum(acc_q, axis=0)
        nans = tl.sum(acc_nan.to(tl.float64), axis=0)
        row = part_ptr + pid * 9
        safe_n = tl.maximum(n, 1.0)
        tl.store(row + 0, n)
        tl.store(row + 1, c.to(tl.float64) + s / safe_n)  # this program's finite mean
        tl.store(row + 2, tl.maximum(q - s * s / safe_n, 0.0))  # its sum of squared devs
        tl.store(row + 3, tl.min(acc_lo, axis=0).to(tl.float64))
        tl.store(row + 4, tl.max(acc_hi, axis=0).to(tl.float64))
        tl.store(row + 5, tl.sum(acc_z.to(tl.float64), axis=0))
        tl.store(row + 6, nans)
        tl.store(row + 7, tl.sum(acc_bad.to(tl.float64), axis=0) - nans)
        tl.store(row + 8, 0.0)

    @triton.jit
    def _finalize(part_ptr, out_ptr, n_programs, n_elements, PB: tl.constexpr):
        i = tl.arange(0, PB)
        live = i < n_programs
        row = part_ptr + i * 9
        n_p = tl.load(row + 0, mask=live, other=0.0)
        mean_p = tl.load(row + 1, mask=live, other=0.0)
        m2_p = tl.load(row + 2, mask=live, other=0.0)
        lo = tl.min(tl.load(row + 3, mask=live, other=float("inf")), axis=0)
        hi = tl.max(tl.load(row + 4, mask=live, other=float("-inf")), axis=0)
        zeros = tl.sum(tl.load(row + 5, mask=live, other=0.0), axis=0)
        nans = tl.sum(tl.load(row + 6, mask=live, other=0.0), axis=0)
        infs = tl.sum(tl.load(row + 7, mask=live, other=0.0), axis=0)
        n = tl.sum(n_p, axis=0)
        mean = tl.sum(n_p * mean_p, axis=0) / n  # NaN when nothing is finite
        dev = tl.where(n_p > 0, mean_p - mean, 0.0)
        m2 = tl.sum(m2_p, axis=0) + tl.sum(n_p * dev * dev, axis=0)
        std = tl.sqrt(m2 / (n - 1.0))
        nan = float("nan")
        std = tl.where(n > 1.0, std, nan)
        lo = tl.where(n > 0.0, lo, nan)
        hi = tl.where(n > 0.0, hi, nan)
        ty = out_ptr.dtype.element_ty
        tl.store(out_ptr + 0, mean.to(ty))
        tl.store(out_ptr + 1, std.to(ty))
        tl.store(out_ptr + 2, lo.to(ty))
        tl.store(out_ptr + 3, hi.to(ty))
        tl.store(out_ptr + 4, tl.maximum(tl.abs(lo), tl.abs(hi)).to(ty))
        tl.store(out_ptr + 5, (zeros / n_elements).to(ty))
        tl.store(out_ptr + 6, nans.to(ty))
        tl.store(out_ptr + 7, infs.to(ty))

    return _partials, _finalize


_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def stats_vector(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The eight statistics of a non-empty CUDA tensor ``x``, as a ``dtype`` vector (2 launches).

    Integer and bool tensors are cast to float32 first; other dtypes are read as they are.
    """
    import triton

    partials_kernel, finalize_kernel = _kernels()
    flat = x.reshape(-1)
    if flat.dtype not in _FLOATS:
        flat = flat.to(torch.float32)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    numel = flat.numel()
    tiles = triton.cdiv(numel, _BLOCK)
    programs = min(tiles, _programs(flat.device))
    per_program = triton.cdiv(tiles, programs)
    programs = triton.cdiv(tiles, per_program)
    part = torch.empty((programs, 9), dtype=torch.float64, device=flat.device)
    out = torch.empty(8, dtype=dtype, device=flat.device)
    partials_kernel[(programs,)](flat, part, numel, per_program, BLOCK=_BLOCK,
                                 WIDE=flat.dtype == torch.float64)
    finalize_kernel[(1,)](part, out, programs, numel,
                          PB=max(16, triton.next_power_of_2(programs)))
    return out


@functools.cache
def _programs(device: torch.device) -> int:
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return min(_MAX_PROGRAMS, 4 * sms)
