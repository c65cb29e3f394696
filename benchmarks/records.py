"""What the suite writes: one frozen dataclass per measurement, and the JSON file that holds them.

Every record repeats the device name, torch version, dtype and thread count, so that a row copied
out of a table still says what it ran on.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SCHEMA = 1


@dataclass(frozen=True)
class Environment:
    """Where and with what a run was made."""

    device: str
    """``cpu`` or ``cuda``."""
    device_name: str
    """The CPU model (``/proc/cpuinfo``) or the GPU name (``torch.cuda.get_device_name``)."""
    torch_version: str
    """``torch.__version__``."""
    fxprobe_version: str
    """``fxprobe.__version__`` or the installed distribution's version."""
    fxprobe_commit: str
    """The git commit of the repository, with ``+dirty`` when ``fxprobe/`` had local edits."""
    python_version: str
    """``platform.python_version()``."""
    platform: str
    """``platform.platform()``."""
    dtype: str
    """Floating-point dtype of the models and inputs."""
    threads: int
    """``torch.get_num_threads()`` during the run (set explicitly by the suite)."""
    cpu_count: int
    """``os.cpu_count()``: a shared machine may run other work beside the benchmark."""
    date: str
    """UTC time the run started, ISO 8601."""
    quick: bool
    """True for ``--quick`` runs: small inputs, few rounds; for smoke tests, not for quoting."""
    copy_gbps: float
    """Measured copy bandwidth (bytes read + written per second / 1e9) of a large ``copy_``."""
    read_gbps: float
    """Measured read bandwidth (bytes per second / 1e9): the fastest of ``sum`` and ``amax``
    over a large tensor (see ``read_basis``; runs before 2026-11 used one 64 MiB ``sum``)."""
    link_gbps: float | None
    """Measured device-to-host bandwidth into pinned memory (CUDA only)."""
    read_basis: str = ""
    """How ``read_gbps`` was measured (empty in older records)."""


