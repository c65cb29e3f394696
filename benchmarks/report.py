"""Turning results into Markdown (tabulate), a plot (matplotlib, optional) and the docs section."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from tabulate import tabulate

from .records import CompileRecord, Measurement, Results

# Target from the issue: host cost per tapped site at most this fraction of a forward hook's.
PER_SITE_TARGET = 0.2
STATS_FLOOR_TARGET = 1.5
COMPILE_FLOOR_TARGET = 1.05
DYNAMO_TARGET = 0.2
DENSITY_ORDER = ("input only", "one", "10%", "all")


def _f(x: float | None, digits: int = 2) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    return f"{x:.{digits}f}"


def _us(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.2f}" if abs(x) < 10 else f"{x:.1f}" if abs(x) < 1000 else f"{x:,.0f}"


def _bytes(b: int | None) -> str:
    if b is None:
        return "-"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(b) >= size:
            return f"{b / size:.1f} {unit}"
    return f"{b} B"


def ratio(m: Measurement) -> str:
    if m.ratio is None:
        return "-"
    return f"{m.ratio:.3f} [{_f(m.ratio_p5, 3)}, {_f(m.ratio_p95, 3)}]"


def _overhead(m: Measurement) -> str:
    if m.overhead_us is None:
        return "-"
    return f"{_us(m.overhead_us)} [{_us(m.overhead_us_q25)}, {_us(m.overhead_us_q75)}]"


def _mem_delta(m: Measurement) -> str:
    if m.peak_mem_bytes is None or m.baseline_peak_mem_bytes is None:
        return "-"
    delta = m.peak_mem_bytes - m.baseline_peak_mem_bytes
    return ("+" if delta >= 0 else "-") + _bytes(abs(delta))


def _table(rows: Sequence[Sequence[Any]], headers: Sequence[str]) -> str:
    if not rows:
        return "_(no records)_"
    return tabulate(rows, headers=list(headers), tablefmt="github", disable_numparse=True)


def _ok(ms: Iterable[Measurement]) -> list[Measurement]:
    return [m for m in ms if m.status == "ok"]


def find(results: Results, **want: Any) -> Measurement | None:
    """The first ``ok`` record whose fields equal ``want``."""
    for m in _ok(results.measurements):
        if all(getattr(m, k) == v for k, v in want.items()):
            return m
    return None


def _first_batch(results: Results, model: str) -> int | None:
    batches = [m.batch for m in results.measurements if m.model == model]
    return min(batches) if batches else None


def _models(results: Results) -> list[str]:
    seen: list[str] = []
    for m in results.measurements:
        if m.model not in seen:
            seen.append(m.model)
    return seen


# -- targets ---------------------------------------------------------------------------------

def targets(results: Results) -> list[list[str]]:
    """``[target, measured, verdict]`` rows for the issue's targets."""
    env = results.environment
    cuda = env.device == "cuda"
    rows: list[list[str]] = []

    # 1. Installed with nothing selected: the input-only taps against the bare model.
    parts, missed = [], []
    for model in _models(results):
        b = _first_batch(results, model)
        aa = find(results, model=model, batch=b, phase="inference", approach="A/A control")
        inp = find(results, model=model, batch=b, phase="inference", approach="taps",
                   density="input only")
        if inp is None or inp.ratio is None:
            continue
        ci = f"[{_us(inp.overhead_us_ci_low)}, {_us(inp.overhead_us_ci_high)}]"
        if aa is not None and resolved_either_way(aa):
            parts.append(f"{model}: not resolved (the A/A control itself is off zero, "
                         f"{aa.rounds} rounds)")
        elif resolved(inp):
            missed.append(model)
            parts.append(f"{model}: +{_us(inp.overhead_us)} us per call, 95% CI {ci} "
                         f"(ratio {inp.ratio:.3f})")
        else:
            parts.append(f"{model}: {_us(inp.overhead_us)} us, 95% CI {ci}: within noise")
    if parts:
        verdict = "met" if not missed else "missed on " + ", ".join(
            f"{m} (+{_f(_pct(results, m), 1)}%)" for m in missed)
        rows.append(["installed, nothing but the input selected: overhead within noise",
                     "; ".join(parts), verdict])

    # 2. Host cost per tapped site vs a forward hook, same module calls, reference mode.
    parts = []
    chain: tuple[float | None, float | None] = (None, None)
    for model, _, point, bound, text in _per_site_against_hooks(results, "taps", "all"):
        if model == "chain":
            chain = (point, bound)
        parts.append(f"{model}: {text}")
    if parts:
        point, bound = chain
        target = PER_SITE_TARGET
        if point is None or bound is None:
            verdict = "not resolved on chain (the host-cost model): see the rows"
        elif bound <= target:
            verdict = f"met on chain: {point:.2f}, 95% bound {bound:.2f} <= {target}"
        elif point <= target:
            verdict = (f"estimate {point:.2f} <= {target} on chain, but its 95% bound "
                       f"{bound:.2f} is not: not established on this machine")
        else:
            verdict = f"missed on chain: {point:.2f} > {target} ({point / target:.1f}x the target)"
        rows.append([f"reference: host cost per site <= {target} x a forward hook's "
                     "(taps / hook, same module calls)", "; ".join(parts), verdict])

    # 2b. The dynamo frontend: host cost per functional-op site vs a hook per module call.
    parts, verdicts = [], []
    for model, t, point, bound, text in _per_site_against_hooks(results, "taps (dynamo)",
                                                                "functional"):
        parts.append(f"{model}: {text}" + (f"; {t.note}" if t.note else ""))
        if point is None or bound is None:
            verdicts.append(f"not resolved on {model}")
        else:
            verdicts.append(f"{'met' if bound <= DYNAMO_TARGET else 'missed'} on {model}")
    if parts:
        rows.append([f"dynamo frontend: host cost per site <= {DYNAMO_TARGET} x a forward "
                     "hook's (its functional ops / hooks on every module call)",
                     "; ".join(parts), "; ".join(verdicts)])

    # 2c. Statistics never slower than the tutorial logging hook (.item() twice per call).
    parts, slower = [], []
    for m in _ok(results.measurements):
        if m.approach != "taps" or m.mode != "stats" or m.phase != "inference":
            continue
        h = find(results, model=m.model, batch=m.batch, phase="inference",
                 approach="logging hook", mode="stats", density=m.density)
        if h is None or m.ratio is None or h.ratio is None:
            continue
        parts.append(f"{m.model} b{m.batch}: {m.ratio:.3f} vs {h.ratio:.3f}")
        if m.ratio > h.ratio:
            slower.append(f"{m.model} b{m.batch}")
    if parts:
        rows.append(["stats: never slower than the .item() logging hook (taps ratio vs hook "
                     "ratio, same module calls)", "; ".join(parts),
                     "met" if not slower else "slower on " + ", ".join(slower)])

    # 3. Reference mode on a device-bound batch.
    parts = []
    for model in _models(results):
        batches = sorted({m.batch for m in results.measurements if m.model == model})
        if len(batches) < 2:
            continue
        t = find(results, model=model, batch=batches[-1], phase="inference", approach="taps",
                 mode="reference", density="all")
        if t is not None:
            parts.append(f"{model} b{t.batch}: {ratio(t)}")
    rows.append(["reference: no measurable overhead on a GPU-bound batch",
                 "; ".join(parts) if parts else "-",
                 "see ratios" if cuda else "not yet measured on a GPU (CPU numbers shown)"])

    # 4. Statistics on CUDA.
    parts = []
    for model in _models(results):
        for m in _ok(results.measurements):
            if m.model == model and m.approach == "taps" and m.mode == "stats":
                sync = f", {m.host_syncs} syncs" if m.host_syncs is not None else ""
                parts.append(f"{model} b{m.batch}: {_f(m.floor_multiple, 1)}x floor{sync}")
    unavailable = [m for m in results.measurements if m.mode == "stats" and
                   m.status == "unavailable"]
    if cuda and parts:
        stats = [m for m in _ok(results.measurements) if m.approach == "taps" and
                 m.mode == "stats"]
        syncs_ok = all((m.host_syncs or 0) == 0 for m in stats)
        floor_ok = all(m.floor_multiple is not None and m.floor_multiple <= STATS_FLOOR_TARGET
                       for m in stats)
        verdict = "met" if syncs_ok and floor_ok else (
            ("host syncs in the forward; " if not syncs_ok else "")
            + ("above 1.5x the one-read floor" if not floor_ok else ""))
    elif unavailable and not parts:
        verdict = "reduce='stats' unavailable in this build"
    else:
        verdict = "not yet measured on a GPU (CPU numbers shown)"
    rows.append([f"stats on CUDA: no host sync, <= {STATS_FLOOR_TARGET}x the one-read floor",
                 "; ".join(parts) if parts else "-", verdict])

    # 5. torch.compile graph breaks.
    parts, ok = [], []
    for model in sorted({c.model for c in results.compile}):
        bare = _compile(results, model, "bare")
        tapped = _compile(results, model, "taps")
        if tapped is None:
            continue
        if tapped.graph_breaks is None or bare is None or bare.graph_breaks is None:
            parts.append(f"{model}: {tapped.status} {tapped.error[:80]}")
            ok.append(False)
            continue
        extra = tapped.graph_breaks - bare.graph_breaks
        parts.append(f"{model}: {tapped.graph_breaks} breaks, {tapped.graphs} graph(s) "
                     f"(bare: {bare.graph_breaks}, {bare.graphs})")
        ok.append(extra <= 0 and tapped.status == "ok")
    rows.append(["torch.compile: taps add no graph breaks",
                 "; ".join(parts) if parts else "-",
                 ("met" if all(ok) else "missed") if parts else "not measured in this run"])

    # 6. Compiled taps against their floor, the compiled extractor.
    parts, ok = [], []
    for model in sorted({c.model for c in results.compile}):
        tapped = _compile(results, model, "taps")
        floor = tapped.ratio_vs_compiled_extractor if tapped is not None else None
        if tapped is None or floor is None:
            continue
        parts.append(f"{model}: taps / extractor {floor:.3f}, taps / compiled bare "
                     f"{_f(tapped.ratio_vs_compiled_bare, 3)}")
        ok.append(floor <= COMPILE_FLOOR_TARGET)
    rows.append([f"torch.compile: compiled taps <= {COMPILE_FLOOR_TARGET}x the compiled "
                 "extractor returning the same values",
                 "; ".join(parts) if parts else "-",
                 ("met" if all(ok) else "missed") if parts else "not measured in this run"])
    return rows


