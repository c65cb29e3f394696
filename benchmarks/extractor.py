"""``python -m benchmarks.extractor``: ResNet-50 features up to ``layer2``, pruned or not.

What a feature extractor that stops after the last requested value saves. The baseline is the
bare model's forward (inference, ``no_grad``); each treatment is timed against it in
interleaved rounds (``benchmarks.timing``), and its values are checked first:

- ``hand floor``: ``layer2(layer1(stem(x)))`` written by hand, the least any tool can do;
- ``extractor, pruned``: ``fxprobe.extractor(model, return_nodes={"layer2": "feat"})``;
- ``extractor, full graph``: ``fxprobe.extractor(model, ops="layer2")`` (runs the head too);
- ``tap, full forward``: ``fxprobe.tap(model, ops="layer2")`` (the model's output, plus a tap);
- ``torchvision``: ``create_feature_extractor(model, return_nodes={"layer2": "feat"})``, only
  with ``--torchvision``, which builds torchvision's own ``resnet50``.

Without ``--torchvision`` the model is ``benchmarks.models.ResNet50`` (the same layout, no
torchvision needed). ``--tv-python PATH`` also runs the torchvision comparison in another Python
that has torchvision (its own torch version: compare its rows with each other only).

Examples::

    python -m benchmarks.extractor                    # 224x224, batch 1
    python -m benchmarks.extractor --quick            # 64x64, a smoke run
    python -m benchmarks.extractor --tv-python /work/venv-tv/bin/python
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

import fxprobe

from .timing import Treatment, calibrate, interleave, summarize, warm


def _resnet50(torchvision: bool) -> nn.Module:
    torch.manual_seed(0)
    if torchvision:
        from torchvision.models import resnet50

        return resnet50().eval()
    from .models import ResNet50

    return ResNet50().eval()


def _floor(model: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    def run(x: torch.Tensor) -> torch.Tensor:
        x = model.maxpool(model.relu(model.bn1(model.conv1(x))))
        return model.layer2(model.layer1(x))

    return run


def measure(*, torchvision: bool, batch: int, side: int, rounds: int, min_slot_s: float
            ) -> dict[str, Any]:
    """Time every treatment against the model's forward; return a JSON-ready record."""
    torch.set_grad_enabled(False)
    model = _resnet50(torchvision)
    x = torch.randn(batch, 3, side, side)
    want = _floor(model)(x.clone())
    pruned = fxprobe.extractor(model, return_nodes={"layer2": "feat"})
    full = fxprobe.extractor(model, ops="layer2")
    tapped = fxprobe.tap(model, ops="layer2")
    runs: dict[str, Callable[[], Any]] = {
        "hand floor": lambda: _floor(model)(x),
        "extractor, pruned": lambda: pruned(x),
        "extractor, full graph": lambda: full(x),
        "tap, full forward": lambda: tapped(x),
    }
    got = {"hand floor": want, "extractor, pruned": pruned(x)["feat"],
           "extractor, full graph": full(x)[1]["layer2"]}
    tapped(x)
    got["tap, full forward"] = tapped.taps["layer2"]
    if torchvision:
        from torchvision.models.feature_extraction import create_feature_extractor

        tv = create_feature_extractor(model, return_nodes={"layer2": "feat"})
        runs["torchvision create_feature_extractor"] = lambda: tv(x)
        got["torchvision create_feature_extractor"] = tv(x)["feat"]
    for key, value in got.items():
        if not torch.equal(value, want):
            raise SystemExit(f"{key}: layer2 differs from the hand-written forward")
    treatments = [Treatment(key, run) for key, run in runs.items()]
    iters, _ = calibrate(lambda: model(x), min_slot_s=min_slot_s, warmup_s=1.0, cuda=False)
    warm(treatments, iters, cuda=False)
    samples = interleave(lambda: model(x), treatments, iters=iters, rounds=rounds, cuda=False,
                         seed=0)
    rows = []
    for t in treatments:
        s = summarize(samples[t.key], cuda=False)
        rows.append({"treatment": t.key, "ms": s.treatment_ms, "model_ms": s.baseline_ms,
                     "ratio": s.ratio, "ratio_q25": s.ratio_q25, "ratio_q75": s.ratio_q75,
                     "rounds": s.rounds})
    return {
        "model": "torchvision resnet50" if torchvision else "benchmarks.models.ResNet50",
        "input": f"{batch}x3x{side}x{side}", "iters_per_slot": iters,
        "torch": torch.__version__, "threads": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(), "python": platform.python_version(),
        "rows": rows,
    }


def markdown(record: dict[str, Any]) -> str:
    lines = [
        f"{record['model']}, input {record['input']}, torch {record['torch']}, CPU, "
        f"{record['threads']} threads, {record['rows'][0]['rounds']} interleaved rounds of "
        f"{record['iters_per_slot']} call(s); time relative to the model's forward:",
        "",
        "| treatment | ms (median) | model's forward, ms | ratio (median) | ratio IQR |",
        "|---|---|---|---|---|",
    ]
    for r in record["rows"]:
        lines.append(f"| {r['treatment']} | {r['ms']:.2f} | {r['model_ms']:.2f} | "
                     f"{r['ratio']:.3f} | {r['ratio_q25']:.3f}-{r['ratio_q75']:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.extractor",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--side", type=int, default=224)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--min-slot", type=float, default=0.2, help="seconds per timed slot")
    parser.add_argument("--quick", action="store_true", help="64x64, 3 rounds: a smoke run")
    parser.add_argument("--torchvision", action="store_true",
                        help="torchvision's resnet50 and create_feature_extractor, in this Python")
    parser.add_argument("--tv-python", type=Path,
                        help="also run --torchvision with this Python (one with torchvision)")
    parser.add_argument("--json", type=Path, help="write the records here")
    args = parser.parse_args(argv)
    if args.quick:
        args.side, args.rounds, args.min_slot = 64, 3, 0.05
    common = ["--batch", str(args.batch), "--side", str(args.side), "--rounds",
              str(args.rounds), "--min-slot", str(args.min_slot)]
    records = [measure(torchvision=args.torchvision, batch=args.batch, side=args.side,
                       rounds=args.rounds, min_slot_s=args.min_slot)]
    print(markdown(records[0]), flush=True)
    if args.tv_python is not None:
        root = Path(__file__).resolve().parents[1]
        env = {**os.environ, "PYTHONPATH": str(root)}
        out = subprocess.run(
            [str(args.tv_python), "-m", "benchmarks.extractor", "--torchvision", "--json",
             "/dev/stdout", *common], env=env, capture_output=True, text=True, check=False)
        if out.returncode != 0:
            raise SystemExit(f"{args.tv_python} failed:\n{out.stderr[-3000:]}")
        tv = json.loads(out.stdout[out.stdout.index("\n{") + 1:])
        records.append(tv["records"][0])
        print("\n" + markdown(records[-1]))
    if args.json is not None:
        text = json.dumps({"records": records}, indent=1)
        if str(args.json) == "/dev/stdout":
            print("\n" + text)
        else:
            args.json.write_text(text + "\n")


if __name__ == "__main__":
    sys.exit(main())
