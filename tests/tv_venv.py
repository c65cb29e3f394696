"""The venv with torchvision and timm (``.ci/tv-env``), which do not install beside the torch
under test: tests run a script there and read what it prints.

A test declares the scripts it runs with ``@uses_tv(job, ...)`` and reads each one's stdout
with ``run_tv(job)``. Once collection ends, every script the session's tests declare runs in
ONE background process tree in that venv (``tests/tv_batch.py``: interpreter, torch and
fxprobe started once, each script in a fresh fork), started by whichever xdist worker gets
there first and shared with the others through the session's temporary directory; the tests
meanwhile run on, and each reads its own script's outcome when it gets to it. A script's
failure fails the test that runs it, with its stderr; a script whose venv lacks a module skips
it, saying which. ``run_tv`` of a script no test declared runs it on its own, as before.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
BATCH = Path(__file__).resolve().parent / "tv_batch.py"
TV_PYTHON = Path(os.environ.get("FXPROBE_TV_PYTHON") or Path(
    os.environ.get("FXPROBE_TV_VENV", "/work/venv-tv")) / "bin" / "python")

needs_tv = pytest.mark.skipif(
    not TV_PYTHON.exists(),
    reason=f"no venv with timm and torchvision at {TV_PYTHON} (they do not install beside "
           "torch 2.13 here; .ci/tv-env builds it, or set FXPROBE_TV_PYTHON to a python with "
           "both)")


@dataclass(frozen=True)
class TvJob:
    """A script for the venv: ``code`` as ``python -c code``, or ``path`` with ``args`` as
    ``python path args``; ``timeout`` in seconds."""

    code: str | None = None
    path: str | None = None
    args: tuple[str, ...] = ()
    timeout: float = 600

    @property
    def key(self) -> str:
        spec = json.dumps([self.code, self.path, list(self.args), self.timeout])
        return hashlib.sha256(spec.encode()).hexdigest()[:20]

    def spec(self) -> dict[str, Any]:
        body: dict[str, Any] = ({"code": self.code} if self.path is None
                                else {"path": self.path, "args": list(self.args)})
        return {"key": self.key, "timeout": self.timeout, **body}


def uses_tv(*jobs: TvJob) -> Any:
    """Mark a test that runs ``jobs`` in the venv (and skips, saying why, without it)."""
    def mark(test: Any) -> Any:
        return needs_tv(pytest.mark.tv_jobs(*jobs)(test))
    return mark


def _env() -> dict[str, str]:
    paths = [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}


# --- the session's batch ---------------------------------------------------------------------

@dataclass
class _Batch:
    dir: Path | None = None
    waits: dict[str, float] = field(default_factory=dict)  # key: the most its result can take
    proc: subprocess.Popen[bytes] | None = None  # in the process that started it


_batch = _Batch()


def _shared_dir(config: pytest.Config) -> Path:
    """The session's temporary directory, one for all xdist workers of a run."""
    base = config._tmp_path_factory.getbasetemp()  # type: ignore[attr-defined]
    return base.parent if hasattr(config, "workerinput") else base