def resolved(m: Measurement) -> bool:
    """The overhead stands out of the noise: its 95% interval lies above zero."""
    return m.overhead_us_ci_low is not None and m.overhead_us_ci_low > 0


def resolved_either_way(m: Measurement) -> bool:
    """The 95% interval excludes zero, on either side (for an A/A control: a biased method)."""
    lo, hi = m.overhead_us_ci_low, m.overhead_us_ci_high
    return lo is not None and hi is not None and (lo > 0 or hi < 0)


def _pct(results: Results, model: str) -> float | None:
    m = find(results, model=model, batch=_first_batch(results, model), phase="inference",
             approach="taps", density="input only")
    if m is None or m.ratio is None:
        return None
    return (m.ratio - 1) * 100


def per_site_ratio(t: Measurement, h: Measurement
                   ) -> tuple[float | None, float | None, str]:
    """Taps' cost per site over a hook's: (point estimate, 95% upper bound, text)."""
    if not (resolved(h) and h.per_site_us and h.n_sites):
        return None, None, "hook overhead not resolved from noise"
    if t.per_site_us is None or not t.n_sites or t.overhead_us_ci_high is None:
        return None, None, "no taps figure"
    point = max(t.per_site_us, 0.0) / h.per_site_us
    bound = max(t.overhead_us_ci_high, 0.0) / t.n_sites / h.per_site_us
    tag = "" if resolved(t) else ", taps not resolved from noise"
    return point, bound, (f"{_us(t.per_site_us)} vs {_us(h.per_site_us)} us/site = "
                          f"{point:.2f} (95% bound {bound:.2f}{tag})")


