"""One job of 2 gloo ranks on CPU for every distributed scenario of the session (starting
the ranks, each importing torch, transformers and fxprobe, is the slow part).

A group is a test-support module with ``SCENARIOS`` (name: ``fn(rank, path)``, which checks
itself against an independent reference and raises where it fails; what it returns, JSON,
is handed to the test) and, optionally, ``prepare(tmp) -> path`` (run once, before the ranks
start; its result is the ``path`` its scenarios get). After collection, the groups the
collected tests read are known (``GROUPS`` names the test module of each); the first test to
ask for a verdict runs them all, in the order of ``GROUPS``, in one job, under a lock in the
session's temporary directory shared by the xdist workers; the other tests, on any worker,
read the verdicts it left. ``torch._dynamo.reset()`` separates the groups, as the separate
jobs they ran in before did.
"""

from __future__ import annotations

import datetime
import fcntl
import importlib
import json
import os
import socket
import time
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as tdist
import torch.multiprocessing as mp

WORLD = 2
# No deadline for the whole run: a loaded machine is slow, not wrong. A collective waits up to
# WAIT_S for the other rank (gloo's timeout: a rank that never comes is an error, not a hang),
# and the run is given up only when no scenario has finished for STALL_S.
WAIT_S = float(os.environ.get("FXPROBE_TEST_DIST_WAIT_S", "900"))
STALL_S = 2 * WAIT_S + 60

# group module: the test module that reads its verdicts. A group whose scenario may kill a
# rank (gloo aborts on mismatched collectives) goes last: the groups after it would not run.
GROUPS = {"dist_scenarios": "test_dist", "test_tensor_parallel": "test_tensor_parallel",
          "test_review_percall": "test_review_percall"}

_wanted: list[str] = []  # the groups of the collected tests, in the order of GROUPS


def collected(items: list[pytest.Item]) -> None:
    """After collection: the groups whose tests were collected."""
    modules = {item.module.__name__ for item in items
               if isinstance(item, pytest.Function) and "gloo_verdicts" in item.fixturenames}
    _wanted[:] = [g for g, test in GROUPS.items() if test in modules]


def _shared_dir(config: pytest.Config) -> Path:
    base = config._tmp_path_factory.getbasetemp()  # type: ignore[attr-defined]
    return base.parent if hasattr(config, "workerinput") else base


def verdicts(config: pytest.Config, group: str) -> list[dict[str, Any]]:
    """Each rank's verdicts on ``group``'s scenarios: name: {"ok": ..., "value": ...} or
    {"ok": False, "error": ...}; the job is run here unless it has been (or is being) run."""
    if not tdist.is_available() or not tdist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    groups = _wanted if group in _wanted else [group]  # a group asked for outside collection
    d = _shared_dir(config) / ("gloo-" + "-".join(groups))
    d.mkdir(parents=True, exist_ok=True)
    with open(d / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not (d / "done").exists():
            _run(d, groups)
            (d / "done").write_text("")
    found = []
    for r in range(WORLD):
        f = d / f"rank{r}.json"
        every = json.loads(f.read_text()) if f.exists() else {}
        found.append({k.split(":", 1)[1]: v for k, v in every.items()
                      if k.split(":", 1)[0] == group})
    failure = (d / "failure").read_text() if (d / "failure").exists() else ""
    if failure:
        for v in found:
            for name in _scenarios(group):
                v.setdefault(name, {"ok": False, "error": f"did not run: {failure}"})
    return found


def _scenarios(group: str) -> list[str]:
    return list(importlib.import_module(group).SCENARIOS)


def _run(d: Path, groups: list[str]) -> None:
    paths = {}
    for g in groups:
        prepare = getattr(importlib.import_module(g), "prepare", None)
        (d / g).mkdir(exist_ok=True)
        with torch.random.fork_rng():  # the test that runs the job keeps its random state
            paths[g] = str(prepare(d / g) if prepare else d / g)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    ctx = mp.start_processes(worker, args=(port, str(d), groups, paths), nprocs=WORLD,
                             join=False, start_method="spawn")
    files = [d / f"rank{r}.json" for r in range(WORLD)]

    def progress() -> list[int]:  # scenarios each rank has finished (its file, rewritten)
        return [len(json.loads(f.read_text())) if f.exists() else 0 for f in files]

    seen, since = progress(), time.monotonic()
    try:
        while not ctx.join(timeout=5):
            now = progress()
            if now != seen:
                seen, since = now, time.monotonic()
            elif time.monotonic() - since > STALL_S:
                order = [f"{g}:{n}" for g in groups for n in _scenarios(g)]
                running = [order[n] if n < len(order) else "(the end)" for n in seen]
                (d / "failure").write_text(
                    f"no scenario finished for {STALL_S:.0f} s; the ranks are in {running}: "
                    f"a hang (each collective waits {WAIT_S:.0f} s; FXPROBE_TEST_DIST_WAIT_S "
                    "raises it on a very slow machine)")
                return
    except (mp.ProcessExitedException, mp.ProcessRaisedException) as e:  # a rank died
        order = [f"{g}:{n}" for g in groups for n in _scenarios(g)]
        running = [order[n] if n < len(order) else "(the end)" for n in progress()]
        (d / "failure").write_text(f"a rank died ({e}) in {running}")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()


def worker(rank: int, port: int, tmp: str, groups: list[str], paths: dict[str, str]) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD))
    tdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                             world_size=WORLD, timeout=datetime.timedelta(seconds=WAIT_S))
    out = Path(tmp) / f"rank{rank}.json"
    verdicts: dict[str, dict[str, Any]] = {}
    try:
        for group in groups:
            torch._dynamo.reset()
            for name, scenario in importlib.import_module(group).SCENARIOS.items():
                try:
                    verdicts[f"{group}:{name}"] = {
                        "ok": True, "value": scenario(rank, Path(paths[group]))}
                except Exception:  # noqa: BLE001 (reported by the test of that scenario)
                    verdicts[f"{group}:{name}"] = {"ok": False, "error": traceback.format_exc()}
                out.with_suffix(".tmp").write_text(json.dumps(verdicts))
                out.with_suffix(".tmp").replace(out)  # whole, for the parent that reads it
                tdist.barrier()
    finally:
        tdist.destroy_process_group()


def assert_ok(found: list[dict[str, Any]], name: str) -> Any:
    """The value ``name`` returned on each rank, or a failure with that rank's traceback."""
    for rank, v in enumerate(found):
        got = v.get(name, {"ok": False, "error": "did not run"})
        assert got["ok"], f"rank {rank}:\n{got['error']}"
    return [v[name]["value"] for v in found]
