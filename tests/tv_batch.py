"""Runs every check the test session needs in the torchvision venv, in one process tree:

    python tests/tv_batch.py JOBS.json OUTDIR

torch and fxprobe are imported once, then each job runs in a child forked from that state, as
``python -c CODE`` (or ``python PATH ARGS``) would run it in a fresh interpreter: its own
globals, ``__name__ == "__main__"``, the random generators unseeded, only the modules torch and
fxprobe import already imported (fxprobe never imports torchvision or timm), its own stdout and
stderr, its exit status, a timeout of its own. Each job's outcome is written to
``OUTDIR/<key>.json`` (``rc``, ``stdout``, ``stderr``, ``timed_out``) as soon as it ends, in the
order given; ``OUTDIR/done`` when all have. Read by ``tests/tv_venv.py``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
from pathlib import Path

sys.path[0] = ""  # as under ``python -c``: the working directory first, not tests/

try:  # the point: imported once, before the forks; where that fails each job says why
    import torch  # noqa: F401

    import fxprobe  # noqa: F401
except Exception:  # noqa: BLE001 (each job imports them again and fails with its own stderr)
    pass


def _run_in_child(job: dict, out: Path, err: Path) -> None:
    """The forked child: run ``job`` with fds 1 and 2 on ``out``/``err``; never returns."""
    code = 1
    try:
        signal.alarm(int(job["timeout"]))  # the default action ends the child
        for fd, path in ((1, out), (2, err)):
            f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(f, fd)
            os.close(f)
        if "path" in job:
            import runpy

            sys.argv = [job["path"], *job["args"]]
            sys.path[0] = os.path.dirname(os.path.abspath(job["path"]))
            runpy.run_path(job["path"], run_name="__main__")
        else:
            sys.argv = ["-c"]
            exec(compile(job["code"], "<string>", "exec"), {"__name__": "__main__",
                                                              "__builtins__": __builtins__})
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, int) and e.code is not None:
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 (what python -c prints for an uncaught exception)
        import traceback

        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def main(jobs_path: str, outdir: str) -> None:
    jobs = json.loads(Path(jobs_path).read_text())
    dest = Path(outdir)
    for job in jobs:
        with tempfile.TemporaryDirectory() as tmp:
            out, err = Path(tmp) / "out", Path(tmp) / "err"
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _run_in_child(job, out, err)
            _, status = os.waitpid(pid, 0)
            timed_out = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGALRM
            rc = os.waitstatus_to_exitcode(status)
            result = {"rc": rc, "timed_out": timed_out,
                      "stdout": out.read_text(errors="replace") if out.exists() else "",
                      "stderr": err.read_text(errors="replace") if err.exists() else ""}
        part = dest / f"{job['key']}.json.part"
        part.write_text(json.dumps(result))
        part.rename(dest / f"{job['key']}.json")  # whole or absent for a reader
    (dest / "done").write_text("")


if __name__ == "__main__":
    main(*sys.argv[1:3])
