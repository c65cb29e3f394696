"""The scenarios tests/test_dist.py runs on 2 gloo ranks, each checking itself against an
independent reference (an untapped DDP/FSDP2 run, eager forward hooks, numpy statistics of
every rank's tensors concatenated), run by tests/gloo_job.py in one spawned job."""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as tdist
from dist_training import (
    WORLD,
    batch,
    ddp_of_tapped,
    fsdp2,
    fsdp2_then_tap,
    fsdp2_transformer,
    net,
    tap_of_ddp,
)
from reference import hook_values, same
from torch import nn

import fxprobe

# The collective reduce_stats makes (renamed in torch 2.13).
GATHER = "all_gather_single" if hasattr(tdist, "all_gather_single") else "all_gather_into_tensor"


@contextlib.contextmanager
def counting_collectives() -> Iterator[list[int]]:
    """Count the all-gathers this rank makes (one entry each) while the block runs."""
    calls: list[int] = []
    real = getattr(tdist, GATHER)

    def counted(*a: Any, **k: Any) -> Any:
        calls.append(1)
        return real(*a, **k)

    setattr(tdist, GATHER, counted)
    try:
        yield calls
    finally:
        setattr(tdist, GATHER, real)


def _np_stats(t: np.ndarray) -> dict[str, float]:
    fin = t[np.isfinite(t)]
    return {"mean": fin.mean(), "std": fin.std(ddof=1), "min": fin.min(), "max": fin.max(),
            "absmax": np.abs(fin).max(), "zero_frac": (t == 0).mean(),
            "nan_count": np.isnan(t).sum(), "inf_count": np.isinf(t).sum()}


def reduce_stats(rank: int, tmp: Path) -> None:
    def poisoned(r: int) -> torch.Tensor:
        x = batch(r, 0) * 3
        x[0, r] = float("nan")
        x[1, 2 + r] = float("inf") if r else -float("inf")
        return x

    model = net()
    tapped = fxprobe.tap(model, ops=["x", "blocks.*.relu", "head"], reduce="stats")
    with torch.no_grad():
        tapped(poisoned(rank))
    with counting_collectives() as calls:
        first = fxprobe.dist.reduce_stats(tapped)  # compares the ranks' sites, then reduces
        calls.clear()
        got = fxprobe.dist.reduce_stats(tapped)
    assert len(calls) == 1, f"{len(calls)} collectives"
    assert first == got
    refs: dict[str, list[np.ndarray]] = {}
    for r in range(WORLD):  # every rank's tensors, recomputed here
        with torch.no_grad():
            _, hooked = hook_values(model, ["blocks.0.lin", "blocks.1.lin", "head"],
                                    poisoned(r))
        values = {"x": poisoned(r), "head": hooked["head"]}
        for i in range(2):
            values[f"blocks.{i}.relu"] = torch.relu(hooked[f"blocks.{i}.lin"])
        for name, v in values.items():
            refs.setdefault(name, []).append(v.double().numpy())
    assert list(got) == ["x", "blocks.0.relu", "blocks.1.relu", "head"]
    for name, parts in refs.items():
        whole = np.concatenate(parts)
        s = got[name]
        assert s.shape == whole.shape and s.numel == whole.size, (name, s.shape)
        for field, value in _np_stats(whole).items():
            assert np.isclose(getattr(s, field), value, rtol=2e-6, atol=1e-6), (
                name, field, getattr(s, field), value)
    everyone: list[Any] = [None] * WORLD
    tdist.all_gather_object(everyone, got)
    assert everyone[0] == everyone[1], "ranks disagree"
    # Ranks that captured different sites get an error on every rank, neither a wrong table
    # nor a collective of mismatched sizes (which aborts gloo).
    one = fxprobe.Stats((1,), "torch.float32", 1, *[0.0] * 6, 0, 0)
    for mine in ({f"site{rank}": one}, {f"site{i}": one for i in range(rank + 1)}):
        try:
            fxprobe.dist.reduce_stats(mine)
        except fxprobe.ConfigError as e:
            assert "different sites" in str(e)
        else:
            raise AssertionError("different sites were combined")


def _torch_stats(t: torch.Tensor) -> dict[str, float]:
    t = t.double()
    fin = t[torch.isfinite(t)]
    return {"mean": fin.mean().item(), "std": fin.std().item(), "min": fin.min().item(),
            "max": fin.max().item(), "absmax": fin.abs().max().item(),
            "zero_frac": (t == 0).double().mean().item(), "nan_count": int(t.isnan().sum()),
            "inf_count": int(t.isinf().sum())}


