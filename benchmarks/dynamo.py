"""The dynamo frontend on a GPT-2 layout: taps vs forward hooks vs the bare model.

    python -m benchmarks.dynamo [--rounds 30] [--layers 4] [--seq 32] [--out DIR]

A ``GPT2LMHeadModel`` from a small config (random init, eager attention so that the softmax is
an op), batch 1. Treatments, each timed in interleaved rounds against the bare eager model
(``B T1 B T2 B ...``, shuffled per round; a treatment's cost in a round is its time minus the
mean of the two bare slots beside it):

- ``taps``: ``fxprobe.tap(model, ops=[F.softmax, torch.matmul, torch.add], tracer="dynamo")``,
  reference capture: every attention softmax, matmul and add of the model.
- ``taps (one site)``: the same frontend with one site: the fixed cost of running under dynamo.
- ``hooks``: a forward hook on every module that keeps a reference to its output.

Host cost per hooked call = median per-call overhead of the hooks / module calls. Host cost per
tapped site = the slope of time against sites captured: tapped modules with 1, n/3, 2n/3 and n
of the n sites, timed in shuffled order within each round, a least-squares slope per round, the
median over rounds. Python's collector is paused during each slot (as ``timeit`` and the main
suite do: a collection lands on whichever slot happens to run), and with one torch thread the
clock is the thread's CPU time (``time.thread_time``), which a shared machine's other processes
do not inflate. ``python -m benchmarks.instructions`` counts the same costs in instructions.
The one-time cost of
the first call (dynamo capture and the rewrite) and of the first call at a new sequence length
(a recompilation with dynamic shapes) are measured on fresh tapped modules and reported.
Writes ``dynamo.json`` and ``dynamo.md`` to ``benchmarks/results/<device>/``.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import subprocess
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import fxprobe

from .timing import gc_paused, median_ci

_ROOT = Path(__file__).resolve().parent


def gpt2(layers: int) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=layers, n_embd=32, n_head=4, vocab_size=100, n_positions=128,
                        bos_token_id=0, eos_token_id=0)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return GPT2LMHeadModel(config).eval()


@dataclass(frozen=True)
class Row:
    """One treatment's cost against the bare model."""

    treatment: str
    sites: int
    """Values captured per call."""
    overhead_us: float
    """Median over rounds of (treatment - bare) per call, microseconds."""
    overhead_q25_us: float
    overhead_q75_us: float
    us_per_site: float
    ratio: float
    """Median over rounds of treatment / bare."""


@dataclass(frozen=True)
class Capture:
    """One-time costs of the dynamo frontend."""

    first_call_s: float
    """First call of a fresh tapped module: dynamo capture, naming, rewrite, run."""
    new_length_s: float
    """First call at a second sequence length (recompilation with dynamic shapes)."""
    steady_call_ms: float
    """A later call, for scale."""
    graphs: int
    breaks: int


class HookAll:
    """A forward hook on every module, keeping a reference to each output."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.store: dict[int, Any] = {}
        self.handles: list[Any] = []

    def enter(self) -> None:
        store = self.store

        def hook(m: nn.Module, a: Any, out: Any) -> None:
            store[id(m)] = out
            return None

        self.handles = [m.register_forward_hook(hook) for m in self.model.modules()]

    def exit(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    def count(self, run: Callable[[], Any]) -> int:
        fired = [0]

        def hook(m: nn.Module, a: Any, out: Any) -> None:
            fired[0] += 1
            return None

        handles = [m.register_forward_hook(hook) for m in self.model.modules()]
        try:
            run()
        finally:
            for h in handles:
                h.remove()
        return fired[0]


CLOCK: Callable[[], int] = time.perf_counter_ns
"""The clock of a slot: ``main`` sets ``time.thread_time_ns`` when torch runs one thread."""


def timed(fn: Callable[[], Any], iters: int) -> float:
    with gc_paused():
        t0 = CLOCK()
        for _ in range(iters):
            fn()
        return (CLOCK() - t0) / iters / 1e3  # us per call


def interleave(bare: Callable[[], Any], treatments: dict[str, tuple[Callable[[], Any], Any]],
               rounds: int, iters: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per round: (treatment - mean of the bare slots beside it), treatment / that mean."""
    diffs: dict[str, list[float]] = {k: [] for k in treatments}
    ratios: dict[str, list[float]] = {k: [] for k in treatments}
    rng = random.Random(0)
    keys = list(treatments)
    for _ in range(rounds):
        rng.shuffle(keys)
        before = timed(bare, iters)
        for key in keys:
            run, hooks = treatments[key]
            if hooks is not None:
                hooks.enter()
            try:
                t = timed(run, iters)
            finally:
                if hooks is not None:
                    hooks.exit()
            after = timed(bare, iters)
            base = (before + after) / 2
            diffs[key].append(t - base)
            ratios[key].append(t / base)
            before = after
    return {k: (np.array(diffs[k]), np.array(ratios[k])) for k in treatments}


