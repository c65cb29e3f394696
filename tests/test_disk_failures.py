"""Disk when things go wrong: a full disk, a failing index write, a crash, interpreter exit, an
exception in the with block, inputs that cannot be written, bad options."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from disk_support import ROOT, check_same, inputs, run_both
from safetensors.torch import load_file
from torch import nn

import fxprobe
from fxprobe.sinks import index as _index
from fxprobe.sinks import shards as _shards


def test_another_models_captures_are_refused_and_kept(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    expected, _ = run_both(model, tmp_path, inputs(2, (3, 4)))
    before = sorted(os.listdir(tmp_path))
    other = nn.Sequential(nn.Linear(4, 5), nn.ReLU())
    tapped = fxprobe.tap(other, to=fxprobe.Disk(tmp_path, mode="append"))
    with pytest.raises(fxprobe.DiskError, match="another model.*site '0' differs"), \
            torch.no_grad():
        tapped(torch.randn(3, 4))  # refused at the first forward, before anything is queued
    with pytest.raises(fxprobe.DiskError, match="another model"), torch.no_grad():
        tapped(torch.randn(3, 4))  # and at every later one
    tapped.remove()
    assert sorted(os.listdir(tmp_path)) == before
    check_same(expected, fxprobe.open_captures(tmp_path))


def test_full_disk_keeps_what_was_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                           ) -> None:
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU())
    xs = inputs(40, (8, 64))
    real = _shards.Shard._append
    budget = [60_000]  # bytes of tensor data the "disk" takes

    def append(self: Any, key: str, code: str, shape: list[int], data: Any) -> None:
        n = len(data) if isinstance(data, bytes) else data.nbytes
        budget[0] -= n
        if budget[0] < 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(self, key, code, shape, data)

    monkeypatch.setattr(_shards.Shard, "_append", append)
    ref = fxprobe.tap(model, keep="all")
    tapped = fxprobe.tap(model, to=fxprobe.Disk(tmp_path, shard_size=10_000))
    handed = 0
    with pytest.raises(fxprobe.DiskError, match="No space left.*intact") as info:
        with torch.no_grad():
            for x in xs:
                ref(x)
                tapped(x)  # raises once the writer has failed, handing nothing over
                handed += 1
            tapped.remove()
    assert isinstance(info.value, OSError)
    caps = fxprobe.open_captures(tmp_path)
    assert 0 < len(caps) < len(xs)
    assert f"The {len(caps)} forwards" in str(info.value)
    assert f"the {handed - len(caps)} forward(s) after them were lost" in str(info.value)
    check_same([dict(f.items()) for f in ref.history][: len(caps)], caps)
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".partial")]


def test_a_failing_index_write_keeps_the_committed_forwards(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = _index.write_json
    calls = [0]

    def write_json(path: Path, data: Any, fsync: bool) -> None:
        calls[0] += 1
        if calls[0] == 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(path, data, fsync)

    monkeypatch.setattr(_index, "write_json", write_json)
    model = nn.Linear(8, 8)
    xs = inputs(5, (4, 8))
    ref = fxprobe.tap(model, keep="all")
    # a shard a forward; queue=4: forwards 3 and 4 wait in the queue when the index fails
    tapped = fxprobe.tap(model, to=fxprobe.Disk(tmp_path, shard_size=1, queue=4))
    with pytest.raises(fxprobe.DiskError, match=r"The 2 forwards .* intact.* 3 forward\(s\)"):
        with torch.no_grad():
            for x in xs:
                ref(x)
                tapped(x)
            tapped.remove()
    caps = fxprobe.open_captures(tmp_path)
    check_same([dict(f.items()) for f in ref.history][:2], caps)
    assert sorted(f for f in os.listdir(tmp_path) if f.startswith("shard")) == [
        "shard-000000.safetensors", "shard-000001.safetensors"]


def test_a_crash_loses_at_most_the_unfinished_shard(tmp_path: Path) -> None:
    script = textwrap.dedent(f"""
        import os, sys, torch
        sys.path.insert(0, {str(ROOT)!r})
        import fxprobe
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU())
        tapped = fxprobe.tap(model, to=fxprobe.Disk({str(tmp_path)!r}, shard_size=3000))
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for i in range(7):
                tapped(torch.randn(4, 16, generator=g))
            tapped._sink.flush()
            for i in range(2):
                tapped(torch.randn(4, 16, generator=g))
        os._exit(3)  # no close, no atexit: the shard being written is left unfinished
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert proc.returncode == 3, proc.stderr
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU())
    ref = fxprobe.tap(model, keep="all")
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _ in range(9):
            ref(torch.randn(4, 16, generator=g))
    expected = [dict(f.items()) for f in ref.history]
    caps = fxprobe.open_captures(tmp_path)
    assert 7 <= len(caps) <= 9  # everything flushed survived; the rest is whole or absent
    check_same(expected[: len(caps)], caps)
    with torch.no_grad(), fxprobe.tap(model, to=fxprobe.Disk(tmp_path, mode="append")) as t:
        t(torch.randn(4, 16, generator=g))
    assert len(fxprobe.open_captures(tmp_path)) == len(caps) + 1
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".partial")]


