"""``python -m benchmarks.instructions``: the dynamo frontend's cost counted in instructions.

Wall-clock costs of a few microseconds per site drown in the noise of a shared machine; the
number of instructions a call executes does not. This runs each treatment of
``python -m benchmarks.dynamo`` (the same GPT-2 layout, batch 1, one torch thread) in a process
of its own under valgrind's callgrind, counts the instructions of ``b`` steady calls and of ``a``
steady calls after warm-up, and takes ``(count_b - count_a) / (b - a)`` per call, so that
starting and stopping the count cancels out:

- ``bare``: the eager model;
- ``hooks``: a forward hook on every module, keeping a reference to its output;
- ``taps (one site)`` and ``taps``: ``tracer="dynamo"`` with one site and with every attention
  softmax, matmul and add.

Instructions per tapped site = (taps - taps (one site)) / (sites - 1); per hooked call =
(hooks - bare) / module calls. Instructions are not time: a cache miss costs hundreds of cycles
and counts as one instruction, so ``--cache-sim`` also reports callgrind's simulated last-level
cache misses. Needs valgrind (``apt-get install valgrind``); runs about five minutes on 2 cores.
Writes ``instructions.json`` and ``instructions.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parent
TREATMENTS = ("bare", "hooks", "taps (one site)", "taps")
_EVENTS = ("Ir", "D1mr", "D1mw", "DLmr", "DLmw")


def _control(*args: str) -> None:
    """Send callgrind a command about this process; poll, since valgrind reads commands only
    while the process it runs is executing (not while it waits for a child)."""
    proc = subprocess.Popen(["callgrind_control", *args, str(os.getpid())],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while proc.poll() is None:
        time.sleep(0.01)
    if proc.returncode:
        raise SystemExit(f"callgrind_control {' '.join(args)} failed ({proc.returncode})")


def child(treatment: str, layers: int, seq: int, a: int, b: int, out: Path) -> None:
    """Under callgrind: build ``treatment``, warm it up, count ``a`` then ``b`` calls."""
    import torch
    import torch.nn.functional as F

    import fxprobe

    from .dynamo import HookAll, gpt2

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    model = gpt2(layers)
    ids = torch.randint(2, 100, (1, seq), generator=torch.Generator().manual_seed(0))
    run: Any = model
    sites = 0
    with torch.no_grad():
        if treatment == "hooks":
            hooks = HookAll(model)
            sites = hooks.count(lambda: model(input_ids=ids))
            hooks.enter()
        elif treatment.startswith("taps"):
            ops: Any = [F.softmax, torch.matmul, torch.add]
            if treatment == "taps (one site)":
                ops = "transformer.h.0.attn.softmax"
            run = fxprobe.tap(model, ops=ops, tracer="dynamo")
        for _ in range(3):
            run(input_ids=ids)
        if treatment.startswith("taps"):
            sites = len(run.taps)
        _control("-i", "on")
        for _ in range(3):  # callgrind's simulated caches start cold: fill them first
            run(input_ids=ids)
        for n in (a, b):
            _control("-z")
            for _ in range(n):
                run(input_ids=ids)
            _control("-d")
        _control("-i", "off")
    out.write_text(json.dumps({"sites": sites}))


def _totals(path: Path) -> dict[str, int]:
    """The event totals of one callgrind dump file."""
    text = path.read_text()
    events = re.search(r"^events:\s*(.+)$", text, re.M)
    totals = re.search(r"^(?:summary|totals):\s*(.+)$", text, re.M)
    if events is None or totals is None:
        raise SystemExit(f"{path}: not a callgrind dump")
    return {e: int(v)
            for e, v in zip(events.group(1).split(), totals.group(1).split(), strict=True)}


def measure(treatment: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    tag = re.sub(r"\W+", "_", treatment)
    info = work / f"{tag}.json"
    cmd = ["valgrind", "--tool=callgrind", "--instr-atstart=no",
           f"--callgrind-out-file={work}/{tag}.%p",
           *(["--cache-sim=yes"] if args.cache_sim else []),
           *([f"--LL={args.ll}"] if args.ll else []),
           sys.executable, "-m", "benchmarks.instructions", "--child", treatment,
           "--layers", str(args.layers), "--seq", str(args.seq), "--calls",
           f"{args.calls[0]},{args.calls[1]}", "--info", str(info)]
    done = subprocess.run(cmd, cwd=_ROOT.parent, capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"{treatment}: valgrind run failed:\n{done.stderr[-2000:]}")
    dumps = sorted((p for p in work.glob(f"{tag}.*") if re.search(r"\.\d+\.\d+$", p.name)),
                   key=lambda p: int(p.name.rsplit(".", 1)[1]))
    if len(dumps) < 2:
        raise SystemExit(f"{treatment}: expected two callgrind dumps, found {len(dumps)}")
    first, second = _totals(dumps[0]), _totals(dumps[1])
    a, b = args.calls
    per_call = {e: (second[e] - first[e]) / (b - a) for e in first}
    return {"treatment": treatment, "sites": json.loads(info.read_text())["sites"],
            "per_call": per_call}


def markdown(env: dict[str, Any], args: argparse.Namespace, rows: dict[str, dict[str, Any]],
             derived: dict[str, Any]) -> str:
    events = [e for e in _EVENTS if e in rows["bare"]["per_call"]]
    lines = [
        "# Dynamo frontend in instructions: GPT-2 layout, taps vs hooks (cpu, callgrind)", "",
        f"- torch {env['torch']}, transformers {env['transformers']}, Python {env['python']}, "
        f"commit {env['commit']}, {env['run']}",
        f"- GPT2LMHeadModel, {args.layers} layers, hidden 32, eager attention; batch 1, "
        f"sequence {args.seq}; one torch thread; per call = (count of {args.calls[1]} calls - "
        f"count of {args.calls[0]} calls) / {args.calls[1] - args.calls[0]}", "",
        "| treatment | values/call | " + " | ".join(f"{e} per call" for e in events) + " |",
        "|---|---|" + "---|" * len(events),
    ]
    for t in TREATMENTS:
        r = rows[t]
        lines.append(f"| {t} | {r['sites']} | "
                     + " | ".join(f"{r['per_call'][e]:,.0f}" for e in events) + " |")
    lines += ["", "| per | " + " | ".join(events) + " |", "|---|" + "---|" * len(events)]
    for what in ("per tapped site", "per hooked module call"):
        lines.append(f"| {what} | " + " | ".join(f"{derived[what][e]:,.1f}" for e in events)
                     + " |")
    lines += ["", f"Instructions per tapped site / per hooked module call: "
              f"**{derived['ratio_Ir']:.3f}**", ""]
    if "DLmr" in events:
        level = (f"a last level of {args.ll} (size, ways, line), set with `--ll`" if args.ll
                 else "this machine's first and last levels")
        lines += ["Cache misses (`D1mr`/`D1mw`: first-level data reads/writes; `DLmr`/`DLmw`: "
                  f"last level) are callgrind's simulation of {level}, not hardware counts.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.instructions",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--seq", type=int, default=8)
    parser.add_argument("--calls", default="5,15", help="the two counts a,b of steady calls")
    parser.add_argument("--cache-sim", action="store_true",
                        help="also simulate the caches (slower)")
    parser.add_argument("--ll", metavar="SIZE,ASSOC,LINE",
                        help="the simulated last-level cache (callgrind's --LL), e.g. "
                        "1048576,8,64 for a 1 MiB L2: callgrind simulates two levels, so "
                        "this makes its last level stand for the core's own L2")
    parser.add_argument("--jobs", type=int, default=2, help="valgrind processes at once")
    parser.add_argument("--out", type=Path, default=_ROOT / "results" / "cpu")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--info", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.calls = tuple(int(c) for c in args.calls.split(","))
    if len(args.calls) != 2 or not 0 <= args.calls[0] < args.calls[1]:
        parser.error(f"--calls takes two counts a,b with a < b, got {args.calls}")
    if args.ll and not args.cache_sim:
        parser.error("--ll sets the simulated cache: use it with --cache-sim")
    if args.child:
        child(args.child, args.layers, args.seq, *args.calls, args.info)
        return 0
    missing = [p for p in ("valgrind", "callgrind_control") if shutil.which(p) is None]
    if missing:
        parser.error(f"{' and '.join(missing)} not found: install valgrind "
                     "(apt-get install valgrind)")
    from .dynamo import environment

    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(args.jobs) as pool:
        found = list(pool.map(lambda t: measure(t, args, Path(tmp)), TREATMENTS))
    rows = {r["treatment"]: r for r in found}
    taps, one = rows["taps"], rows["taps (one site)"]
    hooks, bare = rows["hooks"], rows["bare"]
    events = list(bare["per_call"])
    derived: dict[str, Any] = {
        "per tapped site": {e: (taps["per_call"][e] - one["per_call"][e])
                            / (taps["sites"] - one["sites"]) for e in events},
        "per hooked module call": {e: (hooks["per_call"][e] - bare["per_call"][e])
                                   / hooks["sites"] for e in events},
    }
    derived["ratio_Ir"] = (derived["per tapped site"]["Ir"]
                           / derived["per hooked module call"]["Ir"])
    env = environment()
    args.out.mkdir(parents=True, exist_ok=True)
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
              if k not in ("child", "info")}
    record = {"environment": env, "config": config, "rows": found, "derived": derived}
    (args.out / "instructions.json").write_text(json.dumps(record, indent=1) + "\n")
    text = markdown(env, args, rows, derived)
    (args.out / "instructions.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
