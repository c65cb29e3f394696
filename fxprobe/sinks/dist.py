"""Cross-rank views of taps under ``torch.distributed``: statistics, values, a logger.

Each rank's ``tapped.taps`` holds that rank's own values. These functions combine them; like
every collective, each must be called on every rank of the group, in the same order.

- :func:`reduce_stats`: ``{site: Stats}`` over all ranks, exactly (counts, sums, Chan's
  parallel variance), with one ``all_gather`` of a small float64 table for all sites.
- :func:`gather`: every rank's values on one rank, on the CPU.
- :class:`CrossRankStatsLogger`: the cross-rank table logged by one rank every N steps; no
  collective on the steps in between.

Example:
    >>> tapped = fxprobe.tap(model, ops=nn.ReLU, reduce="stats")
    >>> ddp = DDP(tapped)
    >>> loss = ddp(x).sum(); loss.backward()
    >>> stats = fxprobe.dist.reduce_stats(tapped)   # same on every rank
"""

from __future__ import annotations

import logging
import math
import weakref
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as tdist
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from ..capture.stats.math import Stats
from ..capture.stats.table import stats_table
from ..core.errors import ConfigError
from .statslog import EveryN

__all__ = ["CrossRankStatsLogger", "gather", "reduce_stats"]

_COLS = 12  # n_finite, mean, M2, min, max, absmax, zeros, nan, inf, numel, dim0, ran
_CHUNK = 1 << 22  # elements per float64 pass of _tensor_row (32 MiB of float64 temporaries)


def _values(source: Any) -> Mapping[str, Any]:
    """The last forward's values of a tapped module (also inside DDP/FSDP) or a mapping."""
    if isinstance(source, Mapping):
        return source
    for obj in (source, getattr(source, "module", None)):
        taps = getattr(obj, "taps", None)
        if taps is not None:
            return taps
    raise ConfigError(
        f"expected a tapped module (fxprobe.tap(...), possibly wrapped in DDP) or a mapping "
        f"of values; got {type(source).__name__}"
    )


def _check_initialized(what: str) -> None:
    if not (tdist.is_available() and tdist.is_initialized()):
        raise ConfigError(
            f"fxprobe.dist.{what} needs torch.distributed: call "
            "torch.distributed.init_process_group(...) first"
        )


def _device(group: Any) -> torch.device:
    """Where a collective's tensors must live for this group's backend."""
    backend = str(tdist.get_backend(group))
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _row(s: Stats) -> list[float]:
    n = s.numel - s.nan_count - s.inf_count
    m2 = s.std * s.std * (n - 1) if n >= 2 else 0.0
    dim0 = float(s.shape[0]) if s.shape else 1.0
    zeros = round(s.zero_frac * s.numel) if s.numel else 0  # an empty value's is NaN
    return [float(n), s.mean, m2, s.min, s.max, s.absmax, zeros,
            float(s.nan_count), float(s.inf_count), float(s.numel), dim0, 1.0]


def _tensor_row(t: torch.Tensor) -> torch.Tensor:
    """A tensor's row, computed in float64 on its device (no host sync): the count, mean and
    sum of squared deviations of its finite elements exactly enough that Chan's combination
    across ranks loses nothing to a float32 mean (two passes, in chunks of ``_CHUNK``)."""
    x = t.detach().reshape(-1)
    dim0 = float(t.shape[0]) if t.dim() else 1.0
    if x.numel() == 0:
        return torch.tensor([0.0] * 9 + [0.0, dim0, 1.0], dtype=torch.float64)
    f64 = torch.float64
    zero = torch.zeros((), dtype=f64, device=x.device)
    n, total, zeros, nan = zero.clone(), zero.clone(), zero.clone(), zero.clone()
    lo, hi, absmax = zero + math.inf, zero - math.inf, zero - math.inf
    for c in x.split(_CHUNK):
        c = c.to(f64)
        finite = torch.isfinite(c)
        n += finite.sum()
        total += torch.where(finite, c, 0.0).sum()
        zeros += (c == 0).sum()
        nan += torch.isnan(c).sum()
        lo = torch.minimum(lo, torch.where(finite, c, math.inf).min())
        hi = torch.maximum(hi, torch.where(finite, c, -math.inf).max())
        absmax = torch.maximum(absmax, torch.where(finite, c.abs(), -math.inf).max())
    mean = total / n.clamp(min=1)
    m2 = zero.clone()
    for c in x.split(_CHUNK):
        c = c.to(f64)
        d = torch.where(torch.isfinite(c), c - mean, 0.0)
        m2 += (d * d).sum()
    numel = float(x.numel())
    inf = numel - n - nan
    return torch.stack([n, mean, m2, lo, hi, absmax, zeros, nan, inf, zero + numel,
                        zero + dim0, zero + 1.0])


