"""A writer killed with SIGKILL mid-run loses only forwards not yet written (the journal makes
each forward readable once written); ``mode="append"`` commits them and continues without a
duplicate or a gap; a reader opened during a run sees new forwards after ``refresh()``;
``on_error="skip"`` reads past a corrupted shard and says what it left out. Values are checked
against forward hooks on an untapped copy saved with ``torch.save``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

import fxprobe

ROOT = Path(__file__).resolve().parent.parent

CHILD = textwrap.dedent("""
    import os, sys, torch
    from torch import nn
    import fxprobe
    path, start, stop, handed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
    mode = "append" if start else "new"
    disk = fxprobe.Disk(path, mode=mode, shard_size="256MiB", queue=2)
    with torch.no_grad(), fxprobe.tap(model, ops="1", to=disk) as tapped:
        for i in range(start, stop):
            g = torch.Generator().manual_seed(i)
            tapped(torch.randn(3, 4, 8, generator=g))
            with open(handed + ".tmp", "w") as f:
                f.write(str(i + 1))
            os.replace(handed + ".tmp", handed)
""")


def reference(n: int, tmp: Path) -> list[torch.Tensor]:
    """Forward ``i``'s ReLU output by a forward hook on an untapped copy, through torch.save."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
    seen: list[torch.Tensor] = []
    h = model[1].register_forward_hook(lambda m, i, o: seen.append(o.detach().clone()))
    with torch.no_grad():
        for i in range(n):
            model(torch.randn(3, 4, 8, generator=torch.Generator().manual_seed(i)))
    h.remove()
    torch.save(seen, tmp / "ref.pt")
    return torch.load(tmp / "ref.pt")  # type: ignore[no-any-return]


def child(path: Path, start: int, stop: int, handed: Path) -> subprocess.Popen[bytes]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.Popen([sys.executable, "-c", CHILD, str(path), str(start), str(stop),
                             str(handed)], env=env, stderr=subprocess.PIPE)


def journal_lines(path: Path) -> int:
    lines = 0
    for j in path.glob("*.journal"):
        lines += j.read_bytes().count(b"\n") - 1
    return lines


def test_a_sigkilled_writer_loses_only_forwards_not_yet_written(tmp_path: Path) -> None:
    path, handed = tmp_path / "acts", tmp_path / "handed"
    proc = child(path, 0, 10**6, handed)
    try:
        # No deadline: wait until the journal lists 5 forwards (all in one unfinished shard
        # of 256 MiB, which a kill lost whole before the journal), or the child ends.
        while proc.poll() is None and not (path.exists() and journal_lines(path) >= 5):
            os.sched_yield()
        assert proc.poll() is None, "the harvest ended before it was killed"
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    assert not (path / "index.json").exists()  # nothing was committed the old way
    caps = fxprobe.open_captures(path)
    n = len(caps)
    told = int(handed.read_text())  # forwards handed over, at least
    # Lost at most: the forward being written and those queued (queue=2).
    assert n >= 5 and n >= told - 3, (n, told)
    ref = reference(n + 4, tmp_path)
    for i in range(n):
        assert torch.equal(caps.forward(i)["1"], ref[i]), i
    assert torch.equal(caps.rows("1", list(range(n * 12))), torch.cat(ref[:n]).flatten(0, 1))
    # mode="append" commits them and goes on from forward n: no duplicate, no gap.
    resumed = child(path, n, n + 4, handed)
    _, err = resumed.communicate()
    assert resumed.returncode == 0, err.decode()[-2000:]
    assert not list(path.glob("*.partial")) and not list(path.glob("*.journal"))
    index = json.loads((path / "index.json").read_text())
    assert index["forwards"] == n + 4 and index["sites"] == ["1"]
    caps = fxprobe.open_captures(path)
    assert len(caps) == n + 4
    for i in range(n + 4):
        assert torch.equal(caps.forward(i)["1"], ref[i]), i


