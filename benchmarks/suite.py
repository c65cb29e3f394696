"""What the suite runs (the plan) and running it: groups of treatments timed against one model.

A *group* is one model at one batch size in one phase (inference or a training step); all its
treatments are timed in the same interleaved rounds against the same bare eager model.
"""

from __future__ import annotations

import datetime
import gc
import os
import platform
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

import fxprobe

from . import approaches as ap
from . import floors, memprobe, timing
from .compiled import run_compile
from .models import MODELS, ModelSpec
from .modes import MODES, availability
from .progress import Progress
from .records import Environment, Measurement, Results


@dataclass(frozen=True)
class Case:
    """One treatment of a group: an approach, a mode and a site set."""

    approach: str
    mode: str
    density: str

    @property
    def key(self) -> str:
        return f"{self.approach}|{self.mode}|{self.density}"


@dataclass(frozen=True)
class Group:
    """The treatments timed together against one model, batch size and phase."""

    model: str
    batch: int
    phase: str
    cases: tuple[Case, ...]


@dataclass(frozen=True)
class Config:
    """A run's settings, from the command line."""

    device: torch.device
    quick: bool
    models: tuple[str, ...]
    modes: tuple[str, ...]
    dtype: torch.dtype
    threads: int
    seed: int = 0
    rounds: int | None = None
    compile: bool = False
    compile_models: tuple[str, ...] = ("mlp", "chain")
    progress: bool = True


# Per-group time budgets (seconds) and bounds on the number of rounds.
_BUDGET = {True: (1.0, 3, 5), False: (30.0, 5, 60)}
_MIN_SLOT_S = {True: 0.004, False: 0.025}
_WARMUP_S = {True: 0.02, False: 0.3}
# Models whose forward is expensive on a CPU get fewer hook variants at the first batch size.
_HEAVY = ("resnet50", "gpt2")
_MEMORY_MODES = ("reference", "clone", "stats")
# Models on which the dynamo frontend is timed beside fx taps and hooks (its functional ops).
_DYNAMO = ("gpt2",)


def _site_cases(model: str, modes: Sequence[str], quick: bool) -> list[Case]:
    """Reference capture at every density, against hooks: the host-cost group."""
    short = quick and model in _HEAVY  # a smoke run touches every mode, not every density
    cases = [Case("A/A control", "-", "none"), Case("traced (no taps)", "-", "none")]
    if "reference" in modes:
        dens: tuple[str, ...] = (("input only", "all") if short
                                 else ("input only", "one", "10%", "all"))
        cases += [Case("taps", "reference", d) for d in dens]
        dens = ("all",) if short else ("one", "10%", "all")
        cases += [Case("module hooks", "reference", d) for d in dens]
        dens = ("all",) if model in _HEAVY else ("one", "10%", "all")
        cases += [Case("global hook", "reference", d) for d in dens]
        cases += [Case("taps", "reference", "functional")]
        if model in _DYNAMO:
            cases += [Case("taps (dynamo)", "reference", "functional")]
        if not short:
            cases += [Case("taps", "reference", "every site")]
    return cases


def _mode_cases(model: str, modes: Sequence[str], quick: bool) -> list[Case]:
    """The other modes at every module call. Timed in a group of their own, because statistics
    can make a forward twenty times slower and would leave the host-cost group few rounds."""
    short = quick and model in _HEAVY
    cases = []
    if "stats" in modes:
        cases.append(Case("logging hook", "stats", "all"))
    for m in modes:
        if m != "reference":
            cases.append(Case("taps", m, "all"))
            if not short:
                cases.append(Case("module hooks", m, "all"))
    return cases


def _batch_cases(modes: Sequence[str]) -> list[Case]:
    cases = []
    for m in modes:
        if m in ("reference", "clone", "stats"):
            cases += [Case("taps", m, "all"), Case("module hooks", m, "all")]
    if "stats" in modes:
        cases.append(Case("logging hook", "stats", "all"))
    return cases


def plan(config: Config) -> list[Group]:
    """The groups a run measures, in order (inference first: training moves BN statistics)."""
    groups: list[Group] = []
    trains: list[Group] = []
    dev = config.device.type
    for name in config.models:
        spec = MODELS[name]
        batches = spec.quick_batches if config.quick else spec.batches[dev]
        for cases in (_site_cases(name, config.modes, config.quick),
                      _mode_cases(name, config.modes, config.quick)):
            if cases:
                groups.append(Group(name, batches[0], "inference", tuple(cases)))
        if len(batches) > 1:
            cases = _batch_cases(config.modes)
            if cases:
                groups.append(Group(name, batches[-1], "inference", tuple(cases)))
        train_mode = "reference" if "reference" in config.modes else config.modes[0]
        if not (config.quick and name in _HEAVY):
            trains.append(Group(name, batches[0], "train", (
                Case("taps", train_mode, "all"), Case("module hooks", train_mode, "all"))))
    return groups + trains