def test_interpreter_exit_flushes_and_commits(tmp_path: Path) -> None:
    script = textwrap.dedent(f"""
        import sys, torch
        sys.path.insert(0, {str(ROOT)!r})
        import fxprobe
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 4)
        tapped = fxprobe.tap(model, to=fxprobe.Disk({str(tmp_path)!r}))
        with torch.no_grad():
            for i in range(5):
                tapped(torch.full((2, 4), float(i)))
        # no remove(), no close(): leaving the interpreter must commit the 5 forwards
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    caps = fxprobe.open_captures(tmp_path)
    assert len(caps) == 5
    with torch.no_grad():
        for i in range(5):
            assert torch.equal(caps.forward(i)["linear"], model(torch.full((2, 4), float(i))))


def test_bad_directories_and_options(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(fxprobe.DiskError, match="cannot write captures to"):
        fxprobe.Disk(blocker / "acts")
    disk = fxprobe.Disk(tmp_path / "a")
    with pytest.raises(fxprobe.DiskError, match="being written by another"):
        fxprobe.Disk(tmp_path / "a", mode="append")
    with pytest.raises(fxprobe.ConfigError, match="keep='all'"):
        fxprobe.tap(nn.Linear(2, 2), to=disk, keep="all")
    disk.close()
    with pytest.raises(fxprobe.ConfigError, match="closed"):
        fxprobe.tap(nn.Linear(2, 2), to=disk)
    with fxprobe.Disk(tmp_path / "c") as odd:
        odd_values = [(torch.eye(2).to_sparse(), "sparse"),
                      (torch.ones(2, dtype=torch.cfloat), "complex"), (object(), "object")]
        for value, what in odd_values:
            with pytest.raises(fxprobe.ConfigError, match=what):
                odd.write({"site": value})
        odd.write({"site": torch.ones(2)})  # a refused value leaves no gap in the numbering
    caps = fxprobe.open_captures(tmp_path / "c")
    assert len(caps) == 1 and torch.equal(caps.forward(0)["site"], torch.ones(2))
    for bad in ({"mode": "w"}, {"queue": -1}, {"shard_size": "lots"}, {"rank": -1}):
        with pytest.raises(fxprobe.ConfigError):
            fxprobe.Disk(tmp_path / "b", **bad)
    with pytest.raises(fxprobe.DiskError, match="holds no captures"):
        fxprobe.open_captures(tmp_path / "b")


def test_exception_in_the_with_block_still_commits(tmp_path: Path) -> None:
    model = nn.Linear(3, 3)
    xs = inputs(3, (2, 3))
    with pytest.raises(ZeroDivisionError), torch.no_grad():
        with fxprobe.tap(model, to=fxprobe.Disk(tmp_path)) as tapped:
            for x in xs:
                tapped(x)
            1 / 0  # noqa: B018
    caps = fxprobe.open_captures(tmp_path)
    assert len(caps) == 3
    with torch.no_grad():
        assert torch.equal(caps.forward(2)[caps.names[-1]], model(xs[2]))


class SmallDisk:
    """A file on a disk with ``budget`` free bytes, allocated in 4 KiB blocks as written (a
    seek over a range leaves a hole that takes no space until it is written)."""

    def __init__(self, real: Any, budget: list[int]) -> None:
        self.real = real
        self.budget = budget
        self.blocks: set[int] = set()

    def write(self, data: Any) -> int:
        n = len(data) if isinstance(data, bytes) else data.nbytes
        pos = self.real.tell()
        new = set(range(pos // 4096, (pos + n + 4095) // 4096)) - self.blocks if n else set()
        if len(new) * 4096 > self.budget[0]:
            raise OSError(errno.ENOSPC, "No space left on device")
        self.budget[0] -= len(new) * 4096
        self.blocks |= new
        return int(self.real.write(data))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


def test_a_full_disk_keeps_the_complete_forwards_of_the_shard_being_written(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    budget = [400_000]  # free bytes: room for some forwards of the one shard, not all

    def small_open(path: Any, mode: str = "r", *args: Any, **kw: Any) -> Any:
        f = open(path, mode, *args, **kw)  # noqa: SIM115
        return SmallDisk(f, budget) if "w" in mode else f

    monkeypatch.setattr(_shards, "open", small_open, raising=False)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU())
    xs = inputs(100, (16, 64))
    ref = fxprobe.tap(model, keep="all")
    with pytest.raises(fxprobe.DiskError, match="No space left"):
        with torch.no_grad(), fxprobe.tap(model, to=fxprobe.Disk(tmp_path, shard_size="2MB",
                                                                  queue=1)) as tapped:
            for x in xs:
                ref(x)
                tapped(x)
    caps = fxprobe.open_captures(tmp_path)  # the shard's complete forwards were committed
    assert len(caps) >= 10, len(caps)
    check_same([dict(f.items()) for f in ref.history][: len(caps)], caps)
    shard = tmp_path / "shard-000000.safetensors"
    assert len(load_file(shard)) > len(caps)  # safetensors' own reader opens it


def test_inputs_that_cannot_be_written_name_the_capture_option(tmp_path: Path) -> None:
    class Slicer(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x[:, 1:3]

    for capture in ("input", "both"):
        with pytest.raises(fxprobe.ConfigError, match=r"'getitem' has a slice.*among its "
                                                      r"inputs.*capture='output'"):
            with fxprobe.tap(Slicer(), ops="getitem", capture=capture,
                             to=fxprobe.Disk(tmp_path / capture)) as tapped:
                tapped(torch.ones(2, 4))

