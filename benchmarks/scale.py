"""First-call and warm costs against depth: fxprobe, hand-written hooks and nnsight.

    python -m benchmarks.scale [--layers 2,8,32,80] [--seq 32] [--repeats 7]
                               [--approaches fxprobe,hooks,nnsight,...]
                               [--tracer dynamo]
                               [--device cpu|cuda] [--size tiny|1b] [--no-cache] [--out DIR]

A ``LlamaForCausalLM`` from a config (random weights, seed 0, eval mode, ``torch.no_grad``):
``--size tiny`` is the Llama layout with hidden size 64 (4 heads, 2 key/value heads, MLP 128,
vocabulary 256), ``--size 1b`` a Llama-shaped ~1.2 B model (hidden 2048, 32 heads, 8 key/value
heads, MLP 8192, vocabulary 32000, bfloat16) for ``--device cuda``. Each approach records the
output of every decoder layer (fxprobe: ``ops="blocks.*.resid_post"``; hooks: a forward hook
per layer keeping a detached reference; nnsight: ``.output.save()`` of every layer in one
trace) and, as its first edit, doubles layer 0's output. ``--no-cache`` builds the model with
``use_cache=False`` (no KV cache: what training and encoders run). fxprobe's dynamo frontend
captures each distinct decoder layer once for all of them (``frontends/dynamo_blocks.py``);
``--approaches fxprobe-marked`` marks them instead (``frontends/dynamo_inline.py``) and
``FXPROBE_DYNAMO_REGIONS=0`` in the environment captures every layer in the model's graph.

Per (approach, depth), in a fresh subprocess (so that first-call costs include everything a
new process pays: dynamo's caches are empty), wall-clock seconds (``time.perf_counter``;
``torch.cuda.synchronize`` before each reading on cuda) of:

- ``first``: setting up (``fxprobe.tap``, registering hooks, ``NNsight(model)``) and the first
  forward, batch 1 and ``--seq`` tokens;
- ``new_length``: the first forward at ``--seq + 7`` tokens; ``new_batch``: the first at batch 2;
  each followed by the median of ``max(--iters, 3)`` more at that shape (``*_warm_ms``), what
  the call costs once nothing is captured for it any more;
- ``first_edit``: the first forward with the edit (``tapped.intervene``, a hook returning the
  doubled output, an nnsight assignment);
- ``warm``: ``--repeats`` rounds, each ``--iters`` bare forwards of an untapped twin of the
  model then as many of the approach (interleaved); the medians of the per-call times, and
  the median of the per-round ratios.

On cuda, ``peak_added_mib`` is the peak memory of a warm recording forward above the bare
forward's (``torch.cuda.max_memory_allocated``). Each child also reports a checksum of the last
layer's recorded output and of the edited logits: the parent says whether every approach at a
depth agrees with the hooks. nnsight is not a dependency: where it is not installed, its rows
say so. ``--in-process`` runs the children in this process (for the smoke test only: first
calls are then not first). Writes ``scale.json`` and ``scale.md`` to
``benchmarks/results/<device>/`` (or ``--out``).

``--rounds N`` runs every configuration N times, round by round (each round every depth and
approach), and adds a table of the medians over the rounds. ``--trees before=/tmp/old,after=.``
compares checkouts in one run: each configuration runs in each tree (its child started there,
that tree first on ``PYTHONPATH``), the trees alternating; rows are labelled
``approach@tree``. A last table sets each fxprobe row against the targets of
depth-independent capture (:data:`TARGETS`, :data:`NEW_SHAPE`, :data:`FIRST_EDIT`): the first
forward as a multiple of the shallowest depth's in the same run, a new length and batch as
multiples of the warm forward, the first edit in seconds.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .dynamo import environment
from .timing import gc_paused

_ROOT = Path(__file__).resolve().parent
APPROACHES = ("fxprobe", "hooks", "nnsight")
SHARED = "fxprobe-shared"
"""fxprobe with ``FXPROBE_DYNAMO_REGIONS=shared`` (``frontends/dynamo_blocks.py``): the blocks
captured once for every instance, each called as one op of the graph around them (the default
now; named to compare with a checkout where it was not)."""
MARKED = "fxprobe-marked"
"""fxprobe with ``FXPROBE_DYNAMO_REGIONS=marked`` (``frontends/dynamo_inline.py``): the blocks
marked, traced once where no cache is carried and inlined into one graph of the whole model."""
MODES = {SHARED: "shared", MARKED: "marked"}
REFERENCES = ("compile", "regional")
FXPROBE = ("fxprobe", *MODES)
"""torch alone, hooks recording as ``hooks`` does: ``torch.compile`` of the whole model, and of
each decoder layer on its own (regional compilation), both with a backend that runs dynamo's
graph as it is. What capturing costs without fxprobe: the floor of a whole-model capture, and
of one that captures a layer once for every instance. Named with ``--approaches``."""
SIZES: dict[str, dict[str, Any]] = {
    "tiny": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=256),
    "1b": dict(hidden_size=2048, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=8192, vocab_size=32000),
}


def llama(layers: int, size: str, device: str, cache: bool = True) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(num_hidden_layers=layers, max_position_embeddings=512,
                         bos_token_id=0, eos_token_id=0, pad_token_id=0, use_cache=cache,
                         **SIZES[size])
    torch.manual_seed(0)
    dtype = torch.bfloat16 if size != "tiny" else torch.float32
    return LlamaForCausalLM(config).to(device=device, dtype=dtype).eval()


class _Clock:
    def __init__(self, device: str) -> None:
        self.cuda = device == "cuda"

    def __call__(self, fn: Callable[[], Any]) -> float:
        """Seconds ``fn`` takes, its device work included."""
        if self.cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t0


def _fxprobe(model: nn.Module, layers: int, tracer: str) -> dict[str, Callable[..., Any]]:
    import fxprobe

    state: dict[str, Any] = {}
    name = "blocks.{}.resid_post"

    def setup() -> None:
        state["t"] = fxprobe.tap(model, ops="blocks.*.resid_post", tracer=tracer)

    def run(ids: torch.Tensor) -> Any:
        return state["t"](ids)

    def edit(ids: torch.Tensor) -> Any:
        with state["t"].intervene({name.format(0): lambda s, v: v * 2}):
            return state["t"](ids)

    def last() -> torch.Tensor:
        return state["t"].taps[name.format(layers - 1)]

    return dict(setup=setup, run=run, edit=edit, last=last)


def _hooks(model: nn.Module, layers: int) -> dict[str, Callable[..., Any]]:
    kept: dict[int, torch.Tensor] = {}
    blocks = model.model.layers

    def keep(i: int) -> Callable[..., None]:
        def hook(m: nn.Module, args: Any, out: Any) -> None:
            kept[i] = (out[0] if isinstance(out, tuple) else out).detach()
        return hook

    def setup() -> None:
        for i, b in enumerate(blocks):
            b.register_forward_hook(keep(i))

    def edit(ids: torch.Tensor) -> Any:
        def double(m: nn.Module, args: Any, out: Any) -> Any:
            return (out[0] * 2, *out[1:]) if isinstance(out, tuple) else out * 2
        h = blocks[0].register_forward_hook(double, prepend=True)
        try:
            return model(ids)
        finally:
            h.remove()

    return dict(setup=setup, run=lambda ids: model(ids), edit=edit,
                last=lambda: kept[layers - 1])


def _compiled(model: nn.Module, layers: int, regional: bool) -> dict[str, Callable[..., Any]]:
    """``_hooks`` on a model torch compiles whole, or layer by layer (``REFERENCES``)."""
    ops = _hooks(model, layers)
    record = ops["setup"]
    compiled: list[Any] = [model]

    def graph_as_is(gm: Any, example_inputs: Any) -> Any:
        return gm.forward

    def setup() -> None:
        record()
        if regional:
            for block in model.model.layers:
                block.compile(backend=graph_as_is)
        else:
            compiled[0] = torch.compile(model, backend=graph_as_is)

    return dict(ops, setup=setup, run=lambda ids: compiled[0](ids))


def _nnsight(model: nn.Module, layers: int) -> dict[str, Callable[..., Any]]:
    from nnsight import NNsight

    state: dict[str, Any] = {}

    def setup() -> None:
        state["m"] = NNsight(model)

    def run(ids: torch.Tensor) -> Any:
        m = state["m"]
        saved: list[Any] = []
        with m.trace(ids):
            for i in range(layers):
                saved.append(m.model.layers[i].output.save())
        state["saved"] = saved

    def edit(ids: torch.Tensor) -> Any:
        m = state["m"]
        with m.trace(ids):
            m.model.layers[0].output[:] = m.model.layers[0].output * 2
            out = m.output.save()
        return out

    def last() -> torch.Tensor:
        v = state["saved"][-1]
        return v[0] if isinstance(v, tuple) else v

    return dict(setup=setup, run=run, edit=edit, last=last)


def measure(approach: str, layers: int, *, seq: int, repeats: int, tracer: str, device: str,
            size: str, new_shapes: bool = True, iters: int = 5,
            cache: bool = True) -> dict[str, Any]:
    """One (approach, depth): the costs the module docstring lists."""
    model = llama(layers, size, device, cache)
    vocab = SIZES[size]["vocab_size"]
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, vocab, (1, seq), generator=gen).to(device)
    longer = torch.randint(1, vocab, (1, seq + 7), generator=gen).to(device)
    batch = torch.randint(1, vocab, (2, seq), generator=gen).to(device)
    clock = _Clock(device)
    bare = _hooks(llama(layers, size, device, cache), layers)["run"]  # an untapped twin
    with torch.no_grad():
        bare_first = clock(lambda: bare(ids))
        if approach in MODES:
            os.environ["FXPROBE_DYNAMO_REGIONS"] = MODES[approach]
        ops = {"fxprobe": lambda: _fxprobe(model, layers, tracer),
               SHARED: lambda: _fxprobe(model, layers, tracer),
               MARKED: lambda: _fxprobe(model, layers, tracer),
               "hooks": lambda: _hooks(model, layers),
               "nnsight": lambda: _nnsight(model, layers),
               "compile": lambda: _compiled(model, layers, regional=False),
               "regional": lambda: _compiled(model, layers, regional=True)}[approach]()
        row: dict[str, Any] = {"approach": approach, "layers": layers, "status": "ok",
                               "bare_first_s": bare_first}
        row["first_s"] = clock(lambda: (ops["setup"](), ops["run"](ids)))
        last = ops["last"]().double().sum().item()
        if new_shapes:
            for key, shaped in (("new_length", longer), ("new_batch", batch)):
                row[f"{key}_s"] = clock(lambda: ops["run"](shaped))  # noqa: B023
                # the same shape warm: what a call of that shape costs once captured
                row[f"{key}_warm_ms"] = 1e3 * statistics.median(
                    clock(lambda: ops["run"](shaped)) for _ in range(max(iters, 3)))  # noqa: B023
        out: dict[str, Any] = {}
        row["first_edit_s"] = clock(lambda: out.setdefault("o", ops["edit"](ids)))
        logits = out["o"].logits if hasattr(out["o"], "logits") else out["o"]
        bares, treated, ratios = [], [], []
        for _ in range(repeats):
            with gc_paused():
                b = clock(lambda: [bare(ids) for _ in range(iters)]) / iters
                t = clock(lambda: [ops["run"](ids) for _ in range(iters)]) / iters
            bares.append(b)
            treated.append(t)
            ratios.append(t / b)
        row.update(bare_ms=1e3 * statistics.median(bares),
                   warm_ms=1e3 * statistics.median(treated),
                   warm_ratio=statistics.median(ratios),
                   checksum_last=last, checksum_edit=logits.double().sum().item())
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            bare(ids)
            bare_peak = torch.cuda.max_memory_allocated() - base
            torch.cuda.reset_peak_memory_stats()
            ops["run"](ids)
            row["peak_added_mib"] = (torch.cuda.max_memory_allocated() - base - bare_peak) / 2**20
    return row


def _child(config: dict[str, Any], tree: Path | None = None) -> dict[str, Any]:
    """Run one configuration in a fresh interpreter (in ``tree``, a checkout: its fxprobe and
    its benchmarks); its row, or a failed one."""
    config = dict(config)
    timeout = config.pop("timeout", 3600)
    cmd = [sys.executable, "-m", "benchmarks.scale", "--child", json.dumps(config)]
    env = None
    if tree is not None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(tree), *filter(None, [os.environ.get("PYTHONPATH")])])}
    try:
        done = subprocess.run(cmd, capture_output=True, text=True,
                              cwd=_ROOT.parent if tree is None else tree, env=env,
                              timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return {"status": "timed out"}
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {"status": f"failed: {tail[:300]}"}
    return dict(json.loads(lines[-1]))


def run_all(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every (approach, depth), ``--rounds`` times: round by round (each round every depth and
    approach, the trees alternating), so that a machine's slow spell falls on all of them."""
    rows = []
    have_nnsight = importlib.util.find_spec("nnsight") is not None
    trees: list[tuple[str | None, Path | None]] = list(args.trees) or [(None, None)]
    rounds = 1 if args.in_process else args.rounds
    for round_ in range(rounds):
        for layers in args.layers:
            for approach in args.approaches:
                base = {"approach": approach, "layers": layers}
                if approach == "nnsight" and not have_nnsight:
                    if not round_:
                        rows.append({**base, "status": "nnsight not installed"})
                    continue
                config = dict(approach=approach, layers=layers, seq=args.seq,
                              repeats=args.repeats, tracer=args.tracer, device=args.device,
                              size=args.size, new_shapes=not args.no_new_shapes,
                              iters=args.iters, cache=not args.no_cache)
                for name, tree in trees:
                    if args.in_process:
                        try:
                            row = measure(**config)
                        except Exception as e:  # a failed configuration is a row, not the end
                            row = {"status": f"failed: {type(e).__name__}: {e}"[:300]}
                    else:
                        row = _child({**config, "timeout": args.timeout}, tree)
                    rows.append({**base, **row, "round": round_} if name is None else {
                        **base, **row, "approach": f"{approach}@{name}", "round": round_})
                    if not args.quiet:
                        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    _agree(rows)
    return rows