# -- environment -----------------------------------------------------------------------------

def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _fxprobe_version() -> str:
    version = getattr(fxprobe, "__version__", None)
    if version:
        return str(version)
    try:
        return metadata.version("fxprobe")
    except metadata.PackageNotFoundError:
        return "unknown"


def _commit() -> str:
    root = Path(fxprobe.__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, timeout=10, check=True)
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "fxprobe"],
                               capture_output=True, text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def environment(config: Config, bw: floors.Bandwidths) -> Environment:
    cuda = config.device.type == "cuda"
    return Environment(
        device=config.device.type,
        device_name=torch.cuda.get_device_name(config.device) if cuda else _cpu_name(),
        torch_version=torch.__version__, fxprobe_version=_fxprobe_version(),
        fxprobe_commit=_commit(), python_version=platform.python_version(),
        platform=platform.platform(), dtype=str(config.dtype).replace("torch.", ""),
        threads=torch.get_num_threads(), cpu_count=os.cpu_count() or 0,
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        quick=config.quick, copy_gbps=round(bw.copy_gbps, 2), read_gbps=round(bw.read_gbps, 2),
        link_gbps=round(bw.link_gbps, 2) if bw.link_gbps is not None else None,
        read_basis=bw.read_basis,
    )


# -- running a group -------------------------------------------------------------------------

def _inputs(spec: ModelSpec, batch: int, config: Config) -> tuple[Any, ...]:
    args = spec.make_input(batch, config.quick, config.device)
    return tuple(a.to(config.dtype) if a.is_floating_point() else a for a in args)


def _site_bytes(model: torch.nn.Module, inputs: tuple[Any, ...]) -> dict[str, int]:
    """Bytes of each site's value, from one forward with every site copied."""
    tapped = fxprobe.tap(model, copy="always")
    with torch.no_grad():
        tapped(*inputs)
    out = {name: timing.value_bytes(v) for name, v in tapped.taps.items()
           if timing.tensors(v)}
    tapped.remove()
    return out


def _stale(truth: list[Any], got: list[Any]) -> tuple[int | None, str]:
    if len(truth) != len(got):
        return None, f"stale check skipped: {len(got)} values vs {len(truth)} module calls"
    bad = sum(1 for a, b in zip(truth, got, strict=True)
              if not (isinstance(b, torch.Tensor) and torch.equal(a, b)))
    return bad, ""


def _build(case: Case, model: torch.nn.Module, inputs: tuple[Any, ...], train: bool,
           sets: dict[str, ap.SiteSet], device: torch.device) -> ap.Built:
    if case.approach == "A/A control":
        return ap.bare(model, inputs, train, case.key)
    if case.approach == "traced (no taps)":
        return ap.traced(model, inputs, train, case.key)
    sites = sets[case.density]
    if case.approach == "taps":
        return ap.taps(model, inputs, train, case.key, sites, MODES[case.mode], device,
                       every=case.density == "every site")
    if case.approach == "taps (dynamo)":
        return ap.taps_dynamo(model, inputs, train, case.key, sites, MODES[case.mode], device)
    if case.approach == "module hooks":
        return ap.module_hooks(model, inputs, train, case.key, sites, MODES[case.mode])
    if case.approach == "global hook":
        return ap.global_hook(model, inputs, train, case.key, sites, MODES[case.mode])
    if case.approach == "logging hook":
        return ap.logging_hook(model, inputs, train, case.key, sites)
    raise ValueError(f"unknown approach {case.approach!r}")