def _combine(rows: torch.Tensor, shape: tuple[int, ...], dtype: str) -> Stats:
    """Chan et al.'s parallel combination of (n, mean, M2) rows, plus min/max and counts."""
    r = rows.tolist()
    live = [x for x in r if x[0] > 0]
    n = sum(x[0] for x in live)
    numel = int(sum(x[9] for x in r))
    nan = float("nan")
    if n > 0:
        mean = sum(x[0] * x[1] for x in live) / n
        m2 = sum(x[2] + x[0] * (x[1] - mean) ** 2 for x in live)
        std = math.sqrt(m2 / (n - 1)) if n > 1 else nan
        lo, hi = min(x[3] for x in live), max(x[4] for x in live)
        absmax = max(x[5] for x in live)
    else:
        mean = std = lo = hi = absmax = nan
    zero_frac = sum(x[6] for x in r) / numel if numel else nan
    dim0 = int(sum(x[10] for x in r))
    tail = shape[1:]
    combined = (dim0, *tail) if shape and dim0 * math.prod(tail) == numel else (numel,)
    return Stats(shape=combined, dtype=dtype, numel=numel, mean=mean, std=std, min=lo, max=hi,
                 absmax=absmax, zero_frac=zero_frac, nan_count=int(sum(x[7] for x in r)),
                 inf_count=int(sum(x[8] for x in r)))


