"""A writer killed with SIGKILL right after a forward was handed over (an event in the child,
not a deadline) loses at most that forward: by default (``queue=0``) ``Disk.write`` returns
once the forward before it is written (journaled), so every earlier forward reads back,
equal to the values written; ``queue=k`` lets ``k`` more wait unwritten, as documented."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import fxprobe

ROOT = Path(__file__).resolve().parent.parent

# The writer is slowed (each forward's write sleeps first), so that forwards handed over
# would pile up unwritten in a queue; the child kills itself right after write(kill) returns.
CHILD = textwrap.dedent("""
    import os, signal, sys, time, torch
    import fxprobe
    from fxprobe.sinks import shards
    path, kill, queue = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    add = shards.Shard.add
    def slow_add(self, job, layout):
        time.sleep(0.1)
        add(self, job, layout)
    shards.Shard.add = slow_add
    disk = fxprobe.Disk(path, **({} if queue == "default" else {"queue": int(queue)}))
    for i in range(kill + 1):
        disk.write({"h": torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(i))})
    os.kill(os.getpid(), signal.SIGKILL)
""")


def value(i: int) -> torch.Tensor:
    return torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(i))


def killed(path: Path, kill: int, queue: str) -> fxprobe.Captures:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", CHILD, str(path), str(kill), queue], env=env,
                          capture_output=True, timeout=120)
    assert proc.returncode == -9, proc.stderr.decode()[-2000:]  # killed, not ended
    return fxprobe.open_captures(path)


@pytest.mark.parametrize("kill", [1, 3])
def test_a_sigkill_loses_at_most_the_forward_being_written(tmp_path: Path, kill: int) -> None:
    caps = killed(tmp_path / "acts", kill, "default")
    n = len(caps)
    assert kill <= n <= kill + 1, (n, kill)  # forwards 0 .. kill-1 written before the kill
    for i in range(n):
        assert torch.equal(caps.forward(i)["h"], value(i)), i
    with fxprobe.Disk(tmp_path / "acts", mode="append") as d:  # goes on without a gap
        d.write({"h": value(n)})
    again = fxprobe.open_captures(tmp_path / "acts")
    assert len(again) == n + 1 and torch.equal(again.forward(n)["h"], value(n))


def test_a_queue_lets_forwards_wait_unwritten_and_loses_no_more(tmp_path: Path) -> None:
    caps = killed(tmp_path / "acts", 4, "2")
    n = len(caps)
    assert 4 - 3 <= n <= 5, n  # at most the one being written and the 2 queued lost
    for i in range(n):
        assert torch.equal(caps.forward(i)["h"], value(i)), i
    with pytest.raises(fxprobe.ConfigError, match=r"queue=-1.*>= 0"):
        fxprobe.Disk(tmp_path / "other", queue=-1)