class Runner:
    """Runs the plan; keeps each model built once."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.models: dict[str, torch.nn.Module] = {}
        self.unavailable = {m: availability(MODES[m], config.device) for m in config.modes}
        self.bw = floors.measure(config.device)
        self.env = environment(config, self.bw)

    def model(self, name: str) -> torch.nn.Module:
        if name not in self.models:
            torch.manual_seed(self.config.seed)
            self.models[name] = MODELS[name].build().to(self.config.device, self.config.dtype)
        return self.models[name]

    def base_record(self, group: Group, case: Case, sites: ap.SiteSet | None) -> Measurement:
        spec = MODELS[group.model]
        env = self.env
        return Measurement(
            model=group.model, input_shape=spec.shape(self.config.quick), batch=group.batch,
            phase=group.phase, approach=case.approach, mode=case.mode,
            density=case.density, site_kind=sites.site_kind if sites else "-", n_sites=0,
            status="ok", note="", device=env.device, device_name=env.device_name,
            torch_version=env.torch_version, dtype=env.dtype, threads=env.threads,
        )

    def run_group(self, group: Group, progress: Progress, done: int) -> list[Measurement]:
        cfg = self.config
        cuda = cfg.device.type == "cuda"
        train = group.phase == "train"
        model = self.model(group.model)
        model.train(train)
        inputs = _inputs(MODELS[group.model], group.batch, cfg)
        label = f"{group.model} b{group.batch} {group.phase}"
        progress.update(done, label, "building")
        records: list[Measurement] = []
        with torch.set_grad_enabled(train):
            sites_of = fxprobe.sites(model, train=train)
            sets = ap.site_sets(sites_of.records, _site_bytes(model, inputs))
            built: dict[Case, ap.Built] = {}
            for case in group.cases:
                if case.density not in sets and case.density != "none":
                    continue  # e.g. no functional ops in this model
                sites = sets.get(case.density)
                base = self.base_record(group, case, sites)
                why = self.unavailable.get(case.mode)
                if why is not None:
                    records.append(replace(base, status="unavailable", note=why))
                    continue
                try:
                    built[case] = _build(case, model, inputs, train, sets, cfg.device)
                except Exception as e:  # recorded, never hidden: the row says what failed
                    records.append(replace(base, status="failed",
                                           note=f"{type(e).__name__}: {str(e).splitlines()[0]}"))
            baseline = ap.step(model, model, inputs, train)
            iters, call_ms = timing.calibrate(baseline, min_slot_s=_MIN_SLOT_S[cfg.quick],
                                              warmup_s=_WARMUP_S[cfg.quick], cuda=cuda)
            treatments = [b.treatment for b in built.values()]
            slots = timing.warm(treatments, iters, cuda)
            rounds = cfg.rounds or self._rounds(iters * call_ms, list(slots.values()), group)

            def on_round(r: int) -> None:
                progress.update(done + (r + 1) / rounds, label, f"round {r + 1}/{rounds}")

            samples = timing.interleave(baseline, treatments, iters=iters, rounds=rounds, cuda=cuda,
                                        seed=cfg.seed, on_round=on_round)
            truth = self._truth(model, inputs, sets) if not train and "all" in sets else None
            for case, b in built.items():
                records.append(self._record(group, case, sets.get(case.density), b,
                                            samples[case.key], iters, truth))
                b.close()
        built.clear()
        gc.collect()
        return records

    def _rounds(self, base_slot_ms: float, slot_ms: list[float], group: Group) -> int:
        """As many rounds as fit the group's time budget, within bounds."""
        budget, lo, hi = _BUDGET[self.config.quick]
        if not self.config.quick and group.model not in _HEAVY and any(
                c.approach == "A/A control" for c in group.cases):
            budget *= 2  # the host-cost groups of the light models: the claim rests on them
        per_round = ((len(slot_ms) + 1) * base_slot_ms + sum(slot_ms)) / 1e3 * 1.2
        return max(lo, min(hi, int(budget / max(per_round, 1e-9))))

    def _probe_memory(self, group: Group, case: Case, sites: ap.SiteSet | None) -> bool:
        """Peak memory takes a child process per treatment: measured where it says something."""
        cfg = self.config
        return (not cfg.quick and group.phase == "inference" and case.density == "all"
                and sites is not None and case.approach in ("taps", "module hooks")
                and case.mode in _MEMORY_MODES
                and group.batch == MODELS[group.model].batches[cfg.device.type][0]
                # RSS moves in pages and allocator chunks: below a MiB of captures it is noise.
                and (cfg.device.type == "cuda" or sites.value_bytes >= 2**20))

    def _truth(self, model: torch.nn.Module, inputs: tuple[Any, ...],
               sets: dict[str, ap.SiteSet]) -> list[Any]:
        """Every module call's output, cloned as it is produced (hooks): the reference."""
        b = ap.module_hooks(model, inputs, False, "truth", sets["all"], MODES["clone"])
        with timing.entered(b.treatment):
            b.treatment.run()
        values = b.per_call() if b.per_call else []
        b.close()
        return values

    def _record(self, group: Group, case: Case, sites: ap.SiteSet | None, b: ap.Built,
                s: timing.Samples, iters: int, truth: list[Any] | None) -> Measurement:
        cfg = self.config
        cuda = cfg.device.type == "cuda"
        summ = timing.summarize(s, cuda)
        with timing.entered(b.treatment):
            b.treatment.run()
        n = b.count()
        captured = b.captured()
        notes = []
        stale = None
        if (truth is not None and case.mode == "reference" and case.density == "all"
                and b.per_call is not None):
            stale, why = _stale(truth, b.per_call())
            if why:
                notes.append(why)
        d2h = None
        syncs = None
        if cuda:
            d2h = timing.storage_bytes(captured, "cpu") + n * b.d2h_per_call
            syncs = timing.count_syncs(b.treatment)
        peak, base_peak = None, None
        if self._probe_memory(group, case, sites):
            peak, base_peak, why = memprobe.measure(
                group.model, group.batch, cfg.quick, case.approach, case.mode,
                cfg.device.type, self.env.dtype, self.env.threads, cfg.seed)
            if why:
                notes.append(why)
        floor, basis = (None, "")
        multiple = None
        if sites is not None and case.approach not in ("A/A control", "traced (no taps)"):
            floor, basis = floors.floor_us(case.mode, sites.value_bytes, self.bw, cfg.device)
            if floor and floor > 0:
                multiple = summ.overhead_us / floor
        per_site = summ.overhead_us / n if n else None
        if case.density == "input only":
            notes.append("taps only the input placeholder: fxprobe installed, nothing else "
                         "selected (a selector matching nothing raises SelectorError)")
        if case.approach == "global hook":
            notes.append("fires for every module call; selected modules filtered in the hook")
        if b.first_call_ms is not None:
            notes.append(f"first call {b.first_call_ms:.0f} ms (dynamo capture and rewrite, "
                         "not in the timed slots)")
        if case.approach == "taps" and case.mode == "reference" and b.copies:
            notes.append(f"{b.copies} copies inserted before in-place ops")
        return replace(
            self.base_record(group, case, sites), n_sites=n, note="; ".join(notes),
            rounds=summ.rounds, iters=iters, baseline_ms=summ.baseline_ms,
            treatment_ms=summ.treatment_ms, ratio=summ.ratio, ratio_p5=summ.ratio_p5,
            ratio_q25=summ.ratio_q25, ratio_q75=summ.ratio_q75, ratio_p95=summ.ratio_p95,
            overhead_us=summ.overhead_us, overhead_us_q25=summ.overhead_us_q25,
            overhead_us_q75=summ.overhead_us_q75, overhead_us_ci_low=summ.overhead_us_ci[0],
            overhead_us_ci_high=summ.overhead_us_ci[1], per_site_us=per_site,
            host_ms=summ.host_ms,
            peak_mem_bytes=peak, baseline_peak_mem_bytes=base_peak,
            captured_bytes=timing.storage_bytes(captured), d2h_bytes=d2h, host_syncs=syncs,
            stale_values=stale, copies=b.copies, floor_us=floor, floor_basis=basis,
            floor_multiple=multiple, samples_ms=tuple(round(v, 5) for v in s.treatment),
            baseline_samples_ms=tuple(round(v, 5) for v in s.baseline),
        )