def start_batch(config: pytest.Config, items: list[pytest.Item]) -> None:
    """After collection: the scripts of the collected tests, in their order, in one batch
    (started here unless another worker of this run has started it)."""
    if config.option.collectonly:
        return
    jobs: dict[str, TvJob] = {}
    for item in items:
        if item.get_closest_marker("skip") or any(
                m.args and m.args[0] is True for m in item.iter_markers("skipif")):
            continue  # skipped whatever its script says
        for m in item.iter_markers("tv_jobs"):
            for job in m.args:
                jobs.setdefault(job.key, job)
    if not jobs or not TV_PYTHON.exists() or os.name != "posix":
        return  # nothing to batch, nowhere to run it, or no fork there: run_tv runs each alone
    digest = hashlib.sha256(" ".join(jobs).encode()).hexdigest()[:12]
    d = _shared_dir(config) / f"tv-batch-{digest}"
    d.mkdir(parents=True, exist_ok=True)
    total = 0.0
    for key, job in jobs.items():  # a result waits for those before it
        total += job.timeout
        _batch.waits[key] = total + 60
    _batch.dir = d
    try:
        os.close(os.open(d / "owner", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return  # another worker runs it
    (d / "jobs.json").write_text(json.dumps([j.spec() for j in jobs.values()]))
    with open(d / "log", "wb") as log:
        _batch.proc = subprocess.Popen(
            [str(TV_PYTHON), str(BATCH), str(d / "jobs.json"), str(d)], stdout=log,
            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=_env(), cwd=ROOT)
    (d / "pid.part").write_text(str(_batch.proc.pid))
    (d / "pid.part").rename(d / "pid")


def finish_batch(config: pytest.Config) -> None:
    """At the end of this process's session: say so; the process that started the batch
    waits for it while another worker may still read it, then ends it."""
    d = _batch.dir
    if d is None:
        return
    worker = getattr(config, "workerinput", {}).get("workerid", "main")
    (d / f"finished-{worker}").write_text("")
    if _batch.proc is None:
        return
    workers = int(getattr(config, "workerinput", {}).get("workercount", 1))
    deadline = time.monotonic() + max(_batch.waits.values(), default=0)
    while (_batch.proc.poll() is None and time.monotonic() < deadline
           and len(list(d.glob("finished-*"))) < workers):
        time.sleep(0.5)
    if _batch.proc.poll() is None:
        _batch.proc.kill()
        _batch.proc.wait()


def _batch_alive(d: Path) -> bool:
    if _batch.proc is not None:
        return _batch.proc.poll() is None
    try:
        pid = int((d / "pid").read_text())
    except (OSError, ValueError):
        return True  # not started yet: the worker that starts it is about to
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        try:
            os.kill(pid, 0)
        except OSError:
            return False
        return True
    return state not in ("Z", "X")


def _log_tail(d: Path) -> str:
    try:
        return (d / "log").read_text(errors="replace")[-3000:]
    except OSError:
        return "(no log)"


def _from_batch(job: TvJob) -> dict[str, Any]:
    d = _batch.dir
    assert d is not None
    result = d / f"{job.key}.json"
    deadline = time.monotonic() + _batch.waits[job.key]
    while not result.exists():
        if (d / "done").exists() or not _batch_alive(d):
            if result.exists():
                break
            pytest.fail(f"the batch of torchvision-venv scripts in {d} ended without this "
                        f"test's script; its log:\n{_log_tail(d)}")
        if time.monotonic() > deadline:
            pytest.fail(f"no result in {d} for this test's script after "
                        f"{_batch.waits[job.key]:.0f} s; the batch's log:\n{_log_tail(d)}")
        time.sleep(0.2)
    outcome: dict[str, Any] = json.loads(result.read_text())
    return outcome


def _alone(job: TvJob) -> dict[str, Any]:
    cmd = ([str(TV_PYTHON), "-c", job.code] if job.path is None
           else [str(TV_PYTHON), job.path, *job.args])
    try:
        run = subprocess.run(cmd, capture_output=True, text=True, env=_env(), cwd=ROOT,
                             timeout=job.timeout)
    except subprocess.TimeoutExpired as e:
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else e.stderr
        return {"rc": None, "timed_out": True, "stdout": "", "stderr": err or ""}
    return {"rc": run.returncode, "timed_out": False, "stdout": run.stdout,
            "stderr": run.stderr}


def run_tv(job: TvJob | str, timeout: float = 600) -> str:
    """The stdout of ``job`` (or of the code ``job``) in the venv with this checkout's fxprobe
    on its path. Skips where the venv lacks a module the script imports; fails, with its
    stderr, where it fails or outlives its timeout."""
    if isinstance(job, str):
        job = TvJob(code=job, timeout=timeout)
    out = _from_batch(job) if job.key in _batch.waits else _alone(job)
    if out["timed_out"]:
        pytest.fail(f"the script ran past its {job.timeout:.0f} s in {TV_PYTHON}; its "
                    f"stderr:\n{out['stderr'][-3000:]}")
    if out["rc"] != 0 and "No module named" in out["stderr"]:
        pytest.skip(f"{TV_PYTHON} lacks a module: {out['stderr'].splitlines()[-1]}")
    assert out["rc"] == 0, out["stderr"][-3000:]
    stdout: str = out["stdout"]
    return stdout