@dataclass(frozen=True)
class Measurement:
    """One treatment timed against the bare eager model, interleaved in the same process."""

    model: str
    """Benchmark model name (``chain``, ``mlp``, ``resnet50``, ``gpt2``)."""
    input_shape: str
    """Per-example input, e.g. ``3x224^2 image``."""
    batch: int
    """Batch size."""
    phase: str
    """``inference`` (under ``torch.no_grad``) or ``train`` (forward + backward of ``sum``)."""
    approach: str
    """``A/A control``, ``traced (no taps)``, ``taps``, ``module hooks``, ``global hook``
    or ``logging hook``."""
    mode: str
    """Capture mode (``reference``, ``clone``, ``stats``, ``offload``, ``intervention``),
    ``-`` for approaches that capture nothing."""
    density: str
    """Which sites: ``none``, ``input only``, ``one``, ``10%``, ``all``, ``functional``,
    ``every site``."""
    site_kind: str
    """``module calls`` (reachable by hooks too), ``functional ops`` (taps only) or ``any``."""
    n_sites: int
    """Values captured per forward, counted after a forward (module calls for hooks)."""
    status: str
    """``ok``, ``unavailable`` (the mode is not in this fxprobe build) or ``failed``."""
    note: str
    """Why a record is unavailable or failed, or a caveat about the number."""
    device: str
    """``cpu`` or ``cuda``."""
    device_name: str
    """CPU model or GPU name."""
    torch_version: str
    """``torch.__version__``."""
    dtype: str
    """Floating-point dtype."""
    threads: int
    """``torch.get_num_threads()``."""
    rounds: int = 0
    """Interleaved rounds (each: the treatment between two baseline slots)."""
    iters: int = 0
    """Forward calls (or training steps) per timed slot."""
    baseline_ms: float | None = None
    """Median time per call of the bare eager model."""
    treatment_ms: float | None = None
    """Median time per call of the treatment."""
    ratio: float | None = None
    """Median over rounds of treatment / neighbouring baseline (1.00 = no overhead)."""
    ratio_p5: float | None = None
    """5th percentile of the per-round ratios."""
    ratio_q25: float | None = None
    """25th percentile of the per-round ratios."""
    ratio_q75: float | None = None
    """75th percentile of the per-round ratios."""
    ratio_p95: float | None = None
    """95th percentile of the per-round ratios."""
    overhead_us: float | None = None
    """Median over rounds of (treatment - baseline) per call, microseconds."""
    overhead_us_q25: float | None = None
    """25th percentile of the per-round differences, microseconds."""
    overhead_us_q75: float | None = None
    """75th percentile of the per-round differences, microseconds."""
    overhead_us_ci_low: float | None = None
    """Lower end of a distribution-free 95% confidence interval of ``overhead_us``."""
    overhead_us_ci_high: float | None = None
    """Upper end of that interval: ``overhead_us`` is resolved from noise when the low end
    is above zero, and the high end bounds it when it is not."""
    per_site_us: float | None = None
    """``overhead_us / n_sites``: the cost of one captured value."""
    host_ms: float | None = None
    """CUDA only: host time to issue one call (the rest of ``treatment_ms`` is device time)."""
    peak_mem_bytes: int | None = None
    """Peak memory of a forward in a fresh process holding the previous forward's capture: RSS
    high-water mark (CPU) or ``max_memory_allocated`` (CUDA). Measured for inference at every
    module call, modes reference/clone/stats, first batch size; None elsewhere."""
    baseline_peak_mem_bytes: int | None = None
    """The same for the bare model, in the same child process, just before."""
    captured_bytes: int | None = None
    """Bytes of distinct tensor storage the capture holds after a forward."""
    d2h_bytes: int | None = None
    """CUDA only: bytes the capture moved to the host per forward (offload, ``.item()``)."""
    host_syncs: int | None = None
    """CUDA only: host synchronisations in one forward (``torch.cuda.set_sync_debug_mode``)."""
    stale_values: int | None = None
    """Captured values that differ from a clone taken right after the op (overwritten later
    by an in-place op); checked for reference captures at inference."""
    copies: int | None = None
    """Taps only: copies fxprobe inserted because a later in-place op would overwrite a value."""
    floor_us: float | None = None
    """Physical lower bound of the mode's overhead per call, microseconds (see ``floor_basis``)."""
    floor_basis: str = ""
    """How the floor was computed."""
    floor_multiple: float | None = None
    """``overhead_us / floor_us`` (1.0 = at the floor); None when the floor is zero."""
    samples_ms: tuple[float, ...] = ()
    """The treatment's time per call in each round, in round order."""
    baseline_samples_ms: tuple[float, ...] = ()
    """The mean of the two baseline slots beside it in each round."""


@dataclass(frozen=True)
class CompileRecord:
    """``torch.compile`` of one approach: compile time, graphs, breaks, steady-state cost."""

    model: str
    """Benchmark model name."""
    input_shape: str
    """Per-example input."""
    batch: int
    """Batch size."""
    approach: str
    """``bare``, ``taps`` (reference, all module calls), ``extractor`` (``fxprobe.extractor``
    returning the same values: the floor of compiled taps) or ``module hooks``."""
    status: str
    """``ok`` or ``failed``."""
    error: str
    """The failure, verbatim (first lines), when ``status`` is ``failed``."""
    device: str
    """``cpu`` or ``cuda``."""
    device_name: str
    """CPU model or GPU name."""
    torch_version: str
    """``torch.__version__``."""
    dtype: str
    """Floating-point dtype."""
    threads: int
    """``torch.get_num_threads()``."""
    backend: str = "inductor"
    """``torch.compile`` backend."""
    compile_s: float | None = None
    """Wall time of the first call of the compiled module (tracing + compilation)."""
    graphs: int | None = None
    """Graphs dynamo produced (``torch._dynamo.explain``)."""
    graph_breaks: int | None = None
    """Graph breaks (``torch._dynamo.explain``)."""
    break_reasons: tuple[str, ...] = field(default_factory=tuple)
    """The first few graph-break reasons."""
    captured: int | None = None
    """Values in ``tapped.taps`` (or the hook store) after a compiled forward."""
    captured_match_eager: bool | None = None
    """Whether those values equal the ones an eager forward captures."""
    eager_ms: float | None = None
    """Median time per call of the same approach in eager mode."""
    compiled_ms: float | None = None
    """Median time per call of the compiled module."""
    ratio_vs_compiled_bare: float | None = None
    """Median per-round ratio against the compiled bare model (interleaved)."""
    ratio_p5: float | None = None
    """5th percentile of that ratio."""
    ratio_p95: float | None = None
    """95th percentile of that ratio."""
    ratio_vs_compiled_extractor: float | None = None
    """Compiled: median per-round ratio against the compiled extractor (the floor)."""


