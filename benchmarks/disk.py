"""fxprobe.Disk on this machine: write throughput against the raw disk, forward slowdown,
peak memory against the queue bound.

Run ``python -m benchmarks.disk`` (``--quick`` for a smoke run); it writes
``benchmarks/results/cpu/disk.json`` and ``disk.md``. Everything is measured in one run, in
interleaved rounds (raw disk, Disk, raw disk, ...), medians over rounds:

- raw: the same bytes written with large ``write`` calls and one ``fsync`` per shard-sized
  file, in the same directory: the disk's speed as this process sees it.
- disk-bound: one real forward's captures (the 53 ``Conv2d`` outputs of a ResNet-50-shaped
  model at batch 32) handed to ``Disk.write`` repeatedly with no model in between, so the
  writer is the bottleneck; bytes per second from the first write to ``close()``.
- forward: the bare model, ``to="cpu"`` (values kept in memory) and ``to=Disk`` per forward.
- memory: in a fresh process, fresh 64 MiB forwards handed as fast as they can be made, with
  the default bounded queue and with an unbounded one; peak RSS above the baseline.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

import fxprobe

from .models import ResNet50

RESULTS = Path(__file__).resolve().parent / "results" / "cpu"
MIB = 2**20


def captures(side: int, batch: int) -> tuple[nn.Module, torch.Tensor, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = ResNet50().eval()
    x = torch.randn(batch, 3, side, side)
    with torch.no_grad():
        tapped = fxprobe.tap(model, ops=nn.Conv2d)
        tapped(x)
        values = dict(tapped.taps.items())
    return model, x, values


def raw_write(path: Path, values: dict[str, torch.Tensor], repeats: int, shard: int) -> float:
    """Seconds to write ``repeats`` copies of the values' bytes, fsync per ``shard`` bytes."""
    path.mkdir(parents=True, exist_ok=True)
    buffers = [t.reshape(-1).view(torch.uint8).numpy() for t in values.values()]
    start = time.perf_counter()
    f, written, n = None, 0, 0
    for _ in range(repeats):
        for b in buffers:
            if f is None:
                f = open(path / f"raw-{n}.bin", "wb")  # noqa: SIM115
                n += 1
            f.write(b)
            written += b.nbytes
            if written >= shard:
                f.flush()
                os.fsync(f.fileno())
                f.close()
                f, written = None, 0
    if f is not None:
        f.flush()
        os.fsync(f.fileno())
        f.close()
    return time.perf_counter() - start


def disk_write(path: Path, values: dict[str, torch.Tensor], repeats: int, shard: int) -> float:
    disk = fxprobe.Disk(path, shard_size=shard, mode="overwrite")
    start = time.perf_counter()
    for _ in range(repeats):
        disk.write(values)
    disk.close()
    return time.perf_counter() - start


def forward_times(model: nn.Module, x: torch.Tensor, where: Path, rounds: int, per: int
                  ) -> dict[str, list[float]]:
    disk = fxprobe.Disk(where, mode="overwrite")
    variants: dict[str, Any] = {
        "bare": model,
        "to_cpu": fxprobe.tap(model, ops=nn.Conv2d, to="cpu"),
        "to_disk": fxprobe.tap(model, ops=nn.Conv2d, to=disk),
    }
    times: dict[str, list[float]] = {k: [] for k in variants}
    with torch.no_grad():
        for v in variants.values():
            v(x)  # warm-up
        disk.flush()
        rng = random.Random(0)
        for _ in range(rounds):
            keys = list(variants)
            rng.shuffle(keys)
            for key in keys:
                for _ in range(per):
                    start = time.perf_counter()
                    variants[key](x)
                    times[key].append(time.perf_counter() - start)
            disk.flush()  # untimed: the next round starts with an empty queue
    variants["to_disk"].remove()
    return times


