"""fxprobe under torch.distributed: 2 gloo ranks on CPU, spawned once for the whole module.

Each scenario runs on both ranks inside one spawned job (starting processes is the slow part)
and checks itself against an independent reference: an untapped DDP/FSDP2 run, eager forward
hooks, numpy statistics of every rank's tensors concatenated. The tests below read each
scenario's verdict.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import math
import os
import socket
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as tdist
import torch.multiprocessing as mp
from reference import hook_values, same
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import fxprobe

WORLD = 2
# The collective reduce_stats makes (renamed in torch 2.13).
GATHER = "all_gather_single" if hasattr(tdist, "all_gather_single") else "all_gather_into_tensor"
# No deadline for the whole run: a loaded machine is slow, not wrong. A collective waits up to
# WAIT_S for the other rank (gloo's timeout: a rank that never comes is an error, not a hang),
# and the run is given up only when no scenario has finished for STALL_S.
WAIT_S = float(os.environ.get("FXPROBE_TEST_DIST_WAIT_S", "900"))
STALL_S = 2 * WAIT_S + 60


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x)) * self.scale


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def net() -> Net:
    torch.manual_seed(0)
    return Net()


def batch(rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(3 + 2 * rank, 8, generator=g)  # ranks see different batch sizes


def train(model: nn.Module, rank: int, steps: int = 3) -> list[list[torch.Tensor]]:
    """SGD steps on this rank's batches; the full parameters after each step."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    states = []
    for step in range(steps):
        model(batch(rank, step)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        states.append([p.full_tensor() if hasattr(p, "full_tensor") else p.detach().clone()
                       for p in model.parameters()])
    return states


# -- scenarios (run on every rank) ----------------------------------------------------------

def ddp_of_tapped(rank: int, tmp: Path) -> None:
    tapped = fxprobe.tap(net(), ops=["blocks.*.relu", "head"])
    got = train(DDP(tapped), rank)
    want = train(DDP(net()), rank)
    assert all(same(a, b) for a, b in zip(got, want, strict=True)), "parameters differ"
    # Each rank's taps are its own values: eager hooks on this rank's last batch.
    model = net()
    with torch.no_grad():
        for p, q in zip(model.parameters(), tapped.parameters(), strict=True):
            p.copy_(q)
        tapped(batch(rank, 9))
        _, ref = hook_values(model, ["head"], batch(rank, 9))
    assert torch.equal(tapped.taps["head"], ref["head"])
    assert tapped.taps["blocks.0.relu"].shape[0] == 3 + 2 * rank


def tap_of_ddp(rank: int, tmp: Path) -> None:
    ddp = DDP(net())
    tapped = fxprobe.tap(ddp, ops="module.head")
    got = train(tapped, rank)
    want = train(DDP(net()), rank)
    assert all(same(a, b) for a, b in zip(got, want, strict=True)), "parameters differ"
    assert tapped.taps["module.head"].shape == (3 + 2 * rank, 2)


def fsdp2(rank: int, tmp: Path) -> None:
    from torch.distributed.fsdp import fully_shard

    def sharded(kw: dict[str, Any] | None) -> nn.Module:
        model: nn.Module = fxprobe.tap(net(), **kw) if kw is not None else net()
        for block in model.blocks:  # type: ignore[union-attr]
            fully_shard(block)
        fully_shard(model)
        return model

    want = train(sharded(None), rank)
    for kw in ({"leaf_modules": [Block]}, {"tracer": "hooks"}, {}):
        model = sharded(kw)
        # fully_shard after tap() hooks blocks fxprobe had traced through: with nothing
        # said, it notices and traces again, each block a region of its own that is called
        # as a module (so FSDP's unshard hook runs), its ops still sites.
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = train(model, rank)
        assert all(same(a, b) for a, b in zip(got, want, strict=True)), f"{kw}: params differ"
        assert model.taps["blocks.1"].shape == (3 + 2 * rank, 8)  # type: ignore[operator]
        if not kw:
            assert any("traced again" in str(w.message) for w in caught)
            assert same(model.taps["blocks.1.mul"], model.taps["blocks.1"])  # type: ignore


def fsdp2_then_tap(rank: int, tmp: Path) -> None:
    """A model fully_shard-ed first, then tapped, under every tracer: site names as on the
    unsharded model, values as hooks on an unsharded copy see them, training as untapped."""
    from torch.distributed.fsdp import fully_shard

    def sharded() -> nn.Module:
        model = net()
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        return model

    x = batch(rank, 9)
    untapped = sharded()
    with torch.no_grad():
        untapped(x)
    want = train(untapped, rank)
    for tracer in ("auto", "dynamo", "hooks"):
        plain = fxprobe.tap(net(), tracer=tracer)
        plain(x)
        model = sharded()
        tapped = fxprobe.tap(model, tracer=tracer)
        with torch.no_grad():
            tapped(x)
        # Under dynamo each block's graph is told apart by its parameters, which FSDP2
        # swaps for unsharded ones during the forward: blocks.1's values once came out
        # named blocks.0.lin_1, blocks.0.relu_1...
        # The ops' names (a sharded block, a module with FSDP's hooks, is a region of its
        # own under fx: its input, its call and its attributes are named as such).
        def ops(t: Any) -> list[str]:
            return [s.name for s in t.sites if s.kind not in ("placeholder", "get_attr")
                    and s.name not in ("blocks.0", "blocks.1")]

        names, known = ops(tapped), ops(plain)
        if tracer == "dynamo":  # dynamo runs the sharded root's own code as written: no head
            known = [n for n in known if n.startswith("blocks.")]
        assert names == known, (tracer, names)
        shown = [n for n in names if n in dict(hook_targets(net()))]
        _, ref = hook_values(net(), shown, x)
        for n in shown:
            assert same(tapped.taps[n], ref[n]), (tracer, n)
        got = train(tapped, rank)
        assert all(same(a, b) for a, b in zip(got, want, strict=True)), f"{tracer}: params"


def fsdp2_transformer(rank: int, tmp: Path) -> None:
    """A Hugging Face model sharded per block, then tapped (dynamo, under tracer="auto"):
    each block's values under its own name, equal to hooks on an unsharded copy."""
    from torch.distributed.fsdp import fully_shard

    tf = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = tf.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=64)
    model, ref = tf.GPT2LMHeadModel(config).eval(), tf.GPT2LMHeadModel(config).eval()
    ref.load_state_dict(model.state_dict())
    for block in model.transformer.h:
        fully_shard(block)
    fully_shard(model)
    ids = torch.randint(0, 100, (2, 6), generator=torch.Generator().manual_seed(rank))
    names = [f"transformer.h.{i}.mlp.c_fc" for i in range(2)] + ["lm_head"]
    tapped = fxprobe.tap(model, ops=names)
    with torch.no_grad():
        out = tapped(ids)
        _, seen = hook_values(ref, names, ids)
        want = ref(ids)
    assert torch.allclose(out.logits, want.logits, atol=1e-6)
    assert sorted(tapped.taps) == sorted(names)
    for n in names:
        assert torch.allclose(tapped.taps[n], seen[n], atol=1e-6), n


