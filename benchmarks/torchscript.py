"""TorchScript overhead: a tapped ScriptModule against the untapped one, interleaved in one process.

    python -m benchmarks.torchscript [--quick] [--rounds N] [--threads N] [--out DIR]

The model is the suite's ResNet-50 layout, scripted; every ``Conv2d`` call and every ``add``
(``out += identity``) is tapped (69 sites). Treatments, each timed against the untapped
ScriptModule by the suite's method (:mod:`benchmarks.timing`: rounds of ``B T1 B T2 B ...`` in
shuffled order, ratio to the mean of the two baseline slots beside it, medians over rounds):

- ``A/A control``: the untapped ScriptModule against itself (the noise floor);
- ``taps``: reference capture (a copy only where a later in-place op overwrites a value);
- ``taps, stats``: ``reduce="stats"`` (statistics of the values the graph returns, read once).

Forward hooks are not in the table: a ScriptModule has none to offer (Python hooks are refused
on a scripted module), which is why the taps are compiled into the graph. Writes
``torchscript.json`` and ``torchscript.md`` to ``--out`` (default ``benchmarks/results/cpu``).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

import fxprobe

from .models import ResNet50
from .timing import Treatment, calibrate, interleave, summarize, warm

_ROOT = Path(__file__).resolve().parent.parent


@dataclasses.dataclass(frozen=True)
class Row:
    """One treatment at one batch size, against the untapped ScriptModule."""

    model: str
    batch: int
    input_shape: str
    treatment: str
    sites: int
    """Tapped sites (0 for the control)."""
    copied: int
    """Sites copied because a later in-place op overwrites them."""
    rounds: int
    baseline_ms: float
    treatment_ms: float
    ratio: float
    ratio_q25: float
    ratio_q75: float
    overhead_ms: float


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _commit() -> str:
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=_ROOT, text=True,
                             capture_output=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "fxprobe"], cwd=_ROOT,
                               text=True, capture_output=True, check=True).stdout.strip()
        return sha + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def measure(batch: int, side: int, rounds: int, seed: int) -> list[Row]:
    torch.manual_seed(seed)
    model = ResNet50().eval()
    x = torch.randn(batch, 3, side, side)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        scripted = torch.jit.script(model)
    ops = [nn.Conv2d, torch.add]
    tapped = fxprobe.tap(scripted, ops=ops)
    stats = fxprobe.tap(scripted, ops=ops, reduce="stats")
    with torch.inference_mode():
        ref = scripted(x)
        if not torch.equal(tapped(x), ref):  # the benchmark times the right thing, or none
            raise RuntimeError("tapped ScriptModule output differs from the untapped one")

        def base() -> Any:
            return scripted(x)

        treatments = [
            Treatment("A/A control", base),
            Treatment("taps", lambda: tapped(x)),
            Treatment("taps, stats", lambda: (stats(x), stats.taps["conv1"])),
        ]
        iters, _ = calibrate(base, min_slot_s=0.05, warmup_s=1.0, cuda=False)
        warm(treatments, iters, cuda=False)
        samples = interleave(base, treatments, iters=iters, rounds=rounds, cuda=False,
                             seed=seed)
    rows = []
    for t in treatments:
        s = summarize(samples[t.key], cuda=False)
        which = {"taps": tapped, "taps, stats": stats}.get(t.key)
        rows.append(Row(
            "resnet50 (scripted)", batch, f"3x{side}^2 image", t.key,
            len(which.sites) if which is not None else 0,
            len(which.copied) if which is not None else 0, s.rounds, s.baseline_ms,
            s.treatment_ms, s.ratio, s.ratio_q25, s.ratio_q75,
            s.treatment_ms - s.baseline_ms))
    return rows


def markdown(rows: list[Row], env: dict[str, Any]) -> str:
    lines = [
        "# TorchScript: tapped ScriptModule vs the untapped one",
        "",
        f"{env['device_name']}, {env['threads']} thread(s) of {env['cpu_count']} "
        f"(shared machine), torch {env['torch_version']}, fxprobe {env['fxprobe_commit']}, "
        f"{env['date']}{' (quick run: not for quoting)' if env['quick'] else ''}.",
        "Every Conv2d and add of the ResNet-50 layout tapped; ratios are medians over "
        "interleaved rounds against the untapped ScriptModule (q25-q75 in brackets). "
        "Forward hooks cannot be put on a ScriptModule, so there is no hook row.",
        "",
        "| batch | treatment | sites | copied | untapped ms | tapped ms | ratio | rounds |",
        "|---:|---|---:|---:|---:|---:|---|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.batch} | {r.treatment} | {r.sites} | {r.copied} | {r.baseline_ms:.2f} | "
            f"{r.treatment_ms:.2f} | {r.ratio:.3f} [{r.ratio_q25:.3f}-{r.ratio_q75:.3f}] | "
            f"{r.rounds} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.torchscript",
                                description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--quick", action="store_true", help="64x64 images, 3 rounds (smoke test)")
    p.add_argument("--rounds", type=int, default=None, help="rounds per batch (default 15)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--batches", default="1,4", help="batch sizes (default 1,4)")
    p.add_argument("--out", type=Path, default=_ROOT / "benchmarks" / "results" / "cpu")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    rounds = args.rounds or (3 if args.quick else 15)
    side = 64 if args.quick else 224
    torch.set_num_threads(args.threads)
    env = {
        "device": "cpu", "device_name": _cpu_name(), "torch_version": torch.__version__,
        "fxprobe_commit": _commit(), "python_version": platform.python_version(),
        "platform": platform.platform(), "dtype": "float32",
        "threads": torch.get_num_threads(), "cpu_count": os.cpu_count() or 0,
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "quick": bool(args.quick),
    }
    rows: list[Row] = []
    for batch in (int(b) for b in args.batches.split(",")):
        print(f"resnet50 (scripted) batch {batch}, {side}x{side}, {rounds} rounds ...",
              file=sys.stderr, flush=True)
        rows += measure(batch, side, rounds, args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "torchscript.json").write_text(json.dumps(
        {"environment": env, "rows": [dataclasses.asdict(r) for r in rows]}, indent=1) + "\n")
    text = markdown(rows, env)
    (args.out / "torchscript.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