def slopes(runs: dict[int, Callable[[], Any]], rounds: int, iters: int
           ) -> tuple[np.ndarray, dict[int, float]]:
    """Per round, the least-squares slope of time per call against sites captured (the
    tapped modules timed in shuffled order); and the median time of each."""
    rng = random.Random(1)
    ks = sorted(runs)
    order = list(ks)
    found = []
    times: dict[int, list[float]] = {k: [] for k in ks}
    for _ in range(rounds):
        rng.shuffle(order)
        t = {k: timed(runs[k], iters) for k in order}
        for k in ks:
            times[k].append(t[k])
        found.append(np.polyfit(np.array(ks, dtype=float), [t[k] for k in ks], 1)[0])
    return np.array(found), {k: float(np.median(v)) for k, v in times.items()}


def capture_costs(layers: int, seq: int, ops: list[Any]) -> Capture:
    torch._dynamo.reset()
    model = gpt2(layers)
    ids = torch.randint(2, 100, (1, seq), generator=torch.Generator().manual_seed(1))
    other = torch.randint(2, 100, (1, seq + 7), generator=torch.Generator().manual_seed(2))
    tapped = fxprobe.tap(model, ops=ops, tracer="dynamo")
    with torch.no_grad():
        t0 = time.perf_counter()
        tapped(input_ids=ids)
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        tapped(input_ids=other)
        second = time.perf_counter() - t0
        steady = min(timed(lambda: tapped(input_ids=ids), 5) for _ in range(3)) / 1e3
    info = tapped.captures[0]
    return Capture(first, second, steady, info.graphs, info.breaks)