class Ragged(nn.Module):
    """``relu`` is empty where the batch is; ``mul`` is empty on every rank."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = torch.relu(self.lin(x))
        return y, y[:, :0] * 2


def reduce_stats_of_empty_values(rank: int, tmp: Path) -> None:
    # Rank 0's batch is empty; rank 1's has a NaN (one row of relu) and exact zeros (relu).
    x = torch.empty(0, 8) if rank == 0 else batch(1, 0)
    if rank == 1:
        x[2, 3] = float("nan")
    model = Ragged()
    with torch.no_grad():
        ref = torch.relu(model.lin(batch(1, 0)))  # the non-empty data: rank 1's
    ref[2] = float("nan")
    want = _torch_stats(ref)
    assert want["zero_frac"] > 0 and want["nan_count"] == 4
    for kw in ({"reduce": "stats"}, {}):  # Stats, and tensors summarised by reduce_stats
        tapped = fxprobe.tap(model, ops=["relu", "mul"], **kw)
        with torch.no_grad():
            tapped(x)
        got = fxprobe.dist.reduce_stats(tapped)
        s = got["relu"]
        assert s.shape == (5, 4) and s.numel == 20, (kw, s)
        for field, value in want.items():
            assert math.isclose(getattr(s, field), value, rel_tol=2e-6, abs_tol=1e-6), (
                kw, field, getattr(s, field), value)
        # Empty everywhere: the empty row of docs/distributed.md, the statistics of an empty
        # tensor (NaN but the two counts), shaped as the ranks' values concatenated.
        e = got["mul"]
        assert e.shape == (5, 0) and e.numel == 0, (kw, e)
        assert e.nan_count == 0 and e.inf_count == 0, (kw, e)
        for field in ("mean", "std", "min", "max", "absmax", "zero_frac"):
            assert math.isnan(getattr(e, field)), (kw, field, e)
        everyone: list[Any] = [None] * WORLD
        tdist.all_gather_object(everyone, repr(got))  # repr: NaN != NaN
        assert everyone[0] == everyone[1], "ranks disagree"


def gather(rank: int, tmp: Path) -> None:
    tapped = fxprobe.tap(net(), ops=["head", "blocks.0.relu"], capture="both")
    with torch.no_grad():
        tapped(batch(rank, 5))
    got = fxprobe.dist.gather(tapped, ["head"], dst=1)
    if rank != 1:
        assert got is None
        return
    assert got is not None and len(got) == WORLD
    model = net()
    for r, values in enumerate(got):
        with torch.no_grad():
            _, ref = hook_values(model, ["head"], batch(r, 5))
        assert list(values) == ["head"]
        assert torch.equal(values["head"].output, ref["head"])


def stats_logger(rank: int, tmp: Path) -> None:
    tapped = fxprobe.tap(net(), ops="head", reduce="stats")
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    log = logging.getLogger(f"fxprobe.test.{rank}")
    log.setLevel(logging.INFO)
    log.addHandler(Keep())
    sunk: list[tuple[int, dict[str, Any]]] = []
    slog = fxprobe.dist.CrossRankStatsLogger(tapped, every=2, logger=log,
                                    sink=lambda i, stats: sunk.append((i, dict(stats))))
    per_step = []
    with counting_collectives() as calls:
        for step in range(5):
            if step == 4:  # the context-manager spelling counts a step on exit
                with slog, torch.no_grad():
                    tapped(batch(rank, step))
            else:
                with torch.no_grad():
                    tapped(batch(rank, step))
                slog.step()
            per_step.append(len(calls))
            calls.clear()
    assert per_step == [2, 0, 1, 0, 1], per_step  # the first also compares the ranks' sites
    assert len(records) == (3 if rank == 0 else 0)
    assert [i for i, _ in sunk] == ([0, 2, 4] if rank == 0 else [])  # the sink: rank dst only
    if rank == 0:
        assert "over 2 ranks, step 4" in records[-1].getMessage()
        numel = sum(batch(r, 4).shape[0] for r in range(WORLD)) * 2
        assert slog.last is not None and slog.last["head"].numel == numel
        assert sunk[-1][1]["head"] == slog.last["head"]  # the same cross-rank Stats


def disk(rank: int, tmp: Path) -> None:
    model = net()
    ref = fxprobe.tap(model, keep="all")
    with torch.no_grad(), fxprobe.tap(model, to=fxprobe.Disk(tmp / "acts")) as tapped:
        for step in range(3):
            ref(batch(rank, step))
            tapped(batch(rank, step))
    tdist.barrier()
    for r in range(WORLD):
        caps = fxprobe.open_captures(tmp / "acts", rank=r)
        assert len(caps) == 3
        if r == rank:
            for i, frame in enumerate(ref.history):
                assert all(same(caps.forward(i)[n], v) for n, v in frame.items())


SCENARIOS: dict[str, Callable[[int, Path], None]] = {
    f.__name__: f for f in (ddp_of_tapped, tap_of_ddp, fsdp2, fsdp2_then_tap,
                            fsdp2_transformer, reduce_stats, gather,
                            stats_logger, disk, reduce_stats_of_empty_values)
}



def reduce_stats_in_float64(rank: int, tmp: Path) -> None:
    # Large means and a small spread: a per-rank mean rounded to float32 (eps 0.06 at 1e6)
    # would shift the between-rank term of Chan's formula by ~0.4% of the variance.
    def values(r: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(r)
        return torch.randn(4096, generator=g) + 1e6 + r

    got = fxprobe.dist.reduce_stats({"v": values(rank)})["v"]
    whole = np.concatenate([values(r).double().numpy() for r in range(WORLD)])
    assert math.isclose(got.mean, whole.mean(), rel_tol=1e-12), (got.mean, whole.mean())
    assert math.isclose(got.std, whole.std(ddof=1), rel_tol=1e-9), (got.std, whole.std(ddof=1))
    assert got.numel == whole.size and got.shape == (WORLD * 4096,)


class Branch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.ReLU()
        self.b = nn.Tanh()

    def forward(self, x: torch.Tensor, flag: bool) -> torch.Tensor:
        y = self.a(x)
        return self.b(y) if flag else y


def reduce_stats_of_sites_run_on_some_ranks(rank: int, tmp: Path) -> None:
    def x(r: int) -> torch.Tensor:
        return torch.arange(6.0).reshape(2, 3) - 2 + 10 * r

    tapped = fxprobe.tap(Branch(), tracer="hooks")
    tapped(x(rank), rank == 0)  # b runs on rank 0 only
    got = fxprobe.dist.reduce_stats(tapped)
    assert list(got) == ["a", "b"], list(got)
    a = torch.cat([torch.relu(x(r)) for r in range(WORLD)])
    b = torch.tanh(torch.relu(x(0)))
    for s, ref in ((got["a"], a), (got["b"], b)):
        assert s.shape == tuple(ref.shape) and s.dtype == "torch.float32", s
        for field, value in _torch_stats(ref).items():
            assert math.isclose(getattr(s, field), value, rel_tol=1e-9, abs_tol=1e-12), (
                field, getattr(s, field), value)
    everyone: list[Any] = [None] * WORLD
    tdist.all_gather_object(everyone, got)
    assert everyone[0] == everyone[1], "ranks disagree"


def reduce_stats_where_a_rank_ran_no_forward(rank: int, tmp: Path) -> None:
    """Rank 1 has not run the tapped module yet: every rank is told so (rank 1 tapped the same
    sites, which it may not know yet under dynamo), and after its forward the reduction runs."""
    for kw in ({"reduce": "stats"}, {"tracer": "dynamo"}):  # sites known / not yet known
        tapped = fxprobe.tap(net(), ops=["blocks.*.relu", "head"], **kw)
        if rank == 0:
            with torch.no_grad():
                tapped(batch(0, 7))
        try:
            fxprobe.dist.reduce_stats(tapped)
        except fxprobe.ConfigError as e:
            said = str(e)
            assert "rank 1 ran no forward of the tapped module" in said, (kw, said)
            assert "rank 0 did" in said and "different sites" not in said, (kw, said)
        else:
            raise AssertionError(f"{kw}: reduced without rank 1")
        if rank == 1:
            with torch.no_grad():
                tapped(batch(1, 7))
        got = fxprobe.dist.reduce_stats(tapped)  # the ranks are still in step
        want = torch.cat([net()(batch(r, 7)) for r in range(WORLD)]).detach()
        assert got["head"].numel == want.numel(), (kw, got["head"])
        assert math.isclose(got["head"].mean, want.double().mean().item(), rel_tol=1e-6), kw


SCENARIOS.update({f.__name__: f for f in (reduce_stats_in_float64,
                                          reduce_stats_of_sites_run_on_some_ranks,
                                          reduce_stats_where_a_rank_ran_no_forward)})