def test_a_reader_opened_during_a_run_sees_new_forwards_after_refresh(tmp_path: Path) -> None:
    model = nn.Linear(4, 4)
    ref = fxprobe.tap(model, keep="all")
    disk = fxprobe.Disk(tmp_path, shard_size=600, fsync=False)
    xs = [torch.randn(2, 4) for _ in range(9)]
    with torch.no_grad(), fxprobe.tap(model, to=disk) as tapped:
        for x in xs[:2]:
            tapped(x)
            ref(x)
        disk.flush()
        caps = fxprobe.open_captures(tmp_path)
        assert len(caps) == 2
        early = caps.forward(1)["linear"]
        ds = caps.dataset("linear", rows="samples")
        for x in xs[2:6]:
            tapped(x)
            ref(x)
            disk.flush()  # each forward written (a shard of 600 bytes holds a few)
            n = caps.refresh()
            assert n == len(caps) == len(ref.history)
            for i in range(n):
                assert torch.equal(caps.forward(i)["linear"], ref.history[i]["linear"])
        for x in xs[6:]:
            tapped(x)
            ref(x)
        disk.flush()
    assert caps.refresh() == 9
    assert torch.equal(early, ref.history[1]["linear"])  # earlier views are unchanged
    # A dataset made before keeps its rows (forwards only append in one directory).
    assert len(ds) == 4 and torch.equal(ds[[3, 0]], torch.cat(
        [ref.history[1]["linear"][1:], ref.history[0]["linear"][:1]]))
    assert torch.equal(caps.rows("linear", list(range(18)), lead=1),
                       torch.cat([f["linear"] for f in ref.history]))


def test_a_reader_sees_forwards_of_the_shard_being_written(tmp_path: Path) -> None:
    disk = fxprobe.Disk(tmp_path, fsync=False)  # one shard of 256 MiB: never full here
    values = [{"a": torch.full((2, 3), float(i))} for i in range(3)]
    disk.write(values[0])
    disk.write(values[1])
    disk.flush()
    caps = fxprobe.open_captures(tmp_path)  # no index yet: the journal lists the forwards
    assert len(caps) == 2
    disk.write(values[2])
    disk.close()
    assert caps.refresh() == 3
    for i in range(3):
        assert torch.equal(caps.forward(i)["a"], values[i]["a"])


def corrupt_second(tmp_path: Path) -> list[torch.Tensor]:
    with fxprobe.Disk(tmp_path, shard_size=1, fsync=False) as d:  # a shard per forward
        for i in range(4):
            d.write({"a": torch.full((2, 3), float(i))})
    shard = tmp_path / "shard-000001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0x01
    shard.write_bytes(bytes(data))
    return [torch.full((2, 3), float(i)) for i in range(4)]


def test_on_error_skip_reads_past_a_corrupted_shard_and_reports_it(tmp_path: Path) -> None:
    vals = corrupt_second(tmp_path)
    with pytest.raises(fxprobe.DiskError, match="shard-000001.*corrupted"):
        fxprobe.open_captures(tmp_path).forward(1)
    (tmp_path / "shard-000003.safetensors").unlink()  # and one deleted
    with pytest.warns(UserWarning, match=r"left out 2 shard\(s\) holding 2 forward.*"
                                         r"shard-000001"):
        caps = fxprobe.open_captures(tmp_path, on_error="skip")
    assert [(s.file, s.forwards) for s in caps.skipped] == [
        ("shard-000001.safetensors", 1), ("shard-000003.safetensors", 1)]
    assert "checksum" in caps.skipped[0].reason and "cannot be opened" in caps.skipped[1].reason
    assert len(caps) == 2
    assert torch.equal(caps.forward(0)["a"], vals[0]) and torch.equal(caps.forward(1)["a"],
                                                                        vals[2])
    assert torch.equal(caps.dataset("a", rows="samples")[[0, 1, 2, 3]],
                       torch.cat([vals[0], vals[2]]))
    with pytest.raises(fxprobe.ConfigError, match="on_error"):
        fxprobe.open_captures(tmp_path, on_error="ignore")  # type: ignore[arg-type]
