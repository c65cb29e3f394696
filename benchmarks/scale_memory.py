"""Peak memory a recording forward adds over the untapped forward, on a deep model (CPU).

    python -m benchmarks.scale_memory [--layers 32] [--batch 4] [--seq 1024] [--out DIR]

A ``LlamaForCausalLM`` (Llama layout, hidden 64, 4 heads, MLP 128, vocabulary 256, random
weights, eval, ``torch.no_grad``), ``--layers`` deep. Three configurations, each in a fresh
process started with ``MALLOC_MMAP_THRESHOLD_=65536`` (glibc then serves every allocation of
64 KiB or more, each tensor here, from its own mapping and returns it when freed, so that the
resident set follows the live tensors):

- ``bare``: the untapped model (for reference: dynamo's graphs free what they no longer need
  at other points than eager code does, so the baseline of the two below is the next one);
- ``dynamo baseline``: ``fxprobe.tap(model, ops="input_ids", tracer="dynamo")``, which keeps
  the input ids only, a plain forward;
- ``tap``: ``fxprobe.tap(model, ops=SEL, tracer="dynamo")``, a plain forward;
- ``run_with_cache``: ``fxprobe.tap(model, ops="input_ids", tracer="dynamo")`` and
  ``tapped.run_with_cache(ids, names=SEL)``;

with ``SEL = "blocks.*.resid_post"``, every forward with ``use_cache=False`` (no key/value
cache). Each process warms up (two forwards at the measured
shape, one at one token: dynamo captures both), runs the one-token forward (so that what the
last forward kept is a few bytes), reads its resident set, resets the high-water mark
(``/proc/self/clear_refs``), runs one forward at the measured shape and reads ``VmHWM``: the
peak that forward added. The configuration's added peak minus the dynamo baseline's is set
against the selected bytes (layers x batch x seq x hidden x 4). Writes ``scale-memory.json`` to
``benchmarks/results/cpu/`` (or ``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parent
SEL = "blocks.*.resid_post"


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} in /proc/self/status")


def child(config: str, layers: int, batch: int, seq: int) -> dict[str, Any]:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import fxprobe

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        num_hidden_layers=layers, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, vocab_size=256, max_position_embeddings=seq)).eval()
    ids = torch.randint(1, 256, (batch, seq))
    one = ids[:1, :1]
    if config == "bare":
        run = model
    elif config == "dynamo baseline":
        run = fxprobe.tap(model, ops="input_ids", tracer="dynamo")
    elif config == "tap":
        run = fxprobe.tap(model, ops=SEL, tracer="dynamo")
    else:
        tapped = fxprobe.tap(model, ops="input_ids", tracer="dynamo")

        def run(x: torch.Tensor, **kwargs: Any) -> Any:
            return tapped.run_with_cache(x, names=SEL, **kwargs)
    with torch.no_grad():
        for x in (ids, ids, one):
            out = run(x, use_cache=False)
        del out
        out = run(one, use_cache=False)
        del out
        before = _status("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the high-water mark starts again from the resident set
        out = run(ids, use_cache=False)
        peak = _status("VmHWM")
        kept = _status("VmRSS")  # with the output still held
        del out
    return {"config": config, "peak_added": peak - before, "kept_after": kept - before}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.scale_memory",
                                description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--out", type=Path, default=_ROOT / "results" / "cpu")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child is not None:
        print(json.dumps(child(args.child, args.layers, args.batch, args.seq)), flush=True)
        return 0
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    rows = {}
    for config in ("bare", "dynamo baseline", "tap", "run_with_cache"):
        done = subprocess.run(
            [sys.executable, "-m", "benchmarks.scale_memory", "--child", config,
             "--layers", str(args.layers), "--batch", str(args.batch), "--seq", str(args.seq)],
            capture_output=True, text=True, env=env, cwd=_ROOT.parent, check=False)
        lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
        rows[config] = json.loads(lines[-1]) if lines else {
            "config": config, "failed": (done.stderr.strip().splitlines() or ["?"])[-1]}
        print(json.dumps(rows[config]), file=sys.stderr, flush=True)
    selected = args.layers * args.batch * args.seq * 64 * 4
    base = rows["dynamo baseline"]
    for config in ("tap", "run_with_cache"):
        r = rows[config]
        if "peak_added" in r and "peak_added" in base:
            r["added_over_baseline"] = r["peak_added"] - base["peak_added"]
            r["over_selected"] = r["added_over_baseline"] / selected
    record = {"layers": args.layers, "batch": args.batch, "seq": args.seq, "selector": SEL,
              "selected_bytes": selected, "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "scale-memory.json").write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
