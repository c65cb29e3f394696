"""``torch.compile``: compile time, graphs and graph breaks, and the steady-state cost of taps.

For each approach (the bare model, taps at every module call, ``fxprobe.extractor`` returning
the same values, forward hooks on a copy of the model) the suite asks ``torch._dynamo.explain``
for graphs and breaks, compiles with the default backend and times the first call, checks that
the compiled module captures what the eager one does, then times all of them interleaved
against the compiled bare model. The compiled extractor is the floor of compiled taps: a graph
that materialises the same values and returns them, keeping no state between calls;
``ratio_vs_compiled_extractor`` is the taps' ratio over its ratio, per round. A failure is
recorded with its message, never dropped. Compile times are cold (inductor's caches disabled).
The ``stats`` approach is ``reduce="stats"`` at every module call (eager: ``eager_ms``).

``python -m benchmarks.compiled [--rounds N] [--out DIR]`` measures statistics on the model of
issue 23 alone (12 x ``Linear(512)`` + ReLU + residual, batch 64, the 12 Linear sites, one
thread): compiled bare, eager bare, compiled reference taps, eager and compiled statistics,
interleaved in one run against the compiled bare model; it writes ``compiled-stats.json`` and
``.md``.
"""

from __future__ import annotations

import copy
import time
import warnings
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np
import torch
import torch._dynamo
from torch import nn
from torch._inductor import config as inductor_config

import fxprobe

from . import timing
from .models import MODELS
from .records import CompileRecord, Environment


def _error(e: BaseException) -> str:
    lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
    return f"{type(e).__name__}: {' / '.join(lines[:3])}"[:600]


def _same(a: list[Any], b: list[Any]) -> bool:
    if len(a) != len(b):
        return False
    return all(isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)
               and x.shape == y.shape and torch.allclose(x, y, rtol=1e-4, atol=1e-5)
               for x, y in zip(a, b, strict=True))


def run_compile(name: str, model: nn.Module, inputs: tuple[Any, ...], env: Environment, *,
                quick: bool, seed: int) -> list[CompileRecord]:
    """Compile records for ``model`` (eval mode, batch of ``inputs``, under no_grad)."""
    model.eval()
    spec = MODELS[name]
    base = CompileRecord(model=name, input_shape=spec.shape(quick), batch=len(inputs[0]),
                         approach="", status="ok", error="", device=env.device,
                         device_name=env.device_name, torch_version=env.torch_version,
                         dtype=env.dtype, threads=env.threads)
    every_call = fxprobe.where(lambda s: s.kind == "call_module")
    tapped = fxprobe.tap(model, ops=every_call)
    stats = fxprobe.tap(model, ops=every_call, reduce="stats")
    extractor = fxprobe.extractor(model, ops=every_call)
    hooked = copy.deepcopy(model)
    store: list[Any] = []

    def keep(m: nn.Module, args: Any, out: Any) -> None:
        store.append(out)

    for m in hooked.modules():
        if not list(m.children()):
            m.register_forward_hook(keep)

    def read_taps(out: Any) -> list[Any]:
        return [v for v in tapped.taps.values()]

    def read_stats(out: Any) -> list[Any]:
        return [stats_row(v) for v in stats.taps.values()]

    def read_extracted(out: Any) -> list[Any]:
        return list(out[1].values())

    def read_store(out: Any = None) -> list[Any]:
        return list(store)

    def clear_store() -> None:
        store.clear()

    targets: dict[str, tuple[nn.Module, Callable[[Any], list[Any]] | None,
                             Callable[[], None] | None]] = {
        "bare": (model, None, None),
        "taps": (tapped, read_taps, None),
        "stats": (stats, read_stats, None),
        "extractor": (extractor, read_extracted, None),
        "module hooks": (hooked, read_store, clear_store),
    }
    records: dict[str, CompileRecord] = {}
    runs: dict[str, tuple[Callable[[], Any], Callable[[], Any]]] = {}
    with torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*force_disable_caches.*")
        for label, (target, _, _) in targets.items():
            records[label] = _explain(replace(base, approach=label), target, inputs)
        records["module hooks, default guards"] = _default_guards(
            replace(base, approach="module hooks, default guards"), model, hooked, inputs,
            read_store, clear_store)
        # With dynamo's default skip_nnmodule_hook_guards=True, the hooked copy would reuse the
        # bare model's graph and its hooks would never run (the row above shows whether they
        # do); the timed comparison guards on hooks so that every approach does its work.
        old = torch._dynamo.config.skip_nnmodule_hook_guards
        torch._dynamo.config.skip_nnmodule_hook_guards = False
        # Cold compile times: inductor's on-disk caches would make a rerun look free.
        old_caches = inductor_config.force_disable_caches
        inductor_config.force_disable_caches = True
        try:
            torch._dynamo.reset()
            for label, (target, read, before) in targets.items():
                rec, run = _compile(records[label], target, inputs, read, before, env)
                records[label] = rec
                if run is not None:
                    runs[label] = (run, _call(target, inputs, before))
            if "bare" in runs:
                _time(runs, records, env, quick, seed)
        finally:
            torch._dynamo.config.skip_nnmodule_hook_guards = old
            inductor_config.force_disable_caches = old_caches
            torch._dynamo.reset()
    tapped.remove()
    stats.remove()
    return list(records.values())