def _per_site_against_hooks(results: Results, approach: str, density: str
                            ) -> Iterator[tuple[str, Measurement, float | None, float | None,
                                                str]]:
    """Per model at its first batch: ``approach``'s reference capture at ``density`` against
    hooks on every module call, as ``(model, taps row, point, 95% bound, text)``."""
    for model in _models(results):
        b = _first_batch(results, model)
        t = find(results, model=model, batch=b, phase="inference", approach=approach,
                 mode="reference", density=density)
        h = find(results, model=model, batch=b, phase="inference", approach="module hooks",
                 mode="reference", density="all")
        if t is not None and h is not None:
            yield (model, t, *per_site_ratio(t, h))


def _compile(results: Results, model: str, approach: str) -> CompileRecord | None:
    for c in results.compile:
        if c.model == model and c.approach == approach:
            return c
    return None


# -- tables ----------------------------------------------------------------------------------

def per_site_table(results: Results) -> str:
    rows = []
    for model in _models(results):
        for batch in sorted({m.batch for m in results.measurements if m.model == model}):
            for d in ("one", "10%", "all"):
                got = {a: find(results, model=model, batch=batch, phase="inference",
                               approach=a, mode="reference", density=d)
                       for a in ("taps", "module hooks", "global hook")}
                t, h = got["taps"], got["module hooks"]
                if t is None or h is None:
                    continue
                _, _, text = per_site_ratio(t, h)
                rows.append([model, batch, d, t.n_sites,
                             *(_site_cost(m) for m in got.values()), text])
    return _table(rows, ["model", "batch", "density", "sites", "taps us/site",
                         "module hooks us/site", "global hook us/site", "taps / hooks"])


