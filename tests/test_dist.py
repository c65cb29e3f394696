"""fxprobe under torch.distributed: 2 gloo ranks on CPU, spawned once for the whole module.

Each scenario runs on both ranks inside one spawned job (starting processes is the slow part)
and checks itself against an independent reference: an untapped DDP/FSDP2 run, eager forward
hooks, numpy statistics of every rank's tensors concatenated. The tests below read each
scenario's verdict.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time

import pytest
import torch.distributed as tdist
import torch.multiprocessing as mp
from dist_scenarios import SCENARIOS, worker
from dist_training import STALL_S, WAIT_S, WORLD
from torch import nn

import fxprobe


@pytest.fixture(scope="module")
def verdicts(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, str]]:
    if not tdist.is_available() or not tdist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    tmp = tmp_path_factory.mktemp("dist")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    ctx = mp.start_processes(worker, args=(port, str(tmp)), nprocs=WORLD, join=False,
                             start_method="spawn")
    files = [tmp / f"rank{r}.json" for r in range(WORLD)]

    def progress() -> list[int]:  # scenarios each rank has finished (its file, rewritten)
        return [len(json.loads(f.read_text())) if f.exists() else 0 for f in files]

    seen, since = progress(), time.monotonic()
    try:
        while not ctx.join(timeout=5):
            now = progress()
            if now != seen:
                seen, since = now, time.monotonic()
            elif time.monotonic() - since > STALL_S:
                running = [list(SCENARIOS)[n] if n < len(SCENARIOS) else "(the end)"
                           for n in seen]
                raise TimeoutError(
                    f"no scenario finished for {STALL_S:.0f} s; the ranks are in {running}: "
                    f"a hang (each collective waits {WAIT_S:.0f} s; FXPROBE_TEST_DIST_WAIT_S "
                    "raises it on a very slow machine)")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    found = []
    for r in range(WORLD):
        f = tmp / f"rank{r}.json"
        found.append(json.loads(f.read_text()) if f.exists() else {})
    return found


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_scenario_on_two_gloo_ranks(verdicts: list[dict[str, str]], scenario: str) -> None:
    for rank, v in enumerate(verdicts):
        assert v.get(scenario) == "ok", f"rank {rank}:\n{v.get(scenario, 'did not run')}"


def test_needs_an_initialized_process_group() -> None:
    assert not tdist.is_initialized()
    with pytest.raises(fxprobe.ConfigError, match="init_process_group"):
        fxprobe.dist.reduce_stats({})
    with pytest.raises(fxprobe.ConfigError, match="every must be"):
        fxprobe.dist.CrossRankStatsLogger(nn.Linear(1, 1), every=0)
    with pytest.raises(fxprobe.ConfigError, match="sink must be callable"):
        fxprobe.dist.CrossRankStatsLogger(nn.Linear(1, 1), sink="tensorboard")  # type: ignore[arg-type]


if __name__ == "__main__":  # python tests/test_dist.py: the scenarios, verbosely
    sys.exit(pytest.main([__file__, "-v"]))