def stats_row(s: fxprobe.Stats) -> torch.Tensor:
    """A :class:`fxprobe.Stats` as the tensor of its eight numbers (compared with allclose)."""
    return torch.tensor([s.mean, s.std, s.min, s.max, s.absmax, s.zero_frac, s.nan_count,
                         s.inf_count], dtype=torch.float64)


def _explain(rec: CompileRecord, target: nn.Module, inputs: tuple[Any, ...]) -> CompileRecord:
    torch._dynamo.reset()
    try:
        ex = torch._dynamo.explain(target)(*inputs)
    except Exception as e:  # recorded as is
        return replace(rec, status="failed", error="explain: " + _error(e))
    return replace(rec, graphs=ex.graph_count, graph_breaks=ex.graph_break_count,
                   break_reasons=tuple(str(r.reason).splitlines()[0][:200]
                                       for r in ex.break_reasons[:3]))


def _default_guards(rec: CompileRecord, model: nn.Module, hooked: nn.Module,
                    inputs: tuple[Any, ...], read: Callable[[Any], list[Any]],
                    clear: Callable[[], None]) -> CompileRecord:
    """Compile the bare model, then the hooked copy, with dynamo's default settings."""
    torch._dynamo.reset()
    try:
        clear()
        hooked(*inputs)
        eager_vals = read(None)
        torch.compile(model)(*inputs)
        clear()
        torch.compile(hooked)(*inputs)
        vals = read(None)
    except Exception as e:
        return replace(rec, status="failed", error="compile: " + _error(e))
    finally:
        torch._dynamo.reset()
    rec = replace(rec, captured=len(vals), captured_match_eager=_same(eager_vals, vals))
    if not rec.captured_match_eager:
        rec = replace(rec, error=(
            f"hooks silently skipped: {len(vals)} of {len(eager_vals)} values captured; the "
            "copy reused the bare model's compiled graph (skip_nnmodule_hook_guards=True, "
            "pytorch/pytorch#117758)"))
    return rec


def _compile(rec: CompileRecord, target: nn.Module, inputs: tuple[Any, ...],
             read: Callable[[Any], list[Any]] | None, before: Callable[[], None] | None,
             env: Environment) -> tuple[CompileRecord, Callable[[], Any] | None]:
    """Compile ``target``, time its first call, check what it captures against eager."""
    try:
        compiled = torch.compile(target)
        if before is not None:
            before()
        eager_out = target(*inputs)
        eager_vals = [v.clone() for v in read(eager_out)] if read is not None else []
        if before is not None:
            before()
        t0 = time.perf_counter()
        out = compiled(*inputs)
        if env.device == "cuda":
            torch.cuda.synchronize()
        rec = replace(rec, compile_s=time.perf_counter() - t0)
        if read is not None:
            vals = read(out)
            rec = replace(rec, captured=len(vals), captured_match_eager=_same(eager_vals, vals))
        elif not torch.allclose(eager_out, out, rtol=1e-4, atol=1e-5):
            rec = replace(rec, error="compiled output differs from eager")
    except Exception as e:  # recorded as is
        prefix = rec.error + "; " if rec.error else ""
        return replace(rec, status="failed", error=prefix + "compile: " + _error(e)), None
    return rec, _call(compiled, inputs, before)


def _call(fn: Callable[..., Any], inputs: tuple[Any, ...],
          before: Callable[[], None] | None) -> Callable[[], Any]:
    if before is None:
        return lambda: fn(*inputs)

    def run() -> Any:
        before()
        return fn(*inputs)
    return run