def _agree(rows: list[dict[str, Any]]) -> None:
    """Per depth, whether each approach's checksums equal the hooks' (relative 1e-4; with
    ``--trees``, the first hooks row of the depth)."""
    ref: dict[int, dict[str, Any]] = {}
    for r in rows:
        if r["approach"].split("@")[0] == "hooks" and r["status"] == "ok":
            ref.setdefault(r["layers"], r)
    for r in rows:
        h = ref.get(r["layers"])
        if r["status"] != "ok" or h is None:
            continue
        r["agrees_with_hooks"] = all(
            abs(r[k] - h[k]) <= 1e-4 * max(1.0, abs(h[k])) for k in ("checksum_last",
                                                                     "checksum_edit"))


def markdown(env: dict[str, Any], args: argparse.Namespace, rows: list[dict[str, Any]]) -> str:
    lines = [f"# Scale: first-call and warm costs against depth ({args.device}, {args.size})", "",
             f"Llama layout ({SIZES[args.size]}), batch 1, {args.seq} tokens (new length: "
             f"{args.seq + 7}; new batch: 2), fxprobe tracer={args.tracer!r}, "
             f"ops='blocks.*.resid_post'. {env['run']}, torch {env['torch']}, transformers "
             f"{env['transformers']}, commit {env['commit']}, {env['torch_threads']} torch "
             f"thread(s). "
             + ("All rows in one process (a smoke run: first calls are not first)"
                if args.in_process else "Each row a fresh process")
             + f"; warm: medians of {args.repeats} interleaved rounds of {args.iters} forwards; "
             "wall-clock on a "
             "machine that may be running other work.", "",
             "| approach | layers | first (s) | new length (s) | new batch (s) | first edit (s) "
             "| bare (ms) | warm (ms) | warm / bare | agrees |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['approach']} | {r['layers']} | {r['status']} |||||||| ")
            continue
        lines.append(
            f"| {r['approach']} | {r['layers']} | {r['first_s']:.2f} | {_s(r, 'new_length_s')} "
            f"| {_s(r, 'new_batch_s')} | {r['first_edit_s']:.2f} | {r['bare_ms']:.1f} "
            f"| {r['warm_ms']:.1f} | {r['warm_ratio']:.2f} | "
            f"{_yes(r.get('agrees_with_hooks'))} |")
    if args.rounds > 1 and not args.in_process:
        lines += ["", f"Medians over {args.rounds} rounds"
                  + (" (the trees alternating): " + ", ".join(
                      f"{name} = {tree}" for name, tree in args.trees) if args.trees else "")
                  + ".", "",
                  "| approach | layers | first (s) | new length (s) | new batch (s) "
                  "| first edit (s) | bare (ms) | warm (ms) | warm / bare |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for (label, layers), group in _groups(rows).items():
            med = _medians(group)
            lines.append(f"| {label} | {layers} | {_s(med, 'first_s')} "
                         f"| {_s(med, 'new_length_s')} | {_s(med, 'new_batch_s')} "
                         f"| {_s(med, 'first_edit_s')} | {med['bare_ms']:.1f} "
                         f"| {med['warm_ms']:.1f} | {med['warm_ratio']:.2f} |")
    lines += targets(rows)
    return "\n".join(lines) + "\n"


def _medians(group: list[dict[str, Any]]) -> dict[str, float]:
    return {k: statistics.median(r[k] for r in group) for k in (
        "first_s", "new_length_s", "new_batch_s", "new_length_warm_ms", "new_batch_warm_ms",
        "first_edit_s", "bare_ms", "warm_ms", "warm_ratio") if all(k in r for r in group)}


TARGETS = {32: 1.5, 80: 2.0}
"""The first tapped forward at a depth, at most this multiple of the shallowest one's."""
NEW_SHAPE = 1.2  # a new length or batch: at most this multiple of a warm tapped forward
FIRST_EDIT = (32, 0.2)  # the first edit block at this depth: at most these seconds


def targets(rows: list[dict[str, Any]]) -> list[str]:
    """Each fxprobe approach against the targets of depth-independent capture (medians over
    the rounds, every ratio between rows of this run): the first forward as a multiple of
    the first forward at the shallowest depth measured, the first call at a new length and
    batch as multiples of a warm call at that length and batch, the first edit in seconds."""
    groups = _groups(rows)
    out: list[str] = []
    for label in dict.fromkeys(a for a, _ in groups if a.split("@")[0] in FXPROBE):
        depths = sorted(d for a, d in groups if a == label)
        if len(depths) < 2:
            continue
        meds = {d: _medians(groups[label, d]) for d in depths}
        low = depths[0]
        if not out:
            out += ["", "Against the targets (medians over the rounds; a depth's first forward "
                    f"as a multiple of the {low}-layer one; a new shape as a multiple of the "
                    "warm call at that shape): first forward "
                    + ", ".join(f"at {d} layers <= {t}x" for d, t in TARGETS.items())
                    + f"; a new length or batch <= {NEW_SHAPE}x; the first edit at "
                    f"{FIRST_EDIT[0]} layers <= {FIRST_EDIT[1]} s.", "",
                    "| approach | layers | first / shallowest | new length / warm "
                    "| new batch / warm | first edit (s) | met |", "|---|---|---|---|---|---|---|"]
        for d in depths:
            m = meds[d]
            first = m["first_s"] / meds[low]["first_s"]
            shapes = {k: m[f"{k}_s"] * 1e3 / m[f"{k}_warm_ms"]
                      for k in ("new_length", "new_batch") if f"{k}_warm_ms" in m}
            met = (first <= TARGETS.get(d, float("inf"))
                   and all(v <= NEW_SHAPE for v in shapes.values())
                   and (d != FIRST_EDIT[0] or m["first_edit_s"] <= FIRST_EDIT[1]))
            out.append(f"| {label} | {d} | {first:.2f} | "
                       + " | ".join(f"{shapes[k]:.2f}" if k in shapes else "-"
                                    for k in ("new_length", "new_batch"))
                       + f" | {m['first_edit_s']:.3f} | {_yes(met)} |")
    return out


def _groups(rows: list[dict[str, Any]]) -> dict[tuple[str, int], list[dict[str, Any]]]:
    out: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in rows:
        if r["status"] == "ok":
            out.setdefault((r["approach"], r["layers"]), []).append(r)
    return out


def _s(row: dict[str, Any], key: str) -> str:
    return f"{row[key]:.2f}" if key in row else "-"


def _yes(flag: bool | None) -> str:
    return "-" if flag is None else "yes" if flag else "no"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.scale",
                                description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=lambda s: [int(x) for x in s.split(",")],
                   default=[2, 8, 32, 80])
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--approaches", type=lambda s: s.split(","), default=list(APPROACHES))
    p.add_argument("--tracer", default="dynamo", choices=("dynamo", "auto", "fx+dynamo"),
                   help="fxprobe's tracer (canonical names need dynamo)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--size", default=None, choices=tuple(SIZES),
                   help="tiny (default on cpu) or 1b (default on cuda)")
    p.add_argument("--iters", type=int, default=5, help="forwards per timed slot (warm)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--timeout", type=float, default=3600, help="seconds per configuration")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--in-process", action="store_true",
                   help="no subprocess per configuration (smoke tests: first calls not first)")
    p.add_argument("--no-new-shapes", action="store_true",
                   help="skip the new length and batch (smoke tests)")
    p.add_argument("--no-cache", action="store_true",
                   help="config.use_cache=False: every forward runs without a KV cache")
    p.add_argument("--trees", type=_trees, default=[],
                   help="name=path,...: run each configuration in each checkout, alternating")
    p.add_argument("--rounds", type=int, default=1,
                   help="runs of every configuration (in each tree), round by round")
    p.add_argument("--name", default="scale", help="the record's file name (name.json/.md)")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    return p