def _site_cost(m: Measurement | None) -> str:
    if m is None:
        return "-"
    return _us(m.per_site_us) + ("" if resolved(m) else " (noise)")


def overhead_table(results: Results, phase: str, modes: Sequence[str] | None = None,
                   approaches: Sequence[str] | None = None) -> str:
    rows = []
    for m in _ok(results.measurements):
        if m.phase != phase or (modes is not None and m.mode not in modes):
            continue
        if approaches is not None and m.approach not in approaches:
            continue
        rows.append([m.model, m.batch, m.approach, m.mode, m.density, m.n_sites,
                     _f(m.baseline_ms, 3), ratio(m), _overhead(m), _site_cost(m)
                     if m.n_sites else "-", _bytes(m.captured_bytes), _mem_delta(m),
                     "-" if m.stale_values is None else m.stale_values])
    return _table(rows, ["model", "batch", "approach", "mode", "density", "sites",
                         "bare ms", "ratio [p5, p95]", "overhead us [IQR]", "us/site",
                         "held", "peak mem delta", "stale"])


def modes_table(results: Results) -> str:
    cuda = results.environment.device == "cuda"
    rows = []
    for m in results.measurements:
        if m.phase != "inference" or m.density != "all" or m.approach in (
                "A/A control", "traced (no taps)"):
            continue
        if m.status != "ok":
            rows.append([m.model, m.batch, m.mode, m.approach, m.status, "-", "-", "-", "-",
                         *(("-", "-") if cuda else ())])
            continue
        extra = (_bytes(m.d2h_bytes), "-" if m.host_syncs is None else m.host_syncs) if cuda \
            else ()
        rows.append([m.model, m.batch, m.mode, m.approach, ratio(m), _us(m.overhead_us),
                     _us(m.floor_us), _f(m.floor_multiple, 1), _bytes(m.captured_bytes), *extra])
    headers = ["model", "batch", "mode", "approach", "ratio [p5, p95]", "overhead us",
               "floor us", "x floor", "held"]
    if cuda:
        headers += ["D2H", "host syncs"]
    return _table(rows, headers)


def compile_table(results: Results) -> str:
    rows = []
    for c in results.compile:
        same = "=" if c.captured_match_eager else "!="
        match = "-" if c.captured is None else f"{c.captured} ({same} eager)"
        rows.append([c.model, c.batch, c.approach, c.status, _f(c.compile_s, 1),
                     "-" if c.graphs is None else c.graphs,
                     "-" if c.graph_breaks is None else c.graph_breaks, match,
                     _f(c.eager_ms, 3), _f(c.compiled_ms, 3),
                     f"{_f(c.ratio_vs_compiled_bare, 3)} [{_f(c.ratio_p5, 3)}, "
                     f"{_f(c.ratio_p95, 3)}]" if c.ratio_vs_compiled_bare else "-",
                     _f(c.ratio_vs_compiled_extractor, 3),
                     (c.error or "; ".join(c.break_reasons))[:120] or "-"])
    return _table(rows, ["model", "batch", "approach", "status", "compile s", "graphs",
                         "breaks", "captured", "eager ms", "compiled ms",
                         "ratio vs compiled bare", "vs compiled extractor (floor)",
                         "error / break reasons"])


def problems_table(results: Results) -> str:
    seen = set()
    rows = []
    for m in results.measurements:
        if m.status == "ok":
            continue
        key = (m.model, m.approach, m.mode, m.density, m.status, m.note)
        if key in seen:
            continue
        seen.add(key)
        rows.append([m.model, m.batch, m.phase, m.approach, m.mode, m.density, m.status,
                     m.note])
    return _table(rows, ["model", "batch", "phase", "approach", "mode", "density", "status",
                         "why"])


def environment_lines(results: Results) -> list[str]:
    e = results.environment
    link = f", host link {e.link_gbps} GB/s" if e.link_gbps is not None else ""
    return [
        f"- device: **{e.device}**, {e.device_name} ({e.cpu_count} logical CPUs); "
        f"{e.threads} torch threads; dtype {e.dtype}",
        f"- torch {e.torch_version}, Python {e.python_version}, {e.platform}",
        f"- fxprobe {e.fxprobe_version} at commit {e.fxprobe_commit}",
        f"- measured bandwidths: copy {e.copy_gbps} GB/s, read {e.read_gbps} GB/s{link}"
        + (f" (read: {e.read_basis})" if e.read_basis else
           " (read: one 64 MiB `sum` per synchronisation, the probe before 2026-11)"),
        f"- run: {e.date}{', --quick (smoke test: not for quoting)' if e.quick else ''}",
    ]


