"""``python -m benchmarks.stats_micro``: ``stats_vector``'s cost against one read of the tensor.

For float32 tensors from 4 KiB to 64 MiB, times in interleaved rounds (medians over rounds):

- ``floor sum`` / ``floor amax``: one read of the tensor (the floor is the faster of the two);
- ``stats_vector``: fxprobe's (the Triton kernel on CUDA when Triton imports);
- ``torch fallback``: the torch-ops path that runs without Triton (CUDA only);
- ``device path``: on a CPU, the same torch-ops path (no branch on values); ``stats_vector``
  itself reads values on the host there: one pass of the numba kernel where numba is installed
  (:mod:`fxprobe.capture.stats.numba`), else four passes;
- ``torch host-read``: on a CPU, ``stats_vector`` with the numba kernel switched off (the four
  passes), beside it in the same rounds;
- ``before``: the implementation of project commit 97755d0, kept here as the baseline;
- ``item hook``: ``(t.mean().item(), t.std().item())``, what the tutorial logging hook does.

Then a batch of many small tensors (the ``chain`` model's 200 outputs of 16 values), where the
cost is per call, not per byte: ``stats_vectors`` against ``stats_vector`` on each, and the
hook. Writes ``stats_micro.json`` and ``stats_micro.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from fxprobe.capture.stats import cpu as _stats_cpu
from fxprobe.capture.stats import math as _stats
from fxprobe.capture.stats import numba as _stats_numba
from fxprobe.capture.stats.math import stats_vector, stats_vectors

SIZES_KIB = (4, 64, 1024, 16 * 1024, 64 * 1024)


def before_stats_vector(t: torch.Tensor) -> torch.Tensor:
    """``stats_vector`` as it was at commit 97755d0 (about 15 ops, several full temporaries)."""
    dtype = torch.float64 if t.dtype == torch.float64 else torch.float32
    numel = t.numel()
    x = t.detach().reshape(-1).to(dtype)
    finite = torch.isfinite(x)
    n = finite.sum(dtype=dtype)
    mean = torch.where(finite, x, 0).sum() / n
    filled = torch.where(finite, x, mean)
    lo, hi = torch.aminmax(filled)
    dev = filled - mean
    std = torch.sqrt(torch.dot(dev, dev) / (n - 1))
    absmax = torch.maximum(lo.abs(), hi.abs())
    zero_frac = (x == 0).sum(dtype=dtype) / numel
    nan_count = torch.isnan(x).sum(dtype=dtype)
    inf_count = numel - n - nan_count
    return torch.stack([mean, std, lo, hi, absmax, zero_frac, nan_count, inf_count])


def _fallback(t: torch.Tensor) -> torch.Tensor:
    return _stats._stats_of(t, None)


def _device_path(t: torch.Tensor) -> torch.Tensor:
    """On a CPU: ``stats_vector`` without reading values on the host, the tensor-op path an
    accelerator without Triton takes (and what a CPU took before that branch existed)."""
    _stats_cpu.CPU_HOST_READS = False
    try:
        return stats_vector(t)
    finally:
        _stats_cpu.CPU_HOST_READS = True


def _torch_host_read(t: torch.Tensor) -> torch.Tensor:
    """On a CPU: ``stats_vector`` with the numba kernel switched off (four passes)."""
    enabled = _stats_numba.ENABLED
    _stats_numba.ENABLED = False
    try:
        return stats_vector(t)
    finally:
        _stats_numba.ENABLED = enabled


def _first_numba_call_s() -> float | None:
    """Seconds of the first call that takes the numba kernel (import, compile or cache
    load), or None when numba is not used here."""
    if not _stats_numba.available():
        return None
    t0 = time.perf_counter()
    stats_vector(torch.ones(1 << 16))
    return time.perf_counter() - t0 if _stats_numba.available() else None


def _item_hook(t: torch.Tensor) -> tuple[float, float]:
    return t.mean().item(), t.std().item()


def _time(fns: dict[str, Callable[[], Any]], rounds: int, cuda: bool,
          min_slot_s: float) -> dict[str, float]:
    """Median seconds per call of each function, timed in interleaved rounds."""
    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    iters = {}
    for name, fn in fns.items():  # warm up, then pick iterations per slot
        fn()
        sync()
        n = 1
        while True:
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            sync()
            if time.perf_counter() - t0 >= min_slot_s or n >= 1 << 14:
                break
            n *= 2
        iters[name] = n
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for r in range(rounds):
        order = list(fns) if r % 2 == 0 else list(reversed(fns))
        for name in order:
            fn, n = fns[name], iters[name]
            sync()
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            sync()
            samples[name].append((time.perf_counter() - t0) / n)
    return {k: statistics.median(v) for k, v in samples.items()}


def run(device: torch.device, rounds: int, sizes_kib: tuple[int, ...]) -> dict[str, Any]:
    cuda = device.type == "cuda"
    from fxprobe.capture.stats import triton as _stats_triton

    triton = cuda and _stats_triton.available()
    numba_first_s = None if cuda else _first_numba_call_s()
    gen = torch.Generator().manual_seed(0)
    rows = []
    for kib in sizes_kib:
        t = (torch.randn(kib * 256, generator=gen) * 2 + 0.5).to(device)
        fns: dict[str, Callable[[], Any]] = {
            "floor sum": lambda t=t: t.sum(),
            "floor amax": lambda t=t: t.amax(),
            "stats_vector": lambda t=t: stats_vector(t),
            "before": lambda t=t: before_stats_vector(t),
            "item hook": lambda t=t: _item_hook(t),
        }
        if cuda:
            fns["torch fallback"] = lambda t=t: _fallback(t)
        else:
            fns["device path"] = lambda t=t: _device_path(t)
            if numba_first_s is not None:
                fns["torch host-read"] = lambda t=t: _torch_host_read(t)
        med = _time(fns, rounds, cuda, 0.002 if kib < 1024 else 0.02)
        floor = min(med["floor sum"], med["floor amax"])
        rows.append({"kib": kib, "us": {k: v * 1e6 for k, v in med.items()},
                     "floor_us": floor * 1e6,
                     "x_floor": {k: v / floor for k, v in med.items()}})
        del t
    small = [torch.randn(1, 16, generator=gen).to(device) for _ in range(200)]
    batch = _time({
        "stats_vectors (one call)": lambda: stats_vectors(small),
        "stats_vector each": lambda: [stats_vector(s) for s in small],
        "before each": lambda: [before_stats_vector(s) for s in small],
        "item hook each": lambda: [_item_hook(s) for s in small],
    }, rounds, cuda, 0.02)
    return {
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if cuda else platform.processor()
        or platform.machine(),
        "torch_version": torch.__version__, "threads": torch.get_num_threads(),
        "triton": triton and _stats_triton.available(),
        "triton_error": "; ".join(_stats_triton._broken), "numba": numba_first_s is not None,
        "numba_first_call_s": numba_first_s, "numba_error": "; ".join(_stats_numba._broken),
        "rounds": rounds, "sizes": rows,
        "batch_200x16_us": {k: v * 1e6 for k, v in batch.items()},
    }


def markdown(res: dict[str, Any]) -> str:
    """The result as Markdown tables."""
    kinds = [k for k in ("stats_vector", "torch host-read", "torch fallback", "device path",
                         "before", "item hook")
             if k in res["sizes"][0]["us"]]
    lines = [f"stats_vector on {res['device']} ({res['device_name']}, torch "
             f"{res['torch_version']}, {res['threads']} threads, Triton kernel used: "
             f"{res['triton']}{' ' + res['triton_error'][:200] if res['triton_error'] else ''}"
             f"{_numba_note(res)}); "
             f"medians of {res['rounds']} interleaved rounds, float32. "
             "Floor: the faster of one `sum` and one `amax` of the tensor.", "",
             "| size | floor us | " + " | ".join(f"{k} us (x floor)" for k in kinds) + " |",
             "|---|---|" + "---|" * len(kinds)]
    for r in res["sizes"]:
        cells = [f"{r['us'][k]:.1f} ({r['x_floor'][k]:.1f})" for k in kinds]
        lines.append(f"| {_size(r['kib'])} | {r['floor_us']:.1f} | " + " | ".join(cells) + " |")
    lines += ["", "200 tensors of 16 values (the chain model's outputs), per batch:", "",
              "| how | us |", "|---|---|"]
    lines += [f"| {k} | {v:.1f} |" for k, v in res["batch_200x16_us"].items()]
    return "\n".join(lines) + "\n"


def _numba_note(res: dict[str, Any]) -> str:
    if res["device"] != "cpu":
        return ""
    if not res.get("numba"):
        return f", numba kernel used: False {res.get('numba_error', '')[:200]}".rstrip()
    return f", numba kernel used: True (first call {res['numba_first_call_s']:.2f} s)"


def _size(kib: int) -> str:
    return f"{kib // 1024} MiB" if kib >= 1024 else f"{kib} KiB"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.stats_micro", description=__doc__)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--sizes", default=",".join(map(str, SIZES_KIB)),
                   help="tensor sizes in KiB (default: %(default)s)")
    p.add_argument("--out", type=Path, default=None, help="directory for JSON and Markdown")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (default: torch's; 1 is steadier on a shared machine)")
    args = p.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda but no GPU is available", file=sys.stderr)
        return 2
    res = run(torch.device(args.device), args.rounds,
              tuple(int(s) for s in args.sizes.split(",")))
    md = markdown(res)
    print(md)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "stats_micro.json").write_text(json.dumps(res, indent=1) + "\n")
        (args.out / "stats_micro.md").write_text(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