def peak_rss_kib() -> int:
    """This process's peak RSS. /proc's VmHWM starts afresh at exec; ru_maxrss would carry
    the peak of the (large) parent that forked this process."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def memory_child(path: str, queue: int, forwards: int, size_mib: int) -> None:
    """In a fresh process: peak RSS growth while handing fresh forwards to a Disk."""
    unbounded = queue == 0
    disk = fxprobe.Disk(path, mode="overwrite", shard_size="256MiB",
                        queue=10**6 if unbounded else queue,
                        queue_bytes="1TiB" if unbounded else "1GiB")
    numel = size_mib * MIB // 4
    torch.full((numel,), 1.0)  # allocator and page-fault warm-up
    base = peak_rss_kib()
    start = time.perf_counter()
    for i in range(forwards):
        disk.write({"value": torch.full((numel,), float(i))})
    handed = time.perf_counter() - start
    disk.close()
    total = time.perf_counter() - start
    peak = peak_rss_kib()
    print(json.dumps({"peak_growth_mib": (peak - base) / 1024, "handed_s": handed,
                      "total_s": total}))


def memory(where: Path, queue: int, forwards: int, size_mib: int) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.disk", "--memory-child", str(where), str(queue),
         str(forwards), str(size_mib)],
        capture_output=True, text=True, timeout=600, check=True,
        cwd=Path(__file__).resolve().parent.parent)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default=None, help="where to write (default: a temp directory)")
    ap.add_argument("--side", type=int, default=112, help="image side (224: full ResNet-50)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=4, help="rounds of the throughput part")
    ap.add_argument("--fwd-rounds", type=int, default=8, help="rounds of the forward part")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--memory-child", nargs=4, metavar=("DIR", "QUEUE", "N", "MIB"))
    args = ap.parse_args(argv)
    if args.memory_child:
        d, q, n, mib = args.memory_child
        memory_child(d, int(q), int(n), int(mib))
        return
    if args.quick:
        args.side, args.batch, args.rounds, args.fwd_rounds = 32, 4, 2, 2
    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="fxprobe-disk-"))
    base.mkdir(parents=True, exist_ok=True)
    shard = 256 * MIB
    try:
        model, x, values = captures(args.side, args.batch)
        per_forward = sum(t.nbytes for t in values.values())
        repeats = max(2, (2 * 2**30) // per_forward) if not args.quick else 3
        raw_s, disk_s = [], []
        for r in range(args.rounds):  # ABBA: neither side always runs first
            for kind in (("raw", "disk") if r % 2 == 0 else ("disk", "raw")):
                if kind == "raw":
                    raw_s.append(raw_write(base / "raw", values, repeats, shard))
                else:
                    disk_s.append(disk_write(base / "disk", values, repeats, shard))
                shutil.rmtree(base / kind)
        total = per_forward * repeats
        raw_mbs = total / statistics.median(raw_s) / 1e6
        disk_mbs = total / statistics.median(disk_s) / 1e6
        load_before = os.getloadavg()
        times = forward_times(model, x, base / "fwd", args.fwd_rounds, 1)
        load_after = os.getloadavg()
        shutil.rmtree(base / "fwd")
        med = {k: statistics.median(v) for k, v in times.items()}
        n_mem, mib = (4, 8) if args.quick else (24, 64)
        mem = {"bounded_queue_4": memory(base / "mem", 4, n_mem, mib),
               "unbounded": memory(base / "mem", 0, n_mem, mib)}
        shutil.rmtree(base / "mem", ignore_errors=True)
    finally:
        if not args.dir:
            shutil.rmtree(base, ignore_errors=True)
    record = {
        "what": "fxprobe.Disk: throughput vs raw disk, forward slowdown, peak memory",
        "machine": {"python": platform.python_version(), "torch": torch.__version__,
                    "cpus": os.cpu_count(), "threads": torch.get_num_threads(),
                    "platform": platform.platform()},
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                 text=True).stdout.strip(),
        "model": f"ResNet50 (benchmarks.models), batch {args.batch}, {args.side}x{args.side}, "
                 f"53 Conv2d outputs",
        "bytes_per_forward": per_forward,
        "disk_bound": {"bytes": total, "raw_s": raw_s, "disk_s": disk_s,
                       "raw_MBps": raw_mbs, "disk_MBps": disk_mbs,
                       "fraction_of_raw": disk_mbs / raw_mbs,
                       "best_raw_MBps": total / min(raw_s) / 1e6,
                       "best_disk_MBps": total / min(disk_s) / 1e6},
        "forward_s": times,
        "forward_median_s": med,
        "disk_vs_cpu": med["to_disk"] / med["to_cpu"],
        "disk_vs_cpu_per_round": [d / c for d, c in zip(times["to_disk"], times["to_cpu"],
                                                        strict=True)],
        "loadavg_before_after_forwards": [load_before, load_after],
        "cpu_vs_bare": med["to_cpu"] / med["bare"],
        "memory": {"forward_mib": mib, "forwards": n_mem, **mem},
        "quick": args.quick,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    name = "disk-quick" if args.quick else "disk"
    (RESULTS / f"{name}.json").write_text(json.dumps(record, indent=1))
    md = markdown(record)
    (RESULTS / f"{name}.md").write_text(md)
    print(md)


def markdown(r: dict[str, Any]) -> str:
    d, m, mem = r["disk_bound"], r["forward_median_s"], r["memory"]
    lines = [
        f"### fxprobe.Disk ({r['model']}; torch {r['machine']['torch']}, "
        f"{r['machine']['cpus']} CPUs, commit {r['commit']})",
        "",
        f"Captures per forward: {r['bytes_per_forward'] / MIB:.0f} MiB.",
        "",
        "| measurement | value |",
        "|---|---|",
        f"| raw disk write (same bytes, fsync per 256 MiB), median / best | "
        f"{d['raw_MBps']:.0f} / {d['best_raw_MBps']:.0f} MB/s |",
        f"| Disk, writer-bound (no model between writes), median / best | "
        f"{d['disk_MBps']:.0f} / {d['best_disk_MBps']:.0f} MB/s "
        f"({100 * d['fraction_of_raw']:.0f}% / "
        f"{100 * d['best_disk_MBps'] / d['best_raw_MBps']:.0f}% of raw) |",
        f"| forward, bare model | {m['bare']:.2f} s |",
        f"| forward, `to=\"cpu\"` (in memory) | {m['to_cpu']:.2f} s |",
        f"| forward, `to=Disk` | {m['to_disk']:.2f} s ({r['disk_vs_cpu']:.3f}x `to=\"cpu\"`) |",
        f"| peak RSS growth, {mem['forwards']} x {mem['forward_mib']} MiB forwards, "
        f"queue=4 | {mem['bounded_queue_4']['peak_growth_mib']:.0f} MiB |",
        f"| same, unbounded queue | {mem['unbounded']['peak_growth_mib']:.0f} MiB |",
        "",
        f"Throughput: medians of {len(d['raw_s'])} interleaved rounds; raw s "
        f"{fmt(d['raw_s'])}, Disk s {fmt(d['disk_s'])}. Forwards: medians of "
        f"{len(r['forward_s']['bare'])} rounds (shuffled order); `to=Disk` / `to=\"cpu\"` "
        f"per round: {fmt(r['disk_vs_cpu_per_round'])}; load average before/after "
        f"{r['loadavg_before_after_forwards'][0][0]:.1f}/"
        f"{r['loadavg_before_after_forwards'][1][0]:.1f}.",
    ]
    return "\n".join(lines) + "\n"


def fmt(xs: list[float]) -> str:
    return ", ".join(f"{x:.2f}" for x in xs)


if __name__ == "__main__":
    main()
