"""The venv with torchvision and timm (``.ci/tv-env``), which do not install beside the torch
under test: tests run a script there and read what it prints."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TV_PYTHON = Path(os.environ.get("FXPROBE_TV_PYTHON") or Path(
    os.environ.get("FXPROBE_TV_VENV", "/work/venv-tv")) / "bin" / "python")

needs_tv = pytest.mark.skipif(
    not TV_PYTHON.exists(),
    reason=f"no venv with timm and torchvision at {TV_PYTHON} (they do not install beside "
           "torch 2.13 here; .ci/tv-env builds it, or set FXPROBE_TV_PYTHON to a python with "
           "both)")


def run_tv(script: str, timeout: float = 600) -> str:
    """Run ``script`` in the venv with this checkout's fxprobe on its path; its stdout. Skips
    where the venv lacks a module the script imports; fails, with its stderr, where it fails."""
    run = subprocess.run([str(TV_PYTHON), "-c", script], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT, timeout=timeout)
    if run.returncode != 0 and "No module named" in run.stderr:
        pytest.skip(f"{TV_PYTHON} lacks a module: {run.stderr.splitlines()[-1]}")
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout
