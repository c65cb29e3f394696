"""Summary statistics of captured tensors, computed on their device without stalling the host.

:func:`stats_vector` reduces a tensor to eight numbers. On an accelerator it runs tensor ops
only: no ``.item()``, no branching on values, nothing that waits for the device (on CUDA with
Triton: one fused kernel, :mod:`capture.stats.triton`). On a CPU, where reading a value waits
for nothing, it branches: an all-finite tensor (the common case) takes one pass of a numba
kernel (:mod:`capture.stats.numba`, large float tensors, numba installed) or four torch passes
and a few host operations (numpy for small tensors), and only a tensor with NaN or Inf pays for the
finite-only bookkeeping of the device path. :func:`stats_vectors` reduces many tensors with
few ops (small ones of one size stacked into a matrix). :class:`StatsBatch` stacks the vectors
of one forward and brings them to the host in a single transfer, the first time any is read.
:class:`StatsLogger` does that every N steps of a training loop and logs a table.

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

import inspect
import logging
import math
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ...core.errors import ConfigError
from . import cpu as _stats_cpu
from .cpu import sum_of_squares

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
    Triton kernel reads ``t`` once (:mod:`fxprobe.capture.stats.triton`); elsewhere about a dozen
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
    if x.is_cuda and not torch.compiler.is_compiling():
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
        TypeError: an element is not a tensor, or is complex.
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


def sample_vector(t: torch.Tensor, k: int, seed: int | torch.Generator | None = None
                  ) -> torch.Tensor:
    """A fixed-size uniform random sample of ``t``'s elements, as a new 1-D tensor.

    Elements are drawn independently, with replacement (O(k) work and memory however large
    ``t`` is); when ``t`` has at most ``k`` elements, all of them are kept, in order. Nothing
    synchronises with the device.

    Args:
        t: any tensor.
        k: the sample size, at least 1.
        seed: an int picks the positions by hashing ``(seed, position in the sample)``: the
            same positions for every tensor of the same size, drawn with tensor ops only, so
            ``torch.compile`` sees no generator and makes no graph break. A
            ``torch.Generator`` (on ``t``'s device) draws with ``torch.randint``; None uses
            the global generator.

    Returns:
        A detached 1-D tensor of ``min(k, t.numel())`` elements, of ``t``'s dtype and device.

    Raises:
        ConfigError: ``k`` is not a positive int.

    Example:
        >>> sample_vector(torch.arange(1000), 4, seed=0).shape
        torch.Size([4])
    """
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ConfigError(f"sample_vector(k={k!r}): k must be a positive int")
    flat = t.detach().reshape(-1)
    numel = flat.numel()
    if numel <= k:
        return flat.clone()
    if isinstance(seed, int):
        idx = hashed_positions(numel, k, seed, t.device)
    else:
        idx = torch.randint(numel, (k,), generator=seed, device=t.device)
    return flat[idx]


_MASK32 = 0xFFFFFFFF


def _hash32(x: torch.Tensor) -> torch.Tensor:
    # A 32-bit integer mixer (xor-shift-multiply); int64 arithmetic never overflows here.
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _MASK32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _MASK32
    return (x >> 16) ^ x


def hashed_positions(numel: int, k: int, seed: int, device: torch.device) -> torch.Tensor:
    """``k`` pseudo-random positions in ``[0, numel)``, a pure function of ``(numel, k, seed)``."""
    i = torch.arange(k, device=device, dtype=torch.int64)
    base = (seed * 2 + 1) & _MASK32
    hi = _hash32((i * 2 + base) & _MASK32)
    lo = _hash32((i * 2 + 1 + base * 3) & _MASK32)
    return ((hi << 31) | (lo >> 1)) % numel


class StatsBatch(Mapping[str, Stats]):
    """The stats of several tensors of one forward: one device tensor, fetched once.

    The vectors stay on the device, stacked into one ``(k, 8)`` tensor (one per device if the
    values live on several); shapes and dtypes are kept on the host. The first read of any site
    (or :meth:`fetch`) copies the stack to the host in one transfer and caches the result.

    Example:
        >>> batch = StatsBatch.from_tensors({"a": a, "b": b})  # no synchronisation here
        >>> batch["a"].mean                                    # one transfer, for both
    """

    def __init__(self, names: Sequence[str], vectors: Sequence[torch.Tensor],
                 shapes: Sequence[tuple[int, ...]], dtypes: Sequence[str]) -> None:
        if not len(names) == len(vectors) == len(shapes) == len(dtypes):
            raise ValueError(
                f"StatsBatch needs as many names ({len(names)}), vectors ({len(vectors)}), "
                f"shapes ({len(shapes)}) and dtypes ({len(dtypes)})"
            )
        self._names = tuple(names)
        self._shapes = tuple(tuple(s) for s in shapes)
        self._dtypes = tuple(dtypes)
        groups: dict[torch.device, list[int]] = {}
        for i, v in enumerate(vectors):
            groups.setdefault(v.device, []).append(i)
        self._stacks: list[tuple[list[int], torch.Tensor]] = []
        for rows in groups.values():
            vecs = [vectors[i] for i in rows]
            wide = any(v.dtype == torch.float64 for v in vecs)  # host-side metadata only
            dtype = torch.float64 if wide else torch.float32
            self._stacks.append((rows, torch.stack([v.to(dtype) for v in vecs])))
        self._fetched: dict[str, Stats] | None = None

    @classmethod
    def from_tensors(cls, values: Mapping[str, torch.Tensor]) -> StatsBatch:
        """The stats of each tensor (:func:`stats_vectors`, per device), without synchronising."""
        names = list(values)
        tensors = [values[n] for n in names]
        by_device: dict[torch.device, list[int]] = {}
        for i, t in enumerate(tensors):
            by_device.setdefault(t.device, []).append(i)
        vectors: list[torch.Tensor] = [torch.empty(0)] * len(tensors)
        for members in by_device.values():
            rows = stats_vectors([tensors[i] for i in members])
            for i, row in zip(members, rows.unbind(0), strict=True):
                vectors[i] = row
        return cls(names, vectors, [tuple(t.shape) for t in tensors],
                   [str(t.dtype) for t in tensors])

    @property
    def stacked(self) -> torch.Tensor:
        """The ``(k, 8)`` device tensor, rows in name order (all values on one device)."""
        if len(self._stacks) != 1:
            raise ValueError(
                f"this batch spans {len(self._stacks)} devices, so it has no single stack; "
                "use fetch()"
            )
        return self._stacks[0][1]

    def fetch(self) -> dict[str, Stats]:
        """Copy the stack to the host (once, then cached) and return ``{name: Stats}``."""
        if self._fetched is None:
            rows: list[list[float]] = [[] for _ in self._names]
            for indices, stack in self._stacks:
                host = stack.cpu().tolist()  # the one synchronisation (per device)
                for i, row in zip(indices, host, strict=True):
                    rows[i] = row
            self._fetched = {
                name: _make_stats(shape, dtype, row)
                for name, shape, dtype, row in zip(self._names, self._shapes, self._dtypes, rows,
                                                   strict=True)
            }
        return self._fetched

    def __getitem__(self, name: str) -> Stats:
        if name not in self._names:
            raise KeyError(name)
        return self.fetch()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def __contains__(self, name: object) -> bool:
        return name in self._names

    def __repr__(self) -> str:
        state = "fetched" if self._fetched is not None else "on device"
        return f"StatsBatch({len(self._names)} sites, {state})"


def _make_stats(shape: tuple[int, ...], dtype: str, row: Sequence[float]) -> Stats:
    mean, std, lo, hi, absmax, zero_frac, nan_count, inf_count = row
    return Stats(shape=shape, dtype=dtype, numel=math.prod(shape), mean=mean, std=std, min=lo,
                 max=hi, absmax=absmax, zero_frac=zero_frac, nan_count=int(nan_count),
                 inf_count=int(inf_count))


_HEADERS = ("site", "shape", "dtype", "mean", "std", "min", "max", "absmax", "zeros %", "nan",
            "inf")


def stats_table(stats: Mapping[str, Stats], fmt: str = "simple") -> str:
    """A text table of ``{site: Stats}``, one row per site, in the mapping's order.

    Args:
        stats: site name -> :class:`Stats` or tensor (a :class:`StatsBatch` is fetched;
            tensors are summarised with :func:`stats_vector`, as ``tapped.taps`` holds them).
        fmt: any ``tabulate`` table format (``"simple"``, ``"github"``, ``"plain"`` ...).

    Raises:
        ConfigError: a value is neither Stats nor a real tensor.

    Returns:
        The table; columns site, shape, dtype, mean, std, min, max, absmax, zeros %, nan, inf.

    Example:
        >>> print(stats_table(StatsBatch.from_tensors(tapped.taps)))
    """
    from tabulate import tabulate

    if not all(isinstance(v, Stats) for v in stats.values()):
        bad = [f"{n!r} ({type(v).__name__}{', complex' if isinstance(v, torch.Tensor) else ''})"
               for n, v in stats.items() if not isinstance(v, Stats) and not (
                   isinstance(v, torch.Tensor) and not v.is_complex())]
        if bad:
            raise ConfigError(
                f"stats_table needs Stats or real tensors as values; got {', '.join(bad)}")
        stats = collect(stats)
    rows = []
    for name, s in stats.items():
        shape = "x".join(map(str, s.shape)) if s.shape else "scalar"
        rows.append([name, shape, s.dtype.removeprefix("torch."), s.mean, s.std, s.min, s.max,
                     s.absmax, 100.0 * s.zero_frac, s.nan_count, s.inf_count])
    return tabulate(rows, headers=_HEADERS, tablefmt=fmt,
                    floatfmt=("", "", "", ".4g", ".4g", ".4g", ".4g", ".4g", ".1f", "", ""),
                    disable_numparse=[0, 1, 2])


StatsSource = Callable[[], Mapping[str, Any]]


class _EveryN:
    """Counts steps and acts on steps 0, N, 2N, ...: the loop shared by the stats loggers
    (this module's and :class:`fxprobe.dist.StatsLogger`). Subclasses implement
    :meth:`_act`."""

    def __init__(self, every: int, logger: logging.Logger | None, level: int, fmt: str,
                 sink: Callable[[int, Mapping[str, Stats]], Any] | None) -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ConfigError(f"StatsLogger(every={every!r}): every must be a positive int")
        if sink is not None and not callable(sink):
            raise ConfigError(f"StatsLogger(sink={sink!r}): sink must be callable as "
                              "sink(step, stats)")
        self.every = every
        self.logger = logger if logger is not None else logging.getLogger("fxprobe")
        self.level = level
        self.fmt = fmt
        self.sink = sink
        """Also called as ``sink(step, stats)`` on logging steps (``fxprobe.TensorBoardSink``,
        ``fxprobe.CallbackSink``), whether or not ``logger`` is enabled."""
        self.count = 0
        """How many steps have been taken."""

    def step(self) -> Any:
        """Count one step; on every ``every``-th (from the first) log and return the stats."""
        index = self.count
        self.count += 1
        if index % self.every:
            return None
        return self._act(index)

    def _act(self, index: int) -> Any:
        raise NotImplementedError

    def __call__(self) -> Any:
        return self.step()

    def __enter__(self) -> Any:
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if exc_type is None:
            self.step()


class StatsLogger(_EveryN):
    """Log a table of activation statistics every ``every`` steps of a training loop.

    Call :meth:`step` (or the logger itself) once after each forward, or run the forward inside
    ``with stats_logger:``. On steps 0, N, 2N, ... it reads the source and logs
    :func:`stats_table` through :mod:`logging`; on the other steps it does nothing at all, so
    the device is never waited for in between. Nothing is read when the logger would drop the
    record anyway and there is no ``sink``. A ``sink`` (:class:`fxprobe.TensorBoardSink`,
    :class:`fxprobe.CallbackSink`, or any ``sink(step, stats)``) also receives the stats.

    ``source`` is an object with a ``taps`` mapping (a tapped module) or a zero-argument callable
    returning one. Its values may be :class:`Stats` or tensors; tensors are summarised with
    :func:`stats_vector` and fetched in one transfer. Other values are skipped.

    Example:
        >>> slog = fxprobe.StatsLogger(tapped, every=100)
        >>> for x, y in loader:
        ...     loss = loss_fn(tapped(x), y); loss.backward(); opt.step()
        ...     slog.step()
    """

    def __init__(self, source: Any, every: int = 100, logger: logging.Logger | None = None,
                 level: int = logging.INFO, fmt: str = "simple",
                 sink: Callable[[int, Mapping[str, Stats]], Any] | None = None) -> None:
        super().__init__(every, logger, level, fmt, sink)
        # getattr_static: a ``taps`` property must not run (and maybe synchronise) here.
        if inspect.getattr_static(source, "taps", None) is not None:
            self._read: StatsSource = lambda: source.taps
        elif callable(source):
            self._read = source
        else:
            raise ConfigError(
                f"StatsLogger needs an object with a .taps mapping (a tapped module) or a "
                f"zero-argument callable returning a mapping; got {type(source).__name__}"
            )
        self.last: Mapping[str, Stats] | None = None
        """The statistics logged last, or None."""
        self._warned = False

    def step(self) -> Mapping[str, Stats] | None:
        """Count one step; on every ``every``-th (from the first) log and return the stats."""
        return super().step()  # type: ignore[no-any-return]

    def _act(self, index: int) -> Mapping[str, Stats] | None:
        log = self.logger.isEnabledFor(self.level)
        if self.sink is None and not self._warned and not _reaches_a_handler(self.logger,
                                                                            self.level):
            self._warned = True
            warnings.warn(
                f"StatsLogger: logger {self.logger.name!r} drops {logging.getLevelName(self.level)}"
                f" records (its level is {logging.getLevelName(self.logger.getEffectiveLevel())}"
                ", or no handler takes them), so nothing is logged"
                f"{'' if log else ' and step() returns None'}; call logging.basicConfig("
                "level=logging.INFO) or give the logger a handler, or pass a level it keeps "
                "(level=logging.WARNING) or a sink=", stacklevel=4)
        if not log and self.sink is None:
            return None
        stats = collect(self._read())
        self.last = stats
        if log:
            self.logger.log(self.level, "fxprobe activation stats, step %d:\n%s", index,
                            stats_table(stats, self.fmt))
        if self.sink is not None:
            self.sink(index, stats)
        return stats

    def __enter__(self) -> StatsLogger:
        return self


def _reaches_a_handler(logger: logging.Logger, level: int) -> bool:
    """Whether a record of ``level`` would reach a handler, as ``Logger.callHandlers`` does
    (handler filters aside): Python's last-resort handler takes only WARNING and above."""
    if not logger.isEnabledFor(level):
        return False
    any_handler = False
    current: logging.Logger | None = logger
    while current is not None:
        for h in current.handlers:
            any_handler = True
            if level >= h.level:
                return True
        current = current.parent if current.propagate else None
    last = logging.lastResort
    return not any_handler and last is not None and level >= last.level


def collect(values: Mapping[str, Any]) -> Mapping[str, Stats]:
    """``{name: Stats}`` from a mapping of Stats and/or tensors (others dropped), one transfer."""
    ready: dict[str, Stats] = {}
    tensors: dict[str, torch.Tensor] = {}
    order = []
    for name, v in values.items():
        if isinstance(v, Stats):
            ready[name] = v
        elif isinstance(v, torch.Tensor) and not v.is_complex():
            tensors[name] = v
        else:
            continue
        order.append(name)
    if not tensors:
        return ready
    fetched = StatsBatch.from_tensors(tensors).fetch()
    return {name: ready[name] if name in ready else fetched[name] for name in order}
