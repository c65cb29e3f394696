"""The physical lower bound of each mode's overhead, from bandwidths measured on this device.

- reference, intervention (identity callback): zero device time; only host work remains.
- clone: every tapped byte read once and written once, at the measured copy bandwidth.
- stats: every tapped byte read once, at the measured read bandwidth.
- offload: every tapped byte over the device-to-host link (CUDA); zero on a CPU, where the
  values are already in host memory.

The bandwidths are those of large (64 MiB) streaming copies, so for small tensors that live in
cache the floor is pessimistic in time per byte, and it leaves out the fixed cost of launching
one more op per site: a launch-bound model's measured cost sits far above its byte floor.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

_BYTES = 64 << 20


@dataclass(frozen=True)
class Bandwidths:
    """Measured bandwidths of a device, GB/s (1e9 bytes per second)."""

    copy_gbps: float
    read_gbps: float
    link_gbps: float | None


def _median_s(fn: object, cuda: bool, reps: int = 7) -> float:
    times = []
    for _ in range(reps + 1):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()  # type: ignore[operator]
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return float(np.median(times[1:]))  # the first one faults the pages in


def measure(device: torch.device) -> Bandwidths:
    """Copy, read and (CUDA) device-to-host bandwidth of ``device``."""
    cuda = device.type == "cuda"
    src = torch.randn(_BYTES // 4, device=device)
    dst = torch.empty_like(src)
    copy_s = _median_s(lambda: dst.copy_(src), cuda)
    read_s = _median_s(lambda: src.sum(), cuda)
    link = None
    if cuda:
        host = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
        link_s = _median_s(lambda: host.copy_(src, non_blocking=True), cuda)
        link = _BYTES / link_s / 1e9
    return Bandwidths(2 * _BYTES / copy_s / 1e9, _BYTES / read_s / 1e9, link)


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