def _time(runs: dict[str, tuple[Callable[[], Any], Callable[[], Any]]],
          records: dict[str, CompileRecord], env: Environment, quick: bool, seed: int) -> None:
    cuda = env.device == "cuda"
    baseline = runs["bare"][0]
    treatments = []
    for label, (comp, eager) in runs.items():
        treatments.append(timing.Treatment(f"compiled|{label}", comp))
        treatments.append(timing.Treatment(f"eager|{label}", eager))
    iters, _ = timing.calibrate(baseline, min_slot_s=0.004 if quick else 0.025,
                             warmup_s=0.02 if quick else 0.3, cuda=cuda)
    timing.warm(treatments, iters, cuda)
    samples = timing.interleave(baseline, treatments, iters=iters, rounds=3 if quick else 11,
                                cuda=cuda, seed=seed)
    floor = samples.get("compiled|extractor")
    for label in runs:
        c = timing.summarize(samples[f"compiled|{label}"], cuda)
        e = timing.summarize(samples[f"eager|{label}"], cuda)
        vs_floor = None
        if floor is not None and label in ("taps", "module hooks"):
            # Each side over its own neighbouring baseline slots, then the one over the other.
            vs_floor = float(np.median(samples[f"compiled|{label}"].ratios() / floor.ratios()))
        records[label] = replace(records[label], compiled_ms=c.treatment_ms,
                                 eager_ms=e.treatment_ms, ratio_vs_compiled_bare=c.ratio,
                                 ratio_p5=c.ratio_p5, ratio_p95=c.ratio_p95,
                                 ratio_vs_compiled_extractor=vs_floor)


class Residual(nn.Module):
    """Issue 23's model: ``x = x + relu(linear(x))``, ``depth`` times."""

    def __init__(self, width: int = 512, depth: int = 12) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + torch.relu(layer(x))
        return x


def compiled_stats(rounds: int, seed: int = 0) -> dict[str, Any]:
    """Issue 23's measurement: every treatment's median ratio to the compiled bare model."""
    torch.manual_seed(seed)
    model = Residual().eval()
    x = torch.randn(64, 512)
    taps = fxprobe.tap(model, ops=nn.Linear)
    stats = fxprobe.tap(model, ops=nn.Linear, reduce="stats")
    eager_stats = fxprobe.tap(model, ops=nn.Linear, reduce="stats")
    torch._dynamo.reset()
    bare = torch.compile(model)
    runs = {"eager bare": lambda: model(x), "compiled reference taps": torch.compile(taps),
            "eager stats": lambda: eager_stats(x), "compiled stats": torch.compile(stats)}
    with torch.no_grad():
        bare(x)
        for key in ("compiled reference taps", "compiled stats"):
            compiled = runs[key]
            runs[key] = lambda c=compiled: c(x)
            runs[key]()
        eager_stats(x)
        same = all(torch.allclose(stats_row(stats.taps[n]), stats_row(eager_stats.taps[n]),
                                  rtol=1e-5, atol=1e-6) for n in eager_stats.taps)
        treatments = [timing.Treatment(k, f) for k, f in runs.items()]
        iters, _ = timing.calibrate(lambda: bare(x), min_slot_s=0.06, warmup_s=0.5,
                                    cuda=False)
        timing.warm(treatments, iters, False)
        samples = timing.interleave(lambda: bare(x), treatments, iters=iters, rounds=rounds,
                                    cuda=False, seed=seed)
    rows = {}
    for key in runs:
        summ = timing.summarize(samples[key], False)
        rows[key] = {"ratio_vs_compiled_bare": summ.ratio, "p5": summ.ratio_p5,
                     "p95": summ.ratio_p95, "ms": summ.treatment_ms,
                     "compiled_bare_ms": summ.baseline_ms}
    e, c = samples["eager stats"].ratios(), samples["compiled stats"].ratios()
    return {"model": "12 x Linear(512) + ReLU + residual, batch 64, 12 Linear sites",
            "torch": torch.__version__, "threads": torch.get_num_threads(),
            "rounds": rounds, "iters_per_slot": iters, "compiled_stats_equal_eager": same,
            "compiled_stats_over_eager_stats": float(np.median(c / e)), "rows": rows}


def _markdown(result: dict[str, Any]) -> str:
    lines = [f"{result['model']}; torch {result['torch']}, {result['threads']} thread(s), "
             f"medians of {result['rounds']} interleaved rounds ({result['iters_per_slot']} "
             "calls per slot), ratios to the compiled bare model in the same rounds.", "",
             "| treatment | x compiled bare [p5, p95] | ms per call |", "|---|---|---|"]
    for key, r in result["rows"].items():
        lines.append(f"| {key} | {r['ratio_vs_compiled_bare']:.3f} [{r['p5']:.3f}, "
                     f"{r['p95']:.3f}] | {r['ms']:.3f} |")
    lines += ["", f"compiled stats / eager stats (median per round): "
              f"{result['compiled_stats_over_eager_stats']:.3f}; compiled stats equal eager: "
              f"{result['compiled_stats_equal_eager']}"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    import argparse
    import json
    from pathlib import Path

    parser = argparse.ArgumentParser(prog="python -m benchmarks.compiled",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("bench-results"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    result = compiled_stats(args.rounds)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "compiled-stats.json").write_text(json.dumps(result, indent=1) + "\n")
    text = _markdown(result)
    (args.out / "compiled-stats.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
