"""What open_captures reads after things went wrong: a writer killed mid-harvest, a shard
truncated or overwritten after its commit. Values are checked against what the killed writer
was given (a seeded generator reproduces it here)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import fxprobe

ROOT = Path(__file__).resolve().parent.parent

HARVEST = textwrap.dedent("""
    import sys, torch
    from torch import nn
    import fxprobe
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
    g = torch.Generator().manual_seed(1)
    mode = sys.argv[2]
    with torch.no_grad(), fxprobe.tap(model, ops="1", to=fxprobe.Disk(
            sys.argv[1], shard_size=4000, mode=mode)) as tapped:
        for i in range(int(sys.argv[3])):
            tapped(torch.randn(4, 8, generator=g))
""")


def expected_values(n: int) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU())
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        return [model(torch.randn(4, 8, generator=g)) for _ in range(n)]


def run(path: Path, mode: str, forwards: int) -> subprocess.Popen[bytes]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.Popen([sys.executable, "-c", HARVEST, str(path), mode, str(forwards)],
                            env=env, stderr=subprocess.PIPE)


def test_a_writer_killed_mid_harvest_loses_at_most_the_shard_in_flight(tmp_path: Path) -> None:
    proc = run(tmp_path, "new", 10**6)
    index = tmp_path / "index.json"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if index.exists() and len(json.loads(index.read_text())["shards"]) >= 3:
            break
        if proc.poll() is not None:
            pytest.fail(f"the harvest ended early: {proc.stderr.read().decode()[-2000:]}")
        time.sleep(0.05)
    else:
        proc.kill()
        pytest.fail("the harvest committed no 3 shards in 120 s")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    caps = fxprobe.open_captures(tmp_path)
    n = len(caps)
    listed = json.loads(index.read_text())
    assert n == listed["forwards"] == sum(s["count"] for s in listed["shards"]) > 0
    ref = expected_values(n + 50)
    for i in range(n):  # every committed forward reads back exactly
        assert torch.equal(caps.forward(i)["1"], ref[i]), i
    ds = caps.dataset("1", rows="samples")
    assert torch.equal(torch.stack([ds[i] for i in range(len(ds))]), torch.cat(ref[:n]))
    # resuming removes what the kill left behind and continues the numbering
    proc = run(tmp_path, "append", 5)
    assert proc.wait() == 0, proc.stderr.read().decode()[-2000:]
    assert not list(tmp_path.glob("*.partial"))
    caps = fxprobe.open_captures(tmp_path)
    assert len(caps) == n + 5
    for i in range(n):
        assert torch.equal(caps.forward(i)["1"], ref[i]), i
    again = expected_values(5)  # the resumed run starts its generator over
    for i in range(5):
        assert torch.equal(caps.forward(n + i)["1"], again[i]), i


def committed(tmp_path: Path, forwards: int = 40) -> list[str]:
    proc = run(tmp_path, "new", forwards)
    assert proc.wait() == 0, proc.stderr.read().decode()[-2000:]
    return [s["file"] for s in json.loads((tmp_path / "index.json").read_text())["shards"]]


@pytest.mark.parametrize("damage", ["truncated", "header", "swapped", "missing"])
def test_a_corrupted_shard_is_reported_by_name_and_never_read(tmp_path: Path,
                                                              damage: str) -> None:
    shards = committed(tmp_path)
    assert len(shards) >= 2
    bad = tmp_path / shards[1]
    data = bad.read_bytes()
    if damage == "truncated":
        bad.write_bytes(data[: len(data) // 2])
    elif damage == "header":
        bad.write_bytes(data[:8] + b"#" * 40 + data[48:])
    elif damage == "swapped":  # another committed shard under this name: other forwards
        bad.write_bytes((tmp_path / shards[0]).read_bytes())
    else:
        bad.unlink()
    caps = fxprobe.open_captures(tmp_path)
    ref = expected_values(len(caps))
    assert torch.equal(caps.forward(0)["1"], ref[0])  # the intact shard still reads
    first_bad = json.loads((tmp_path / "index.json").read_text())["shards"][1]["first"]
    with pytest.raises(fxprobe.DiskError, match=shards[1].replace(".", r"\.")):
        caps.forward(first_bad)
    with pytest.raises(fxprobe.DiskError, match=shards[1].replace(".", r"\.")):
        caps.dataset("1", rows="samples")