def reduce_stats(tapped: Any, group: Any = None) -> dict[str, Any]:
    """Statistics of every site over all ranks of ``group``, with one collective for all sites.

    Each rank contributes the last forward's values of ``tapped``: :class:`~fxprobe.Stats`
    (``reduce="stats"``, as precise as they are: float32 for float32 tensors), or tensors,
    whose count, mean and sum of squared deviations are computed here in float64.
    They are combined exactly as if one rank had seen every rank's tensor concatenated along
    dim 0: element counts, NaN/Inf counts, zeros, min/max, and mean and variance by Chan's
    parallel formula from each rank's (count, mean, sum of squared deviations), never a mean
    of means. One ``all_gather`` of a ``(values + 1) x 12`` float64 table per rank; the
    result is the same on every rank (a site that ran on some ranks only is in every rank's
    result, its shape and dtype sent by one more collective, made only then). The first call
    with a new set of sites (and every call on a rank that ran no forward) first compares the
    ranks' sites with a 3-float ``all_gather`` (a table of another size would abort gloo).

    Args:
        tapped: a tapped module (or DDP/FSDP wrapping one, or a ``{site: value}`` mapping).
        group: the process group (default: the world).

    Returns:
        ``{site name: Stats}`` for every site that ran on some rank, in the tapped module's
        site order (a site whose value is a tuple or ``InOut`` keeps that structure, with a
        ``Stats`` per tensor). ``Stats.shape`` is the ranks' shapes concatenated along dim 0
        (flattened to ``(numel,)`` when their trailing dimensions differ); ``dtype`` is this
        rank's (the first rank's that ran it, where it did not run here).

    Raises:
        ConfigError: torch.distributed is not initialized, some ranks ran no forward (they
            hold no values) while others did, or the ranks captured different sites
            (different models, or a branch taken on some ranks only).

    Example:
        >>> stats = fxprobe.dist.reduce_stats(tapped)
        >>> stats["layer1.0.relu"].mean
    """
    _check_initialized("reduce_stats")
    values = dict(_values(tapped).items())
    idle = 0.0 if values else 1.0  # this rank ran no forward (or was handed no values)
    flat = {name: tree_flatten(v) for name, v in values.items()}
    device = _device(group)
    # One row per leaf of every selected site, in site order, also for sites that did not run
    # here (an empty row): the table has the same size on every rank that taps the same sites.
    slots: list[tuple[str, int]] = []
    metas: _Meta = {}  # slot -> this rank's shape and dtype
    rows: list[torch.Tensor] = []
    for name in _site_names(tapped, values):
        leaves = flat[name][0] if name in flat else [None]
        for i, leaf in enumerate(leaves):
            k = len(slots)
            slots.append((name, i))
            if isinstance(leaf, Stats):
                metas[k] = (leaf.shape, leaf.dtype)
                rows.append(torch.tensor(_row(leaf), dtype=torch.float64))
            elif isinstance(leaf, torch.Tensor) and not leaf.is_complex():
                metas[k] = (tuple(leaf.shape), str(leaf.dtype))
                rows.append(_tensor_row(leaf))
            else:
                rows.append(torch.zeros(_COLS, dtype=torch.float64))
    crc = float(zlib.crc32(repr(slots).encode()))
    world = tdist.get_world_size(group)
    key = (id(group), len(slots), crc)
    verified = _verified(tapped)
    if idle or key not in verified:
        # An idle rank's layout is never recorded: after a call where every rank was idle,
        # the next has the ranks that ran verify a new layout, and so must the idle ones
        # (skipping it, they sent a table of another size and gloo aborted).
        _verify(len(slots), crc, idle, world, device, group)
        if not idle:
            verified.add(key)
    header = torch.tensor([float(len(slots)), crc, idle] + [0.0] * (_COLS - 3),
                          dtype=torch.float64)
    table = torch.stack([header.to(device)] + [r.to(device) for r in rows])
    out = torch.empty((world * table.shape[0], _COLS), dtype=torch.float64, device=device)
    _all_gather(out, table, group)  # the one collective
    per_rank = out.cpu().view(world, table.shape[0], _COLS)
    _check_idle(per_rank[:, 0, 2].tolist())
    if not all(torch.equal(per_rank[r, 0], per_rank[0, 0]) for r in range(world)):
        raise ConfigError(_DIFFERENT_SITES)
    ran = (per_rank[:, 1:, _COLS - 1] > 0).tolist()  # [rank][slot], the same on every rank
    some = [k for k in range(len(slots)) if any(r[k] for r in ran)]
    if any(not all(r[k] for r in ran) for k in some):
        # A site that ran on some ranks only: those that lack its shape and dtype get them
        # from the first rank that has them (a second collective, only in this case).
        metas = _share_metas(metas, ran, some, world, group)
    combined = {slots[k]: _combine(per_rank[:, k + 1], *metas[k]) for k in some}
    result: dict[str, Any] = {}
    for name in dict.fromkeys(n for n, _ in slots):
        if name in flat:
            leaves, spec = flat[name]
            new = [combined.get((name, i), leaf) for i, leaf in enumerate(leaves)]
            result[name] = tree_unflatten(new, spec)
        elif (name, 0) in combined:
            result[name] = combined[(name, 0)]
    return result


_Meta = dict[int, tuple[tuple[int, ...], str]]


def _share_metas(metas: _Meta, ran: list[list[bool]], some: list[int], world: int,
                 group: Any) -> _Meta:
    partial = [k for k in some if not all(r[k] for r in ran)]
    everyone: list[Any] = [None] * world
    tdist.all_gather_object(everyone, {k: metas[k] for k in partial if k in metas}, group=group)
    merged = dict(metas)
    for k in partial:
        if k not in merged:
            merged[k] = next(m[k] for m in everyone if k in m)
    return merged


