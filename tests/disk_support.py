"""What test_disk_failures, test_disk share."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from reference import same
from torch import nn

import fxprobe

ROOT = Path(__file__).resolve().parent.parent


def run_both(model: nn.Module, path: Path, inputs: list[torch.Tensor], **kw: Any
             ) -> tuple[list[Any], fxprobe.Captures]:
    """The same forwards through keep="all" (the reference) and to=Disk; the reader's view."""
    disk_kw = kw.pop("disk", {})
    ref = fxprobe.tap(model, keep="all", **kw)
    with torch.no_grad(), fxprobe.tap(model, to=fxprobe.Disk(path, **disk_kw), **kw) as tapped:
        for x in inputs:
            ref(x)
            tapped(x)
    return ([dict(f.items()) for f in ref.history],
            fxprobe.open_captures(path, rank=disk_kw.get("rank")))


def check_same(expected: list[dict[str, Any]], caps: fxprobe.Captures) -> None:
    assert len(caps) == len(expected)
    for i, frame in enumerate(expected):
        got = caps.forward(i)
        assert list(got) == list(frame)
        for name, value in frame.items():
            assert same(got[name], value), (i, name)


def inputs(n: int, shape: tuple[int, ...], seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) for _ in range(n)]