def _trees(text: str) -> list[tuple[str, Path]]:
    out = []
    for part in text.split(","):
        name, _, path = part.partition("=")
        if not path:
            raise argparse.ArgumentTypeError(f"--trees: {part!r} is not name=path")
        out.append((name, Path(path).resolve()))
    return out


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.child is not None:
        print(json.dumps(measure(**json.loads(args.child))), flush=True)
        return 0
    unknown = sorted(set(args.approaches) - {*APPROACHES, *MODES, *REFERENCES})
    if unknown:
        raise SystemExit(f"unknown approach(es) {unknown}: choose from "
                         f"{[*APPROACHES, *MODES, *REFERENCES]}")
    args.size = args.size or ("tiny" if args.device == "cpu" else "1b")
    env = {**environment(), "device": args.device}
    rows = run_all(args)
    out = args.out or _ROOT / "results" / (args.device if args.size == "tiny"
                                           else f"{args.device}-{args.size}")
    out.mkdir(parents=True, exist_ok=True)
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
              if k not in ("child", "quiet")}
    config["trees"] = [[name, str(tree)] for name, tree in args.trees]
    (out / f"{args.name}.json").write_text(json.dumps(
        {"environment": env, "config": config, "rows": rows}, indent=1) + "\n")
    text = markdown(env, args, rows)
    (out / f"{args.name}.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