def environment() -> dict[str, Any]:
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, cwd=_ROOT, check=False).stdout.strip()
    except OSError:
        commit = ""
    import transformers

    return {
        "device": "cpu", "cpu": platform.processor() or platform.machine(),
        "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
        "transformers": transformers.__version__, "python": platform.python_version(),
        "commit": commit, "run": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


def both_frontends(layers: int, seq: int, ops: list[Any], rounds: int, iters: int
                   ) -> dict[str, dict[str, Any]]:
    """Per-site cost of fx taps and dynamo taps on one model that both frontends trace (the
    suite's GPT-2 layout at hidden 32), by the same sweep: whether a site costs more under
    dynamo than under fx."""
    from .models import GPT2

    torch.manual_seed(0)
    model = GPT2(vocab=100, max_len=64, d_model=32, n_heads=4, n_layers=layers).eval()
    ids = torch.randint(0, 100, (1, seq), generator=torch.Generator().manual_seed(0))
    found = {}
    for tracer in ("fx", "dynamo"):
        full = fxprobe.tap(model, ops=ops, tracer=tracer)
        with torch.no_grad():
            full(ids)
        names = list(full.taps)
        n = len(names)
        tapped = {k: fxprobe.tap(model, ops=names[:k], tracer=tracer)
                  for k in sorted({1, n // 3, 2 * n // 3})}
        tapped[n] = full
        runs = {k: (lambda t=t: t(ids)) for k, t in tapped.items()}
        with torch.no_grad():
            for run in runs.values():
                run()
            per_round, medians = slopes(runs, rounds, iters)
        lo, hi = median_ci(per_round)
        found[tracer] = {"us_per_site": float(np.median(per_round)), "ci95_us": [lo, hi],
                         "us_per_call": {str(k): v for k, v in medians.items()}}
    return found


def markdown(env: dict[str, Any], args: argparse.Namespace, rows: list[Row],
             cap: Capture, hook_ratio: str, q25: float, q75: float,
             sweep_us: dict[int, float]) -> str:
    lines = [
        "# Dynamo frontend: GPT-2 layout, taps vs hooks (cpu)", "",
        f"- torch {env['torch']}, transformers {env['transformers']}, Python {env['python']}, "
        f"{env['torch_threads']} torch thread(s), commit {env['commit']}, {env['run']}",
        f"- GPT2LMHeadModel, {args.layers} layers, hidden 32, 4 heads, vocabulary 100, eager "
        f"attention; batch 1, sequence {args.seq}; {args.rounds} interleaved rounds of "
        f"{args.iters} calls per slot; clock: "
        f"{'the thread CPU time' if CLOCK is time.thread_time_ns else 'wall'}; Python's "
        "collector paused in each slot", "",
        "`overhead us` is the median over rounds of (treatment - bare) per call, with its "
        "interquartile range; `us/site` divides it by the values captured per call.", "",
        "| treatment | values/call | overhead us (IQR) | us/site | ratio to bare |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r.treatment} | {r.sites} | {r.overhead_us:.1f} "
                     f"({r.overhead_q25_us:.1f} to {r.overhead_q75_us:.1f}) | "
                     f"{r.us_per_site:.2f} | {r.ratio:.3f} |")
    lines += [
        "", "The dynamo frontend runs the captured graph as one flat function, which can be "
        "cheaper than the model's own Python (a ratio below 1); its fixed cost (guards) is in "
        "the one-site row. The cost of a tapped site is therefore measured as what more "
        "sites add: the least-squares slope of time per call against sites captured, over "
        f"tapped modules with {', '.join(str(k) for k in sweep_us)} sites timed in shuffled "
        f"order, per round; median over {args.sweeps} rounds, IQR {q25:.2f} to {q75:.2f} us. "
        "Median us per call: "
        + ", ".join(f"{k} sites {v:.0f}" for k, v in sweep_us.items()) + ".", "",
        f"Host cost per tapped site / per hooked module call: **{hook_ratio}** "
        "(target <= 0.2).", "",
        "## One-time capture cost (fresh tapped module, after torch._dynamo.reset())", "",
        f"- first call: {cap.first_call_s:.2f} s (dynamo capture, naming, rewrite, run)",
        f"- first call at a new sequence length: {cap.new_length_s:.2f} s (recompilation with "
        "dynamic shapes; later lengths reuse it)",
        f"- a steady call for scale: {cap.steady_call_ms:.2f} ms; graphs captured: "
        f"{cap.graphs}, graph breaks: {cap.breaks}", "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.dynamo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--seq", type=int, default=8)
    parser.add_argument("--sweeps", type=int, default=100,
                        help="rounds of the sites sweep (the per-site slope)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--both-frontends", action="store_true",
                        help="also sweep fx and dynamo taps on the suite's GPT-2 layout")
    parser.add_argument("--out", type=Path, default=_ROOT / "results" / "cpu")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(args.threads)
    global CLOCK
    CLOCK = time.thread_time_ns if args.threads == 1 else time.perf_counter_ns
    ops = [F.softmax, torch.matmul, torch.add]

    cap = capture_costs(args.layers, args.seq, ops)
    model = gpt2(args.layers)
    ids = torch.randint(2, 100, (1, args.seq), generator=torch.Generator().manual_seed(0))
    taps = fxprobe.tap(model, ops=ops, tracer="dynamo")
    one = fxprobe.tap(model, ops="transformer.h.0.attn.softmax", tracer="dynamo")
    hooks = HookAll(model)
    with torch.no_grad():
        taps(input_ids=ids)
    names = list(taps.taps)  # in the order they ran
    n_taps = len(names)
    ks = sorted({1, n_taps // 3, 2 * n_taps // 3, n_taps})
    sweep = {k: fxprobe.tap(model, ops=names[:k], tracer="dynamo") for k in ks[1:-1]}
    sweep[ks[0]], sweep[n_taps] = one, taps

    def bare() -> Any:
        return model(input_ids=ids)

    def run_taps() -> Any:
        return taps(input_ids=ids)

    def run_one() -> Any:
        return one(input_ids=ids)

    runs = {k: (lambda t=t: t(input_ids=ids)) for k, t in sweep.items()}
    with torch.no_grad():
        expected = bare()
        for k, run in runs.items():  # capture once, untimed; outputs are the model's
            assert torch.equal(run().logits, expected.logits)
            assert len(sweep[k].taps) == k, (k, len(sweep[k].taps))
        n_one = 1
        n_hooks = hooks.count(bare)
        for _ in range(3):  # warm up
            bare(), [run() for run in runs.values()]
        treatments = {"taps": (run_taps, None), "taps (one site)": (run_one, None),
                      "hooks on every module": (bare, hooks)}
        results = interleave(bare, treatments, args.rounds, args.iters)
        # The per-site cost directly: the slope of time against sites captured (what more
        # sites add; the bare slots' noise stays out).
        marginal, sweep_us = slopes(runs, args.sweeps, args.iters)
    both = (both_frontends(args.layers, args.seq, ops, args.sweeps, args.iters)
            if args.both_frontends else {})
    counts = {"taps": n_taps, "taps (one site)": n_one, "hooks on every module": n_hooks}
    rows = []
    for key, (diff, ratio) in results.items():
        med = float(np.median(diff))
        rows.append(Row(key, counts[key], med, float(np.percentile(diff, 25)),
                        float(np.percentile(diff, 75)), med / max(counts[key], 1),
                        float(np.median(ratio))))
    by = {r.treatment: r for r in rows}
    # Running under dynamo has a fixed cost (guards) and a saving (no Python module calls):
    # the cost of a site is what more sites add to a run with fewer.
    per_tap = float(np.median(marginal))
    per_hook = by["hooks on every module"].us_per_site
    tap_ci = median_ci(marginal)
    hook_ci = median_ci(results["hooks on every module"][0] / n_hooks)
    hook_ratio = (f"{per_tap:.2f} / {per_hook:.2f} us = {per_tap / per_hook:.2f}; 95% CI of "
                  f"the medians: taps [{tap_ci[0]:.2f}, {tap_ci[1]:.2f}], hooks "
                  f"[{hook_ci[0]:.2f}, {hook_ci[1]:.2f}] us"
                  if per_hook > 0 else "hook cost not resolved from noise")
    if tap_ci[0] <= 0 <= tap_ci[1]:
        hook_ratio += " (the per-site cost of taps is not resolved from noise)"
    env = environment()
    args.out.mkdir(parents=True, exist_ok=True)
    record = {"environment": env, "config": {k: (str(v) if isinstance(v, Path) else v)
                                             for k, v in vars(args).items()},
              "rows": [asdict(r) for r in rows], "capture": asdict(cap),
              "us_per_tapped_site_marginal": per_tap,
              "sweep_us_per_call": {str(k): v for k, v in sweep_us.items()},
              "both_frontends": both,
              "clock": "thread_time" if CLOCK is time.thread_time_ns else "perf_counter",
              "marginal_iqr_us": [float(np.percentile(marginal, 25)),
                                  float(np.percentile(marginal, 75))],
              "marginal_ci95_us": list(tap_ci), "hook_per_site_ci95_us": list(hook_ci),
              "taps_over_hooks_per_site": per_tap / per_hook if per_hook > 0 else None,
              "samples_us": {k: d.tolist() for k, (d, _) in results.items()}}
    (args.out / "dynamo.json").write_text(json.dumps(record, indent=1) + "\n")
    text = markdown(env, args, rows, cap, hook_ratio, float(np.percentile(marginal, 25)),
                    float(np.percentile(marginal, 75)), sweep_us)
    if both:
        text += "\n".join([
            "## One model, both frontends (the suite's GPT-2 layout, hidden 32)", "",
            "The same sweep on a model that torch.fx also traces, with the same ops tapped: "
            "what a site costs under each frontend, measured the same way.", "",
            "| frontend | us per site (95% CI) | median us per call by sites |", "|---|---|---|",
            *(f"| {t} | {b['us_per_site']:.2f} [{b['ci95_us'][0]:.2f}, {b['ci95_us'][1]:.2f}]"
              f" | " + ", ".join(f"{k}: {v:.0f}" for k, v in b["us_per_call"].items()) + " |"
              for t, b in both.items()), ""])
    (args.out / "dynamo.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
