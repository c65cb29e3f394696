"""Peak memory of one forward, each approach in a fresh process.

In the long-lived benchmark process the allocator keeps what earlier treatments freed (glibc does
not give the heap back), so an RSS high-water mark there says more about the order of the
treatments than about any of them. Here a child process builds the model, measures one bare
forward, then one forward of a single treatment: ``torch.cuda.max_memory_allocated`` on CUDA,
the RSS high-water mark (``VmHWM``, reset through ``/proc/self/clear_refs``) on a CPU.

Run as ``python -m benchmarks.memprobe '<json>'`` by :func:`measure`; prints one JSON line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parent.parent


def measure(model: str, batch: int, quick: bool, approach: str, mode: str, device: str,
            dtype: str, threads: int, seed: int, timeout_s: float = 180.0
            ) -> tuple[int | None, int | None, str]:
    """(treatment peak, bare peak, note) in bytes, from a child process."""
    args = {"model": model, "batch": batch, "quick": quick, "approach": approach,
            "mode": mode, "device": device, "dtype": dtype, "threads": threads, "seed": seed}
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(_ROOT), env.get("PYTHONPATH", "")]).rstrip(
        os.pathsep)
    try:
        proc = subprocess.run([sys.executable, "-m", "benchmarks.memprobe", json.dumps(args)],
                              capture_output=True, text=True, timeout=timeout_s, env=env,
                              cwd=str(_ROOT), check=False)
    except subprocess.TimeoutExpired:
        return None, None, f"memory probe timed out after {timeout_s:.0f} s"
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        err = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return None, None, f"memory probe failed: {err[:200]}"
    out = json.loads(lines[-1])
    return out["peak"], out["bare_peak"], out.get("note", "")


def _hwm() -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _child(args: dict[str, Any]) -> dict[str, Any]:
    import torch

    import fxprobe

    from . import approaches as ap
    from .models import MODELS
    from .modes import MODES

    torch.set_num_threads(args["threads"])
    device = torch.device(args["device"])
    dtype = getattr(torch, args["dtype"])
    cuda = device.type == "cuda"
    spec = MODELS[args["model"]]
    torch.manual_seed(args["seed"])
    model = spec.build().to(device, dtype).eval()
    inputs = tuple(a.to(dtype) if a.is_floating_point() else a
                   for a in spec.make_input(args["batch"], args["quick"], device))

    def peak(run: Any) -> int | None:
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            run()
            torch.cuda.synchronize()
            return int(torch.cuda.max_memory_allocated())
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        run()
        return _hwm()

    with torch.no_grad():
        bare = ap.bare(model, inputs, False, "bare").treatment
        bare.run()
        bare_peak = peak(bare.run)
        sets = ap.site_sets(fxprobe.sites(model).records, {})
        mode = MODES[args["mode"]]
        if args["approach"] == "taps":
            built = ap.taps(model, inputs, False, "t", sets["all"], mode, device)
        else:
            built = ap.module_hooks(model, inputs, False, "t", sets["all"], mode)
        t = built.treatment
        if t.enter is not None:
            t.enter()
        t.run()  # the capture of this forward is held while the next one runs, as in use
        treatment_peak = peak(t.run)
        if t.exit is not None:
            t.exit()
    return {"peak": treatment_peak, "bare_peak": bare_peak}


if __name__ == "__main__":
    print(json.dumps(_child(json.loads(sys.argv[1]))))
