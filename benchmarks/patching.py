"""An activation-patching sweep: per-call interventions against hand-written hooks (and nnsight).

A GPT-2 layout (4 layers, width 128, 4 heads, sequence 12, eager attention, batch 1, one
thread): 48 runs, each patching one layer's block output (the residual stream after the block)
at one position with its value from a donor input. Each approach runs the whole sweep; the
CPU time per run is compared with the bare model's forward, in shuffled, interleaved rounds
(the sweeps of all approaches in every round, a bare slot beside each):

- ``fxprobe``: one ``with tapped.intervene({"transformer.h.L": fn}): tapped(ids)`` per run, on
  a model tapped (and captured) once: every run is the first forward of a new block;
- ``hooks``: ``register_forward_hook`` on the block, a forward, ``handle.remove()``;
- ``nnsight``: ``with model.trace(ids): model.transformer.h[L].output[0][:, p] = ...``, when
  installed (else skipped, with the reason);
- ``fxprobe, nothing selected``: a plain forward of the tapped module (no block).

Usage: ``python -m benchmarks.patching [--rounds 15] [--out benchmarks/results/cpu]``; writes
``patching.json`` and ``patching.md``.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from . import dynamo as bench

LAYERS, WIDTH, SEQ = 4, 128, 12


def model() -> Any:
    import transformers

    config = transformers.GPT2Config(n_layer=LAYERS, n_embd=WIDTH, n_head=4, vocab_size=1000,
                                     n_positions=64, bos_token_id=0, eos_token_id=0)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).eval()


def sweeps(m: Any, ids: torch.Tensor, donor: torch.Tensor
           ) -> tuple[dict[str, Callable[[], Any]], dict[str, str], dict[str, Any]]:
    """The sweep of each approach (48 runs), the skipped ones with why, and their results."""
    import fxprobe

    tapped = fxprobe.tap(m, ops="transformer.h.0.add_1", tracer="dynamo")
    _, cache = tapped.run_with_cache(input_ids=donor, names="transformer.h.*")
    clean = {L: cache[f"transformer.h.{L}"] for L in range(LAYERS)}
    runs = [(L, p) for L in range(LAYERS) for p in range(SEQ)]

    def patch(L: int, p: int) -> Callable[[Any, torch.Tensor], torch.Tensor]:
        def fn(site: Any, value: torch.Tensor) -> torch.Tensor:
            value = value.clone()
            value[:, p] = clean[L][:, p]
            return value
        return fn

    out: dict[str, list[torch.Tensor]] = {}

    def run_fxprobe() -> None:
        out["fxprobe"] = []
        for L, p in runs:
            with tapped.intervene({f"transformer.h.{L}": patch(L, p)}):
                out["fxprobe"].append(tapped(input_ids=ids).logits[0, -1])

    def run_hooks() -> None:
        out["hooks"] = []
        for L, p in runs:
            fn = patch(L, p)
            handle = m.transformer.h[L].register_forward_hook(
                lambda mod, a, o, fn=fn: (fn(None, o[0]), *o[1:]) if isinstance(o, tuple)
                else fn(None, o))
            try:
                out["hooks"].append(m(input_ids=ids).logits[0, -1])
            finally:
                handle.remove()

    def run_plain() -> None:
        for _ in runs:
            tapped(input_ids=ids)

    found = {"fxprobe": run_fxprobe, "hooks": run_hooks,
             "fxprobe, nothing selected": run_plain}
    skipped: dict[str, str] = {}
    try:
        from nnsight import NNsight
    except ImportError as e:
        skipped["nnsight"] = f"not installed ({e}); not installed here to keep the shared " \
                             "environment's torch unchanged"
    else:
        wrapped = NNsight(m)

        def run_nnsight() -> None:
            saved = []
            for L, p in runs:
                with wrapped.trace(ids):
                    wrapped.transformer.h[L].output[0][:, p] = clean[L][:, p]
                    logits = wrapped.lm_head.output.save()
                saved.append(getattr(logits, "value", logits)[0, -1])
            out["nnsight"] = saved
        found["nnsight"] = run_nnsight
    return found, skipped, out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--out", type=Path, default=bench._ROOT / "results" / "cpu")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    bench.CLOCK = time.thread_time_ns
    m = model()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 1000, (1, SEQ), generator=g)
    donor = torch.randint(0, 1000, (1, SEQ), generator=g)
    with torch.no_grad():
        found, skipped, out = sweeps(m, ids, donor)
        for run in found.values():
            run()  # warm; and the answers, compared below
        same = all(torch.equal(a, b) for a, b in zip(out["fxprobe"], out["hooks"], strict=True))
        if not same:
            raise SystemExit("fxprobe's patched logits differ from the hooks'")

        def bare_sweep() -> None:
            for _ in range(LAYERS * SEQ):
                m(input_ids=ids)

        results = bench.interleave(bare_sweep, {k: (v, None) for k, v in found.items()},
                                   args.rounds, 1)
    env = bench.environment()
    rows = {k: {"ratio_median": float(np.median(r)), "ratio_iqr": [
        float(np.percentile(r, 25)), float(np.percentile(r, 75))],
        "us_per_run_over_bare": float(np.median(d)) / (LAYERS * SEQ)}
        for k, (d, r) in results.items()}
    record = {"environment": env, "layout": {"layers": LAYERS, "width": WIDTH, "seq": SEQ,
                                             "runs": LAYERS * SEQ, "rounds": args.rounds},
              "same_logits_as_hooks": same, "rows": rows, "skipped": skipped}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "patching.json").write_text(json.dumps(record, indent=1) + "\n")
    lines = [
        "# Activation patching: 48 runs (4 layers x 12 positions), GPT-2 layout",
        "",
        f"{env['run']}, commit {env['commit']}, torch {env['torch']}, transformers "
        f"{env['transformers']}, {env['torch_threads']} thread, CPU thread time, "
        f"{args.rounds} interleaved rounds; patched logits equal to the hooks': {same}.",
        "",
        "| approach | CPU time per run / bare forward (median [IQR]) | extra per run (us) |",
        "|---|---|---|",
    ]
    for k, row in rows.items():
        lo, hi = row["ratio_iqr"]
        lines.append(f"| {k} | {row['ratio_median']:.3f} [{lo:.3f}, {hi:.3f}] | "
                     f"{row['us_per_run_over_bare']:+.0f} |")
    for k, why in skipped.items():
        lines.append(f"| {k} | skipped: {why} | |")
    (args.out / "patching.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