_Layout = tuple[int, int, float]  # (id of the group, rows, crc of the rows' sites)
_VERIFIED: weakref.WeakKeyDictionary[Any, set[_Layout]] = weakref.WeakKeyDictionary()
_VERIFIED_VALUES: set[_Layout] = set()


def _verified(source: Any) -> set[_Layout]:
    """The layouts verified on every rank, per tapped module: a rank that ran no forward of a
    new tapped module (no sites yet under dynamo) verifies its layout as the others do, even
    where they verified the same sites of another tapped module before (a collective of
    another size would abort gloo). Mappings of values share one set."""
    for obj in (source, getattr(source, "module", None)):
        if obj is not None and not isinstance(obj, Mapping) and hasattr(obj, "taps"):
            return _VERIFIED.setdefault(obj, set())
    return _VERIFIED_VALUES
_DIFFERENT_SITES = (
    "fxprobe.dist.reduce_stats: the ranks captured different sites; every rank must tap the "
    "same model with the same ops= (and be in the same train/eval mode)"
)


def _site_names(source: Any, values: Mapping[str, Any]) -> list[str]:
    """The selected sites of a tapped module (also inside DDP), else the values' names."""
    for obj in (source, getattr(source, "module", None)):
        if obj is not None and not isinstance(obj, Mapping) and hasattr(obj, "taps"):
            names = [s.name for s in obj.sites]
            return names + [n for n in values if n not in set(names)]  # hook calls: name_1
    return list(values)


def _all_gather(out: torch.Tensor, inp: torch.Tensor, group: Any) -> None:
    # torch 2.13 renames all_gather_into_tensor (deprecated there) to all_gather_single.
    fn = getattr(tdist, "all_gather_single", None) or tdist.all_gather_into_tensor
    fn(out, inp, group=group)


def _verify(rows: int, crc: float, idle: float, world: int, device: torch.device,
            group: Any) -> None:
    """Compare the table layout of every rank once, with a fixed-size exchange.

    Collectives of different sizes abort gloo (and hang NCCL), so a layout is checked once
    before its first table is sent; later calls with a verified layout send the table alone.
    A rank that ran no forward (``idle``) knows no sites under dynamo: it is named as such.
    """
    mine = torch.tensor([float(rows), crc, idle], dtype=torch.float64, device=device)
    out = torch.empty(world * 3, dtype=torch.float64, device=device)
    _all_gather(out, mine, group)
    gathered = out.cpu().view(world, 3).tolist()
    _check_idle([g[2] for g in gathered])
    layouts = [g[:2] for g in gathered]
    differ = [r for r, layout in enumerate(layouts) if layout != layouts[0]]
    if differ:
        raise ConfigError(f"{_DIFFERENT_SITES} (ranks {differ} differ from rank 0; this rank "
                          f"has {rows} values)")


def _check_idle(idle: list[float]) -> None:
    """Refuse a reduction where some ranks ran no forward and others did (``idle`` per rank,
    the same list on every rank, so every rank raises the same error)."""
    none = [r for r, flag in enumerate(idle) if flag]
    if none and len(none) < len(idle):
        ran = [r for r, flag in enumerate(idle) if not flag]
        raise ConfigError(
            f"fxprobe.dist.reduce_stats: {_ranks(none)} ran no forward of the tapped module "
            f"(no values to reduce; {_ranks(ran)} did): call reduce_stats after a forward on "
            "every rank (a rank without data can run one on an empty batch)"
        )


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"