@dataclass(frozen=True)
class Results:
    """Everything one run produced."""

    environment: Environment
    """Where it ran."""
    measurements: tuple[Measurement, ...]
    """Overhead records."""
    compile: tuple[CompileRecord, ...]
    """``torch.compile`` records."""
    skipped: tuple[str, ...] = ()
    """Parts of the suite not run, with why (``compile skipped in --quick``)."""


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None  # JSON has no NaN/inf; None reads as "no number"
    if isinstance(value, tuple):
        return [_clean(v) for v in value]
    return value


def _as_dict(record: Any) -> dict[str, Any]:
    return {f.name: _clean(getattr(record, f.name)) for f in dataclasses.fields(record)}


def to_json(results: Results) -> dict[str, Any]:
    return {
        "schema": SCHEMA,
        "environment": _as_dict(results.environment),
        "measurements": [_as_dict(m) for m in results.measurements],
        "compile": [_as_dict(c) for c in results.compile],
        "skipped": list(results.skipped),
    }


def _build(cls: type[Any], data: dict[str, Any]) -> Any:
    names = {f.name: f for f in dataclasses.fields(cls)}
    unknown = set(data) - set(names)
    if unknown:
        raise ValueError(f"{cls.__name__} record has unknown fields {sorted(unknown)}; "
                         "was it written by a newer version of the benchmark suite?")
    kwargs = {k: tuple(v) if isinstance(v, list) else v for k, v in data.items()}
    return cls(**kwargs)


def from_json(data: dict[str, Any]) -> Results:
    if data.get("schema") != SCHEMA:
        raise ValueError(f"results schema {data.get('schema')!r} is not {SCHEMA}; "
                         "rerun the benchmark to regenerate them")
    return Results(
        environment=_build(Environment, data["environment"]),
        measurements=tuple(_build(Measurement, m) for m in data["measurements"]),
        compile=tuple(_build(CompileRecord, c) for c in data["compile"]),
        skipped=tuple(data.get("skipped", ())),
    )


def merge(runs: Sequence[Results]) -> Results:
    """Several runs on one device (e.g. one process per model) as one set of results.

    The environment is the first run's, except that fields on which the runs differ (commit,
    date, bandwidths) list every distinct value, joined by `` / ``.

    Raises:
        ValueError: no runs, or runs on different devices or dtypes.
    """
    if not runs:
        raise ValueError("merge needs at least one run")
    for key in ("device", "device_name", "dtype"):
        values = {getattr(r.environment, key) for r in runs}
        if len(values) > 1:
            raise ValueError(f"cannot merge runs with different {key}s: {sorted(values)}; "
                             "render each separately")
    first = runs[0].environment
    changes: dict[str, Any] = {}
    for f in dataclasses.fields(Environment):
        values = list(dict.fromkeys(getattr(r.environment, f.name) for r in runs))
        if len(values) > 1:
            if f.type in ("str", str):
                changes[f.name] = " / ".join(map(str, values))
            elif f.name == "quick":
                changes[f.name] = any(values)
    return Results(
        environment=dataclasses.replace(first, **changes),
        measurements=tuple(m for r in runs for m in r.measurements),
        compile=tuple(c for r in runs for c in r.compile),
        skipped=tuple(dict.fromkeys(s for r in runs for s in r.skipped)),
    )


def write_json(results: Results, path: Path) -> None:
    """Write atomically (a temporary file, then a rename): a reader never sees half a file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(to_json(results), indent=1) + "\n")
    tmp.replace(path)


def read_json(path: Path) -> Results:
    return from_json(json.loads(path.read_text()))