def run(config: Config, on_partial: Callable[[Results], None] | None = None) -> Results:
    """Run the whole plan (and the compile suite when asked).

    ``on_partial`` receives the results so far after every group and every compiled model
    (``skipped`` then says what is still to come), so that a run stopped from outside, say
    by a time limit during compilation, leaves what it measured.
    """
    torch.set_num_threads(config.threads)
    groups = plan(config)
    compile_models = [m for m in config.compile_models if m in config.models]
    total = len(groups) + (len(compile_models) if config.compile else 0)
    progress = Progress(total, enabled=config.progress)
    runner = Runner(config)
    measurements: list[Measurement] = []
    skipped: list[str] = []
    compiled = []
    # Objects alive now (torch, the models) are left out of later collections, which keeps the
    # collections between rounds short; unfrozen at the end.
    gc.freeze()
    todo = [f"{g.model} b{g.batch} {g.phase}" for g in groups]
    todo += [f"torch.compile {m}" for m in (compile_models if config.compile else ())]

    def partial(done: int) -> None:
        if on_partial is not None:
            left = todo[done:]
            note = (f"incomplete run: {len(left)} of {len(todo)} steps not measured yet "
                    f"({', '.join(left)})")
            on_partial(Results(runner.env, tuple(measurements), tuple(compiled), (note,)))

    try:
        for i, group in enumerate(groups):
            measurements += runner.run_group(group, progress, i)
            partial(i + 1)
        for j, name in enumerate(compile_models if config.compile else ()):
            progress.update(len(groups) + j, f"torch.compile {name}")
            compiled += run_compile(name, runner.model(name), _inputs(MODELS[name], 1, config),
                                    runner.env, quick=config.quick, seed=config.seed)
            partial(len(groups) + j + 1)
    finally:
        gc.unfreeze()
    if config.compile:
        if not compile_models:
            skipped.append("torch.compile: none of the selected models is in the compile set "
                           f"({', '.join(config.compile_models)})")
    else:
        skipped.append("torch.compile: skipped (--quick runs skip it unless --compile)"
                       if config.quick else "torch.compile: skipped (--no-compile)")
    progress.update(total, "done")
    progress.close()
    return Results(runner.env, tuple(measurements), tuple(compiled), tuple(skipped))