def gather(tapped: Any, names: Sequence[str] | str | None = None, dst: int = 0,
           group: Any = None) -> list[dict[str, Any]] | None:
    """Every rank's last-forward values, on rank ``dst``, on the CPU.

    Values are copied to the CPU on each rank and sent with ``torch.distributed.gather_object``
    (two collectives: sizes, then data); ``dst`` receives ``world size x`` the selected
    values, so select the sites you need.

    Args:
        tapped: a tapped module (or DDP/FSDP wrapping one, or a ``{site: value}`` mapping).
        names: the sites to gather (a name or a list); None: every site.
        dst: the rank that receives the values (a global rank).
        group: the process group (default: the world).

    Returns:
        On ``dst``, a list with one ``{site name: value}`` per rank of the group, in rank
        order, tensors on the CPU; ``None`` on the other ranks.

    Raises:
        ConfigError: torch.distributed is not initialized. UnknownSiteError /
        SiteNotRunError: a name that is not a site, or did not run, on this rank.

    Example:
        >>> per_rank = fxprobe.dist.gather(tapped, ["fc"])
        >>> if per_rank is not None: print([v["fc"].shape for v in per_rank])
    """
    _check_initialized("gather")
    values = _values(tapped)
    if names is None:
        selected = list(values)
    else:
        selected = [names] if isinstance(names, str) else list(names)
    mine = {n: tree_map(lambda v: v.detach().cpu() if isinstance(v, torch.Tensor) else v,
                        values[n]) for n in selected}
    rank = tdist.get_rank()
    out: list[Any] | None = [None] * tdist.get_world_size(group) if rank == dst else None
    tdist.gather_object(mine, out, dst=dst, group=group)
    return out


class CrossRankStatsLogger(EveryN):
    """Log the cross-rank statistics table on one rank every ``every`` steps.

    Call :meth:`step` on every rank after each forward (all ranks must call it equally
    often), or run the forward inside ``with stats_logger:``. On steps 0, N, 2N, ... every
    rank takes part in :func:`reduce_stats` (one collective) and rank ``dst`` logs
    :func:`~fxprobe.stats_table` through :mod:`logging` and calls ``sink``; on the other steps
    nothing happens: no collective, no device wait.

    Args:
        source: a tapped module (or DDP/FSDP wrapping one).
        every: log every this many steps (a positive int).
        group: the process group (default: the world).
        dst: the rank that logs.
        logger: a ``logging.Logger`` (default ``logging.getLogger("fxprobe")``).
        level: the logging level.
        fmt: a ``tabulate`` table format.
        sink: also called on rank ``dst`` as ``sink(step, stats)`` with the cross-rank
            :class:`~fxprobe.Stats` of every site (``fxprobe.TensorBoardSink``,
            ``fxprobe.CallbackSink``), whether or not ``logger`` is enabled.

    Example:
        >>> slog = fxprobe.dist.CrossRankStatsLogger(tapped, every=100)
        >>> for x, y in loader:
        ...     loss = loss_fn(ddp(x), y); loss.backward(); opt.step()
        ...     slog.step()
    """

    def __init__(self, source: Any, every: int = 100, group: Any = None, dst: int = 0,
                 logger: logging.Logger | None = None, level: int = logging.INFO,
                 fmt: str = "simple",
                 sink: Callable[[int, Mapping[str, Stats]], Any] | None = None) -> None:
        super().__init__(every, logger, level, fmt, sink)
        self.source = source
        self.group = group
        self.dst = dst
        self.last: dict[str, Any] | None = None
        """The statistics of the last logging step, or None."""

    def step(self) -> dict[str, Any] | None:
        """Count one step; on every ``every``-th (from the first) reduce, log and return."""
        return super().step()  # type: ignore[no-any-return]

    def _act(self, index: int) -> dict[str, Any]:
        # Every rank joins the collective, whatever its own logger's level.
        stats = reduce_stats(self.source, self.group)
        self.last = stats
        if tdist.get_rank() != self.dst:
            return stats
        flat = {k: v for k, v in stats.items() if isinstance(v, Stats)}
        if self.logger.isEnabledFor(self.level):
            world = tdist.get_world_size(self.group)
            self.logger.log(self.level, "fxprobe activation stats over %d ranks, step %d:\n%s",
                            world, index, stats_table(flat, self.fmt))
        if self.sink is not None:
            self.sink(index, flat)
        return stats

    def __enter__(self) -> CrossRankStatsLogger:
        return self
