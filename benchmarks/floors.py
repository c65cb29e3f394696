"""The physical lower bound of each mode's overhead, from bandwidths measured on this device.

- reference, intervention (identity callback): zero device time; only host work remains.
- clone: every tapped byte read once and written once, at the measured copy bandwidth.
- stats: every tapped byte read once, at the measured read bandwidth.
- offload: every tapped byte over the device-to-host link (CUDA); zero on a CPU, where the
  values are already in host memory.

The bandwidths are those of large streaming ops (256 MiB on a CPU, 1 GiB on a GPU, less if
memory is short: larger than any cache), each timed as several back-to-back calls between two
synchronisations, medians over samples; the read bandwidth is the fastest of ``sum`` and
``amax``. (An earlier probe timed one 64 MiB ``sum`` per synchronisation: on an H200 that
measured the launch and the synchronisation as much as the read, 1.74 TB/s against the 4.18
TB/s a large ``sum`` reaches, so its floors were 2.4x too lenient.) For small tensors that live
in cache the floor is pessimistic in time per byte, and it leaves out the fixed cost of
launching one more op per site: a launch-bound model's measured cost sits far above its byte
floor.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

_CPU_BYTES = 256 << 20
_CUDA_BYTES = 1 << 30


@dataclass(frozen=True)
class Bandwidths:
    """Measured bandwidths of a device, GB/s (1e9 bytes per second)."""

    copy_gbps: float
    read_gbps: float
    link_gbps: float | None
    read_basis: str = ""


def _median_s(fn: Callable[[], Any], cuda: bool, reps: int = 7, calls: int = 1) -> float:
    """Median over ``reps`` samples of the time of one call, ``calls`` calls per sample."""
    times = []
    for _ in range(reps + 1):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        if cuda:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) / calls)
    return float(np.median(times[1:]))  # the first one faults the pages in


def _probe_bytes(device: torch.device) -> int:
    if device.type != "cuda":
        return _CPU_BYTES
    free, _ = torch.cuda.mem_get_info(device)
    return int(min(_CUDA_BYTES, free // 4) // 4 * 4)


def measure(device: torch.device) -> Bandwidths:
    """Copy, read and (CUDA) device-to-host bandwidth of ``device``."""
    cuda = device.type == "cuda"
    nbytes = _probe_bytes(device)
    calls = 10 if cuda else 2
    src = torch.randn(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    copy_s = _median_s(lambda: dst.copy_(src), cuda, calls=calls)
    reads = {name: _median_s(fn, cuda, calls=calls)
             for name, fn in (("sum", src.sum), ("amax", src.amax))}
    best = min(reads, key=lambda k: reads[k])
    basis = (f"fastest of {', '.join(f'{k} {nbytes / v / 1e9:.1f}' for k, v in reads.items())}"
             f" GB/s over {nbytes >> 20} MiB float32, {calls} calls per sample, median of 7")
    link = None
    if cuda:
        del dst
        host = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
        link_s = _median_s(lambda: host.copy_(src, non_blocking=True), cuda, reps=5)
        link = nbytes / link_s / 1e9
    return Bandwidths(2 * nbytes / copy_s / 1e9, nbytes / reads[best] / 1e9, link, basis)


def floor_us(mode: str, tapped_bytes: int, bw: Bandwidths, device: torch.device
             ) -> tuple[float | None, str]:
    """(floor in microseconds, how it was computed) for ``tapped_bytes`` captured per call."""
    mib = tapped_bytes / 2**20
    if mode in ("reference", "intervention"):
        return 0.0, "zero device time (values are referenced, the callback is the identity)"
    if mode == "clone":
        return (2 * tapped_bytes / (bw.copy_gbps * 1e9) * 1e6,
                f"{mib:.2f} MiB read + written at {bw.copy_gbps:.1f} GB/s")
    if mode == "stats":
        return (tapped_bytes / (bw.read_gbps * 1e9) * 1e6,
                f"{mib:.2f} MiB read once at {bw.read_gbps:.1f} GB/s")
    if mode == "offload":
        if device.type != "cuda" or bw.link_gbps is None:
            return 0.0, "zero: the values are already in host memory"
        return (tapped_bytes / (bw.link_gbps * 1e9) * 1e6,
                f"{mib:.2f} MiB over the host link at {bw.link_gbps:.1f} GB/s")
    return None, ""
