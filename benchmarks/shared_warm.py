"""Warm forwards of shared layers with and without fxprobe's cache lookup, in one process.

    python -m benchmarks.shared_warm [--layers 2,32] [--rounds 21] [--iters 3] [--cache]

The Llama layout of ``benchmarks.scale`` (``--size tiny``, ``use_cache=False``; with
``--cache``, ``use_cache=True``: each forward makes a ``DynamicCache`` and the layers run
``dynamo_blocks_cache``'s shared path), tapped with
``FXPROBE_DYNAMO_REGIONS=shared`` and ``ops="blocks.*.resid_post"``. Each round runs the
untapped twin and the tapped model ``--iters`` times each, once with ``Blocks.lookup`` off
(every layer call through dynamo's frame evaluation: what fxprobe did before the lookup) and
once on, in alternation; the ratio of each is to the untapped forward of its own round, both
by wall clock and by this thread's CPU time (less sensitive to other work on the machine).
Medians over the rounds. Writes ``shared-warm-ab.json`` and ``.md`` (``shared-warm-ab-cache``
with ``--cache``) to
``benchmarks/results/cpu/`` (or ``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from .dynamo import environment
from .scale import llama
from .timing import gc_paused

_ROOT = Path(__file__).resolve().parent


def measure(layers: int, rounds: int, iters: int, cache: bool = False) -> dict[str, Any]:
    import fxprobe

    os.environ["FXPROBE_DYNAMO_REGIONS"] = "shared"
    model = llama(layers, "tiny", "cpu", cache=cache)
    bare = llama(layers, "tiny", "cpu", cache=cache)
    ids = torch.randint(1, 256, (1, 32), generator=torch.Generator().manual_seed(1))
    tapped = fxprobe.tap(model, ops="blocks.*.resid_post", tracer="dynamo")
    ratios: dict[str, list[float]] = {f"{c}_{arm}": [] for c in ("wall", "cpu")
                                      for arm in ("dynamo", "lookup")}
    with torch.no_grad():
        tapped(ids)
        region = tapped._lifecycle().program.dynamo[""]
        blocks = [b for b in (region.shared, region.shared_kv) if b is not None]
        for _ in range(rounds):
            for arm, on in (("dynamo", False), ("lookup", True)):
                for shared in blocks:
                    shared.lookup = on
                tapped(ids)
                for clock, c in ((time.perf_counter, "wall"), (time.thread_time, "cpu")):
                    with gc_paused():
                        t0 = clock()
                        for _ in range(iters):
                            bare(ids)
                        b = clock() - t0
                        t0 = clock()
                        for _ in range(iters):
                            tapped(ids)
                        w = clock() - t0
                    ratios[f"{c}_{arm}"].append(w / b)
        for shared in blocks:
            shared.lookup = True
    return {"layers": layers, **{k: statistics.median(v) for k, v in ratios.items()}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.shared_warm",
                                description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=lambda s: [int(x) for x in s.split(",")], default=[2, 32])
    p.add_argument("--rounds", type=int, default=21)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--out", type=Path, default=_ROOT / "results" / "cpu")
    p.add_argument("--cache", action="store_true",
                   help="use_cache=True: the shared path with a KV cache")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    env = environment()
    rows = [measure(n, args.rounds, args.iters, args.cache) for n in args.layers]
    name = "shared-warm-ab" + ("-cache" if args.cache else "")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{name}.json").write_text(json.dumps(
        {"environment": env, "config": {k: (str(v) if isinstance(v, Path) else v)
                                        for k, v in vars(args).items()}, "rows": rows},
        indent=1) + "\n")
    lines = ["# Shared layers, warm: dynamo's frame evaluation per layer against the lookup"
             + (" (use_cache=True)" if args.cache else ""), "",
             f"{env['run']}, torch {env['torch']}, commit {env['commit']}, one torch thread, "
             f"one process; medians of {args.rounds} rounds of {args.iters} forwards, the two "
             "arms alternating; warm forward as a multiple of the untapped forward.", "",
             "| layers | wall, through dynamo | wall, lookup | CPU, through dynamo "
             "| CPU, lookup |", "|---|---|---|---|---|"]
    lines += [f"| {r['layers']} | {r['wall_dynamo']:.3f} | {r['wall_lookup']:.3f} "
              f"| {r['cpu_dynamo']:.3f} | {r['cpu_lookup']:.3f} |" for r in rows]
    text = "\n".join(lines) + "\n"
    (args.out / f"{name}.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