def hook_targets(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(n, m) for n, m in model.named_modules() if n]


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
    slog = fxprobe.dist.StatsLogger(tapped, every=2, logger=log,
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


def worker(rank: int, port: int, tmp: str) -> None:
    torch.set_num_threads(1)
    tdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                             world_size=WORLD, timeout=datetime.timedelta(seconds=WAIT_S))
    out = Path(tmp) / f"rank{rank}.json"
    verdicts: dict[str, str] = {}
    try:
        for name, scenario in SCENARIOS.items():
            try:
                scenario(rank, Path(tmp))
                verdicts[name] = "ok"
            except Exception:  # noqa: BLE001 (reported by the test of that scenario)
                verdicts[name] = traceback.format_exc()
            out.with_suffix(".tmp").write_text(json.dumps(verdicts))
            out.with_suffix(".tmp").replace(out)  # whole, for the parent that reads it
            tdist.barrier()
    finally:
        tdist.destroy_process_group()


@pytest.fixture(scope="module")
def verdicts(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, str]]:
    if not tdist.is_available() or not tdist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    tmp = tmp_path_factory.mktemp("dist")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    ctx = mp.start_processes(worker, args=(port, str(tmp)), nprocs=WORLD, join=False,
                             start_method="spawn")
    files = [tmp / f"rank{r}.json" for r in range(WORLD)]

    def progress() -> list[int]:  # scenarios each rank has finished (its file, rewritten)
        return [len(json.loads(f.read_text())) if f.exists() else 0 for f in files]

    seen, since = progress(), time.monotonic()
    try:
        while not ctx.join(timeout=5):
            now = progress()
            if now != seen:
                seen, since = now, time.monotonic()
            elif time.monotonic() - since > STALL_S:
                running = [list(SCENARIOS)[n] if n < len(SCENARIOS) else "(the end)"
                           for n in seen]
                raise TimeoutError(
                    f"no scenario finished for {STALL_S:.0f} s; the ranks are in {running}: "
                    f"a hang (each collective waits {WAIT_S:.0f} s; FXPROBE_TEST_DIST_WAIT_S "
                    "raises it on a very slow machine)")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    found = []
    for r in range(WORLD):
        f = tmp / f"rank{r}.json"
        found.append(json.loads(f.read_text()) if f.exists() else {})
    return found


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_scenario_on_two_gloo_ranks(verdicts: list[dict[str, str]], scenario: str) -> None:
    for rank, v in enumerate(verdicts):
        assert v.get(scenario) == "ok", f"rank {rank}:\n{v.get(scenario, 'did not run')}"


def test_needs_an_initialized_process_group() -> None:
    assert not tdist.is_initialized()
    with pytest.raises(fxprobe.ConfigError, match="init_process_group"):
        fxprobe.dist.reduce_stats({})
    with pytest.raises(fxprobe.ConfigError, match="every must be"):
        fxprobe.dist.StatsLogger(nn.Linear(1, 1), every=0)
    with pytest.raises(fxprobe.ConfigError, match="sink must be callable"):
        fxprobe.dist.StatsLogger(nn.Linear(1, 1), sink="tensorboard")  # type: ignore[arg-type]


if __name__ == "__main__":  # python tests/test_dist.py: the scenarios, verbosely
    sys.exit(pytest.main([__file__, "-v"]))
