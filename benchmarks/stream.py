"""Streaming activations into training: ``fxprobe.ActivationStream`` against the forward alone,
and a tiny SAE trained end to end from the stream and from the Disk reader. Everything is
measured in one run; medians of interleaved rounds.

Run ``python -m benchmarks.stream`` (``--quick`` for a smoke run); it writes
``benchmarks/results/cpu/stream.json`` and ``stream.md``.

- model: a GPT-2 layout built from a config (random weights), batch x seq tokens per forward;
  one site, ``blocks.{k}.resid_post`` (canonical name), one row per token.
- throughput, per round of ``--forwards`` forwards (rows/s = tokens/s): (a) the model alone,
  untapped, and tapped (what the tap costs by itself); (b) the stream with a trainer that
  only takes the batch (the fastest trainer); (c) the same while the tapped module writes
  every forward to ``fxprobe.Disk``.
- a tiny SAE (width -> 4 x width, ReLU, Adam; loss = MSE + 1e-3 L1): rows/s of its step alone
  on batches already in memory, of the stream feeding it, of the Disk reader alone
  (``DataLoader(ds, batch_size=None, sampler=fxprobe.RowSampler(ds, B))``) and feeding it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

import fxprobe

RESULTS = Path(__file__).resolve().parent / "results" / "cpu"


def gpt2(layers: int, width: int, heads: int) -> nn.Module:
    from transformers import GPT2Config, GPT2Model

    torch.manual_seed(0)
    config = GPT2Config(n_layer=layers, n_embd=width, n_head=heads, vocab_size=50257,
                        n_positions=1024)
    return GPT2Model(config).eval()


class SAE(nn.Module):
    def __init__(self, d: int, k: int = 4) -> None:
        super().__init__()
        self.enc = nn.Linear(d, k * d)
        self.dec = nn.Linear(k * d, d)

    def step(self, x: torch.Tensor, opt: torch.optim.Optimizer) -> float:
        codes = torch.relu(self.enc(x))
        loss = (self.dec(codes) - x).pow(2).mean() + 1e-3 * codes.abs().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return float(loss.detach())


def timed(fn: Callable[[], int]) -> float:
    """Rows per second of ``fn`` (which returns the rows it handled)."""
    t = time.perf_counter()
    rows = fn()
    return rows / (time.perf_counter() - t)


def consume(batches: Iterable[torch.Tensor], step: Callable[[torch.Tensor], Any] | None,
            limit: int | None = None) -> int:
    rows = 0
    for i, b in enumerate(batches):
        if limit is not None and i >= limit:
            break
        if step is not None:
            step(b)
        rows += len(b)
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--block", type=int, default=6, help="the block whose output is read")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--forwards", type=int, default=8, help="forwards per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rows", type=int, default=4096, help="rows per training batch")
    ap.add_argument("--buffer", type=int, default=4, help="forwards in the mixing buffer")
    ap.add_argument("--sae-steps", type=int, default=4, help="SAE steps timed per round")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    if args.quick:
        args.layers, args.width, args.heads, args.seq, args.block = 2, 128, 4, 32, 1
        args.forwards, args.rounds, args.rows, args.sae_steps = 6, 2, 256, 3
    base = Path(tempfile.mkdtemp(prefix="fxprobe-stream-"))
    site = f"blocks.{args.block}.resid_post"
    try:
        model = gpt2(args.layers, args.width, args.heads)
        g = torch.Generator().manual_seed(0)
        inputs = [{"input_ids": torch.randint(0, 50257, (args.batch, args.seq), generator=g)}
                  for _ in range(args.forwards)]
        tapped = fxprobe.tap(model, ops=site)
        disk = fxprobe.Disk(base / "acts", fsync=False)
        writing = fxprobe.tap(model, ops=site, to=disk)
        with torch.no_grad():  # captured outside the timing
            tapped(**inputs[0])
            writing(**inputs[0])
            disk.flush()
        sae = SAE(args.width)
        opt = torch.optim.Adam(sae.parameters(), lr=1e-4)

        def sae_step(x: torch.Tensor) -> None:
            sae.step(x, opt)

        def stream(t: Any) -> fxprobe.ActivationStream:
            return fxprobe.ActivationStream(t, site, inputs, batch_size=args.rows,
                                            buffer=args.buffer, seed=0)

        def forward_alone() -> int:
            with torch.no_grad():
                for kw in inputs:
                    model(**kw)
            return args.forwards * args.batch * args.seq

        def tapped_alone(t: Any) -> int:
            with torch.no_grad():
                for kw in inputs:
                    t(**kw)
            return args.forwards * args.batch * args.seq

        held = [torch.randn(args.rows, args.width) for _ in range(args.sae_steps)]
        kinds: dict[str, Callable[[], int]] = {
            "forward_alone": forward_alone,
            "tapped_alone": lambda: tapped_alone(tapped),
            "stream": lambda: consume(stream(tapped), None),
            "stream_and_disk": lambda: consume(stream(writing), None) + (disk.flush() or 0),
            "sae_step_alone": lambda: consume(held, sae_step),
            "stream_into_sae": lambda: consume(stream(tapped), sae_step, args.sae_steps),
        }
        load = [os.getloadavg()[0]]
        rates: dict[str, list[float]] = {k: [] for k in kinds}
        order = list(kinds)
        for r in range(args.rounds):
            for k in order[r % len(order):] + order[:r % len(order)]:
                rates[k].append(timed(kinds[k]))
        writing.remove()
        caps = fxprobe.open_captures(base / "acts")
        ds = caps.dataset(site)

        def reader(step: Callable[[torch.Tensor], Any] | None, limit: int | None) -> int:
            loader = DataLoader(ds, batch_size=None,
                                sampler=fxprobe.RowSampler(ds, args.rows, seed=0))
            return consume(loader, step, limit)

        for k in ("disk_reader", "disk_reader_into_sae"):
            rates[k] = []
        for r in range(args.rounds):
            both = [("disk_reader", lambda: reader(None, None)),
                    ("disk_reader_into_sae", lambda: reader(sae_step, args.sae_steps))]
            for k, fn in both[r % 2:] + both[:r % 2]:
                rates[k].append(timed(fn))
        load.append(os.getloadavg()[0])
        disk_rows = len(ds)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in rates.items()}
    record = {
        "what": "streaming activations into training vs the forward alone; a tiny SAE",
        "machine": {"python": platform.python_version(), "torch": torch.__version__,
                    "cpus": os.cpu_count(), "threads": torch.get_num_threads(),
                    "platform": platform.platform(), "device": "cpu (not run on a GPU)"},
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                 text=True).stdout.strip(),
        "model": f"GPT-2 layout from a config: {args.layers} blocks, width {args.width}, "
                 f"batch {args.batch} x {args.seq} tokens; site {site}",
        "rows_per_batch": args.rows, "buffer_forwards": args.buffer,
        "forwards_per_round": args.forwards, "disk_rows": disk_rows,
        "rows_per_s": rates, "median_rows_per_s": med,
        "stream_vs_forward": med["stream"] / med["forward_alone"],
        "stream_vs_tapped": med["stream"] / med["tapped_alone"],
        "stream_and_disk_vs_forward": med["stream_and_disk"] / med["forward_alone"],
        "loadavg_before_after": load, "quick": args.quick,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = "stream-quick" if args.quick else "stream"
    (RESULTS / f"{out}.json").write_text(json.dumps(record, indent=1))
    md = markdown(record)
    (RESULTS / f"{out}.md").write_text(md)
    print(md)


def markdown(r: dict[str, Any]) -> str:
    m = r["median_rows_per_s"]
    f = m["forward_alone"]
    labels = {
        "forward_alone": "the model alone (untapped), rows = tokens",
        "tapped_alone": "the tapped model alone (no stream)",
        "stream": "`ActivationStream`, a trainer that only takes the batch",
        "stream_and_disk": "the same, tapped with `to=fxprobe.Disk` (every forward written)",
        "sae_step_alone": "tiny SAE step alone (batches in memory)",
        "stream_into_sae": "`ActivationStream` feeding the SAE",
        "disk_reader": "Disk reader: `DataLoader(ds, None, sampler=RowSampler(ds, B))`",
        "disk_reader_into_sae": "Disk reader feeding the SAE",
    }
    lines = [f"### Streaming into training ({r['model']}; torch {r['machine']['torch']}, "
             f"{r['machine']['cpus']} CPUs, CPU only: not run on a GPU; commit {r['commit']})",
             "", f"Batches of {r['rows_per_batch']} rows, a buffer of {r['buffer_forwards']} "
             "forwards.", "", "| what | rows/s (median) | x the model alone |", "|---|---|---|"]
    for k, label in labels.items():
        lines.append(f"| {label} | {m[k]:,.0f} | {m[k] / f:.2f} |")
    lines += ["", f"Medians of {len(r['rows_per_s']['stream'])} interleaved rounds; load "
              f"average before/after {r['loadavg_before_after'][0]:.1f}/"
              f"{r['loadavg_before_after'][1]:.1f} (a shared machine)."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
