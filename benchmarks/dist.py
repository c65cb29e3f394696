"""Cross-rank statistics on 2 gloo ranks (CPU): the per-step cost of ``fxprobe.dist``.

Run ``python -m benchmarks.dist`` (``--quick`` for a smoke run); it writes
``benchmarks/results/cpu/dist.json`` and ``dist.md``. Two processes, one thread each, train the
benchmark MLP (784-512-512-256-10, batch 64) under DDP with SGD. Per training step, in
interleaved rounds (every configuration once per round, after a barrier; a slot's time is the
slowest rank's):

- ``ddp``: the untapped model;
- ``tapped``: ``DDP(fxprobe.tap(model, reduce="stats"))`` with nothing read;
- ``local/N``: plus ``fxprobe.StatsLogger`` every N steps (this rank's statistics only);
- ``dist/N``: plus ``fxprobe.dist.StatsLogger`` every N steps (all ranks', one collective).

Then one read in isolation, interleaved: the first read of a forward's statistics on this
rank (``tapped.taps``) against ``fxprobe.dist.reduce_stats`` (slowest rank's time).
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import platform
import socket
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as tdist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

import fxprobe

from .models import MLP

RESULTS = Path(__file__).resolve().parent / "results" / "cpu"
WORLD = 2


def worker(rank: int, port: int, out: str, rounds: int, steps: int, every: list[int],
           reads_n: int) -> None:
    torch.set_num_threads(1)
    tdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                             world_size=WORLD, timeout=datetime.timedelta(seconds=120))
    log = logging.getLogger(f"fxprobe.bench.{rank}")
    log.setLevel(logging.INFO)
    log.addHandler(logging.NullHandler())  # records are built and formatted, then dropped
    log.propagate = False
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(64, 784, generator=g), torch.randint(0, 10, (64,), generator=g)

    def make(kind: str, n: int = 0) -> Any:
        torch.manual_seed(0)
        model = MLP()
        if kind == "ddp":
            ddp = DDP(model)
            return ddp, None
        tapped = fxprobe.tap(model, reduce="stats")
        ddp = DDP(tapped)
        if kind == "local":
            return ddp, fxprobe.StatsLogger(tapped, every=n, logger=log)
        if kind == "dist":
            return ddp, fxprobe.dist.StatsLogger(tapped, every=n, logger=log)
        return ddp, None

    configs: dict[str, Any] = {"ddp": make("ddp"), "tapped": make("tapped")}
    for n in every:
        configs[f"local/{n}"] = make("local", n)
        configs[f"dist/{n}"] = make("dist", n)
    opts = {k: torch.optim.SGD(m.parameters(), lr=0.01) for k, (m, _) in configs.items()}
    loss_fn = torch.nn.CrossEntropyLoss()

    def slot(key: str, count: int) -> float:
        model, logger = configs[key]
        opt = opts[key]
        tdist.barrier()
        start = time.perf_counter()
        for _ in range(count):
            loss_fn(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            if logger is not None:
                logger.step()
        elapsed = torch.tensor([time.perf_counter() - start])
        tdist.all_reduce(elapsed, op=tdist.ReduceOp.MAX)
        return float(elapsed) / count

    for key in configs:  # warm-up (and the first reduce's layout check)
        slot(key, 5)
    per_step: dict[str, list[float]] = {k: [] for k in configs}
    for r in range(rounds):
        order = list(configs)
        if r % 2:
            order.reverse()
        for key in order:
            per_step[key].append(slot(key, steps))
    # One read in isolation: a forward, then the first read of its statistics (which
    # resolves them), this rank's alone or all ranks' (one collective), interleaved.
    model, _ = configs["tapped"]
    tapped = model.module
    reads: dict[str, list[float]] = {"local_read": [], "cross_rank_read": []}
    for i in range(2 * reads_n):
        with torch.no_grad():
            tapped(x)
        key = "local_read" if i % 2 == 0 else "cross_rank_read"
        tdist.barrier()
        start = time.perf_counter()
        if key == "local_read":
            dict(tapped.taps.items())
        else:
            fxprobe.dist.reduce_stats(tapped)
        elapsed = torch.tensor([time.perf_counter() - start])
        tdist.all_reduce(elapsed, op=tdist.ReduceOp.MAX)
        reads[key].append(float(elapsed))
    if rank == 0:
        Path(out).write_text(json.dumps({**per_step, **reads}))
    tdist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    every = [1, 10, 100]
    if args.quick:
        args.rounds, args.steps, every = 2, 10, [1, 10]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    out = Path(os.environ.get("TMPDIR", "/tmp")) / f"fxprobe-dist-bench-{os.getpid()}.json"
    mp.start_processes(worker, args=(port, str(out), args.rounds, args.steps, every,
                                     10 if args.quick else 200),
                       nprocs=WORLD, start_method="spawn")
    per_step = json.loads(out.read_text())
    out.unlink()
    med = {k: statistics.median(v) for k, v in per_step.items()}
    record = {
        "what": "per-step cost of cross-rank vs single-rank stats, 2 gloo ranks, CPU",
        "machine": {"python": platform.python_version(), "torch": torch.__version__,
                    "cpus": os.cpu_count(), "threads_per_rank": 1,
                    "platform": platform.platform()},
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                 text=True).stdout.strip(),
        "model": "MLP 784-512-512-256-10 (benchmarks.models), batch 64 per rank, SGD, DDP",
        "sites": len(fxprobe.tap(MLP(), reduce="stats").sites),
        "rounds": args.rounds, "steps_per_slot": args.steps,
        "per_step_s": per_step, "median_per_step_s": med,
        "quick": args.quick,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    name = "dist-quick" if args.quick else "dist"
    (RESULTS / f"{name}.json").write_text(json.dumps(record, indent=1))
    md = markdown(record, every)
    (RESULTS / f"{name}.md").write_text(md)
    print(md)


def markdown(r: dict[str, Any], every: list[int]) -> str:
    m = r["median_per_step_s"]
    ms = {k: 1e3 * v for k, v in m.items()}
    lines = [
        f"### fxprobe.dist on {WORLD} gloo ranks ({r['model']}, {r['sites']} sites; torch "
        f"{r['machine']['torch']}, {r['machine']['cpus']} CPUs, commit {r['commit']})",
        "",
        f"Untapped DDP step: {ms['ddp']:.2f} ms; tapped with `reduce=\"stats\"`, nothing read: "
        f"{ms['tapped']:.2f} ms.",
        "",
        "| stats read every N steps | single-rank (`fxprobe.StatsLogger`) | cross-rank "
        "(`fxprobe.dist.StatsLogger`) | cross-rank extra per step |",
        "|---|---|---|---|",
    ]
    for n in every:
        loc, dis = ms[f"local/{n}"], ms[f"dist/{n}"]
        lines.append(f"| {n} | {loc:.2f} ms | {dis:.2f} ms | {dis - loc:+.3f} ms |")
    lines += ["", f"Medians over {r['rounds']} interleaved rounds of {r['steps_per_slot']} "
              "steps; a slot's time is the slower rank's.", "",
              f"One read after a forward, median of {len(r['per_step_s']['local_read'])} "
              f"(interleaved): this rank's statistics {1e3 * m['local_read']:.3f} ms, all "
              f"ranks' (`fxprobe.dist.reduce_stats`) {1e3 * m['cross_rank_read']:.3f} ms."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