def markdown(results: Results, level: int = 1, plot: str | None = None) -> str:
    """The results as Markdown, with headings starting at ``level``."""
    h = "#" * level
    out = [f"{h} fxprobe overhead benchmark ({results.environment.device})", ""]
    out += environment_lines(results)
    out += ["", "Ratios are medians over interleaved rounds of treatment / bare eager model, "
            "with the 5th and 95th percentiles; `overhead us` is the median per-round "
            "difference per call with its IQR; `us/site` divides it by the values captured "
            "per call. `(noise)` marks a cost whose distribution-free 95% confidence interval "
            "of the median includes zero. `peak mem` is measured in a fresh process per treatment "
            "(see the method).", ""]
    sections: list[tuple[str, Callable[[], str]]] = [
        ("Targets", lambda: _table(targets(results), ["target", "measured", "verdict"])),
        ("Host cost per site: taps vs hooks on the same module calls (reference capture)",
         lambda: per_site_table(results)),
        ("Every inference measurement", lambda: overhead_table(results, "inference")),
        ("Capture modes at every module call, against their floors",
         lambda: modes_table(results)),
        ("Training step (forward + backward)", lambda: overhead_table(results, "train")),
        ("torch.compile", lambda: compile_table(results)),
        ("Unavailable and failed", lambda: problems_table(results)),
    ]
    for title, body in sections:
        out += [f"{h}# {title}", "", body(), ""]
        if title.startswith("Host cost") and plot:
            out += [f"![overhead against tap density]({plot})", ""]
    if results.skipped:
        out += [f"{h}# Not run", ""] + [f"- {s}" for s in results.skipped] + [""]
    return "\n".join(out)


# -- plot ------------------------------------------------------------------------------------

def plot(results: Results, path: Path) -> str | None:
    """Overhead against tap density, one panel per model; None (with why) if not drawn."""
    try:
        import matplotlib
    except ImportError:
        return "matplotlib is not installed, so no plot was drawn (pip install matplotlib)"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = _models(results)
    fig, axes = plt.subplots(1, max(1, len(models)), figsize=(4 * max(1, len(models)), 3.4),
                             squeeze=False)
    for ax, model in zip(axes[0], models, strict=False):
        b = _first_batch(results, model)
        for approach, marker in (("taps", "o"), ("module hooks", "s"), ("global hook", "^")):
            xs, ys, lo, hi = [], [], [], []
            for i, d in enumerate(DENSITY_ORDER):
                m = find(results, model=model, batch=b, phase="inference", approach=approach,
                         mode="reference", density=d)
                if m is None or m.ratio is None:
                    continue
                xs.append(i)
                ys.append(m.ratio)
                lo.append(m.ratio - (m.ratio_p5 or m.ratio))
                hi.append((m.ratio_p95 or m.ratio) - m.ratio)
            if xs:
                ax.errorbar(xs, ys, yerr=[lo, hi], marker=marker, capsize=3, label=approach)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xticks(range(len(DENSITY_ORDER)), DENSITY_ORDER)
        ax.set_title(f"{model}, batch {b}")
        ax.set_ylabel("time / bare model")
        ax.legend(fontsize=8)
    e = results.environment
    fig.suptitle(f"fxprobe overhead vs tap density ({e.device_name}, {e.threads} threads, "
                 f"torch {e.torch_version})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


# -- docs ------------------------------------------------------------------------------------

def _markers(device: str) -> tuple[str, str]:
    return (f"<!-- BEGIN GENERATED RESULTS: {device} -->",
            f"<!-- END GENERATED RESULTS: {device} -->")


def update_docs(results: Results, path: Path, plot_path: str | None = None) -> None:
    """Replace the generated block for this run's device in ``path`` (markers must exist)."""
    begin, end = _markers(results.environment.device)
    text = path.read_text()
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.S)
    if not pattern.search(text):
        raise ValueError(f"{path} has no '{begin}' ... '{end}' block to fill in")
    body = markdown(results, level=2, plot=plot_path)
    body = body.split("\n", 2)[2]  # the section heading is the document's own
    text = pattern.sub(lambda _: f"{begin}\n{body.rstrip()}\n{end}", text)
    path.write_text(text)
