"""The first dynamo compilation of a region is quiet: dynamo's graph-break logs and torch's
warnings become one fxprobe warning; the model's own warnings still reach the user. Run in a
fresh process, where dynamo's log handlers write to stderr as a user would see them."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

_SCRIPT = textwrap.dedent("""
    import warnings
    import torch
    from torch import nn
    import fxprobe

    class Gate(nn.Module):  # .item() breaks dynamo's graph, and dynamo logs it
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x):
            scale = float(x.abs().sum().item())
            warnings.warn("the model's own warning")
            return self.b(torch.relu(self.a(x)) * scale)

    torch.manual_seed(0)
    model = Gate().eval()
    x = torch.randn(2, 4)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        want = model(x)
    quiet = "{quiet}" == "1"
    run = fxprobe.tap(model, ops=nn.Linear, tracer="dynamo") if quiet else torch.compile(
        model, backend="eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad():
            out = run(x)
            run(x)
    for w in caught:
        print("WARNING:", str(w.message).replace(chr(10), " "))
    assert torch.equal(out, want)
    if quiet:
        print("taps", sorted(run.taps))
""")


def _run(quiet: bool) -> subprocess.CompletedProcess[str]:
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TORCH_LOGS"}
    env["PYTHONPATH"] = str(root)
    return subprocess.run([sys.executable, "-c", _SCRIPT.replace("{quiet}", str(int(quiet)))],
                          env=env, capture_output=True, text=True)


def test_first_compile_is_one_fxprobe_warning() -> None:
    loud = _run(quiet=False)  # the reference: what dynamo prints for this model by itself
    assert loud.returncode == 0, loud.stderr[-3000:]
    assert "Graph break" in loud.stderr
    run = _run(quiet=True)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "Graph break" not in run.stderr, run.stderr[-3000:]
    assert run.stderr.strip() == "", run.stderr[-3000:]
    lines = run.stdout.splitlines()
    ours = [line for line in lines if "fxprobe: torch dynamo captured" in line]
    assert len(ours) == 1, run.stdout
    assert "graph break(s)" in ours[0] and "tapped.dynamo_info" in ours[0]
    # The model's own warning is not swallowed: once per forward, as without fxprobe.
    assert sum("the model's own warning" in line for line in lines) == 2, run.stdout
    assert "taps ['a', 'b']" in run.stdout
