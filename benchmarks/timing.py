"""The timing method: warm-up, then interleaved rounds of baseline and treatments, in one process.

A round runs every treatment once, in a shuffled order, each between two slots of the baseline
(``B T1 B T2 B ...``); a treatment's ratio for that round is its time over the mean of the two
baseline slots beside it. Drift in clock speed or background load then moves both sides of a
ratio together. Medians and percentiles are taken over rounds. CPU slots are timed with
``perf_counter_ns``; CUDA slots with events recorded on the stream and a synchronisation after
the slot, so device time (including any idle gaps while the host is behind) is what is measured.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import random
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.utils._pytree import tree_flatten


@dataclass
class Treatment:
    """One thing to time against the baseline."""

    key: str
    run: Callable[[], Any]
    """One call (a forward, or a training step)."""
    enter: Callable[[], None] | None = None
    """Installs what must be live only during this treatment's slots (hooks); untimed."""
    exit: Callable[[], None] | None = None
    """Undoes ``enter``; untimed."""


@dataclass
class Samples:
    """Per-round times of one treatment and of the baseline slots beside it (ms per call)."""

    treatment: list[float] = field(default_factory=list)
    baseline: list[float] = field(default_factory=list)
    host: list[float] = field(default_factory=list)

    def ratios(self) -> np.ndarray:
        return np.asarray(self.treatment) / np.asarray(self.baseline)

    def diffs_us(self) -> np.ndarray:
        return (np.asarray(self.treatment) - np.asarray(self.baseline)) * 1e3


@dataclass(frozen=True)
class Summary:
    """Order statistics of a treatment's samples."""

    rounds: int
    baseline_ms: float
    treatment_ms: float
    ratio: float
    ratio_p5: float
    ratio_q25: float
    ratio_q75: float
    ratio_p95: float
    overhead_us: float
    overhead_us_q25: float
    overhead_us_q75: float
    overhead_us_ci: tuple[float, float]
    host_ms: float | None


def median_ci(x: np.ndarray) -> tuple[float, float]:
    """A distribution-free 95% confidence interval of the median (order statistics)."""
    v = np.sort(x)
    n = len(v)
    half = 0.98 * np.sqrt(n)  # 1.96 * sqrt(n) / 2
    lo = max(0, int(np.floor(n / 2 - half)))
    hi = min(n - 1, int(np.ceil(n / 2 + half)) - 1)
    return float(v[lo]), float(v[hi])


def summarize(s: Samples, cuda: bool) -> Summary:
    r = s.ratios()
    d = s.diffs_us()
    p5, q25, q50, q75, p95 = np.percentile(r, [5, 25, 50, 75, 95])
    d25, d50, d75 = np.percentile(d, [25, 50, 75])
    return Summary(
        rounds=len(r),
        baseline_ms=float(np.median(s.baseline)),
        treatment_ms=float(np.median(s.treatment)),
        ratio=float(q50), ratio_p5=float(p5), ratio_q25=float(q25), ratio_q75=float(q75),
        ratio_p95=float(p95),
        overhead_us=float(d50), overhead_us_q25=float(d25), overhead_us_q75=float(d75),
        overhead_us_ci=median_ci(d), host_ms=float(np.median(s.host)) if cuda else None,
    )


def _slot(fn: Callable[[], Any], iters: int, cuda: bool) -> tuple[float, float]:
    """(ms per call, host ms per call) of ``iters`` back-to-back calls.

    A slot of several calls starts with one untimed call: the first call after a different
    treatment pays for cold caches and branch predictors, which would otherwise be charged to
    whichever slot follows which (an A/A control showed a bias of about 2% without it).
    """
    if iters >= 4:
        fn()
    if cuda:
        torch.cuda.synchronize()
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        h0 = time.perf_counter_ns()
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        h1 = time.perf_counter_ns()
        end.synchronize()
        return start.elapsed_time(end) / iters, (h1 - h0) / 1e6 / iters
    t0 = time.perf_counter_ns()
    for _ in range(iters):
        fn()
    ms = (time.perf_counter_ns() - t0) / 1e6 / iters
    return ms, ms


@contextlib.contextmanager
def entered(t: Treatment) -> Iterator[None]:
    if t.enter is not None:
        t.enter()
    try:
        yield
    finally:
        if t.exit is not None:
            t.exit()


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """The collector off while timing (as ``timeit`` does), after a young-generation sweep."""
    was = gc.isenabled()
    gc.collect(1)
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def calibrate(fn: Callable[[], Any], *, min_slot_s: float, warmup_s: float, cuda: bool
              ) -> tuple[int, float]:
    """Warm ``fn`` up; (calls that make a slot last ``min_slot_s``, fastest ms per call)."""
    fn()
    t0 = time.perf_counter()
    times: list[float] = []
    while len(times) < 3 or time.perf_counter() - t0 < warmup_s:
        times.append(_slot(fn, 1, cuda)[0])
    # The fastest call: a call slowed by a neighbour on a shared machine says nothing of fn.
    best = max(min(times), 1e-6)
    return max(1, int(np.ceil(min_slot_s * 1e3 / best))), best


def warm(treatments: list[Treatment], iters: int, cuda: bool) -> dict[str, float]:
    """Run each treatment for one slot (first-call costs, allocator growth); ms per slot."""
    out = {}
    for t in treatments:
        with entered(t):
            t.run()
            out[t.key] = _slot(t.run, iters, cuda)[0] * iters
    return out


def interleave(baseline: Callable[[], Any], treatments: list[Treatment], *, iters: int,
               rounds: int, cuda: bool, seed: int,
               on_round: Callable[[int], None] | None = None) -> dict[str, Samples]:
    """Time every treatment against ``baseline`` over ``rounds`` interleaved rounds."""
    rng = random.Random(seed)
    samples = {t.key: Samples() for t in treatments}
    for r in range(rounds):
        order = list(treatments)
        rng.shuffle(order)
        with gc_paused():
            before, _ = _slot(baseline, iters, cuda)
            for t in order:
                with entered(t):
                    ms, host = _slot(t.run, iters, cuda)
                after, _ = _slot(baseline, iters, cuda)
                s = samples[t.key]
                s.treatment.append(ms)
                s.baseline.append((before + after) / 2)
                s.host.append(host)
                before = after
        if on_round is not None:
            on_round(r)
    return samples


# -- transfer probes --------------------------------------------------------------

def count_syncs(t: Treatment) -> int:
    """Host synchronisations in one call of ``t`` (CUDA), via the sync debug mode's warnings."""
    with entered(t):
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                t.run()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        return sum(1 for w in caught if "synchroniz" in str(w.message))


def tensors(value: Any) -> list[torch.Tensor]:
    leaves, _ = tree_flatten(value)
    out: list[torch.Tensor] = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            out.append(leaf)
        elif dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
            # e.g. a statistics record: its tensor fields are what the capture holds
            out.extend(tensors([getattr(leaf, f.name) for f in dataclasses.fields(leaf)]))
    return out


def storage_bytes(value: Any, device_type: str | None = None) -> int:
    """Bytes of the distinct storages of the tensors in ``value`` (optionally on one device)."""
    seen: dict[tuple[str, int], int] = {}
    for t in tensors(value):
        if device_type is not None and t.device.type != device_type:
            continue
        st = t.untyped_storage()
        seen[(t.device.type, st.data_ptr())] = st.nbytes()
    return sum(seen.values())


def value_bytes(value: Any) -> int:
    """Bytes of the tensors in ``value`` as values (views counted at their own size)."""
    return sum(t.numel() * t.element_size() for t in tensors(value))
