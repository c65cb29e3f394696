"""``python -m benchmarks``: run the overhead suite and write JSON, Markdown and a plot.

Examples::

    python -m benchmarks --quick                      # a smoke run, under a minute on 2 cores
    python -m benchmarks --out results/               # the full CPU run
    python -m benchmarks --device cuda --out gpu/     # on a GPU
    python -m benchmarks --models chain,mlp --modes reference,clone
    python -m benchmarks --from-json results/results.json --docs docs/benchmarks.md
    python -m benchmarks --from-json gpt2.json resnet50.json --out merged/   # one report

``results.json`` is rewritten after every group of measurements, so a run stopped from outside
(a time limit during ``torch.compile``) keeps what it measured; its ``skipped`` list then says
which steps are missing.
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys
from collections.abc import Mapping
from pathlib import Path

import torch

from . import report
from .models import MODELS
from .modes import MODES
from .records import Results, merge, read_json, write_json

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _names(kind: str, text: str, known: Mapping[str, object]) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    for n in names:
        if n not in known:
            close = difflib.get_close_matches(n, list(known), n=3)
            hint = f" Did you mean {', '.join(close)}?" if close else ""
            raise argparse.ArgumentTypeError(
                f"unknown {kind} {n!r}.{hint} Known: {', '.join(known)}")
    if not names:
        raise argparse.ArgumentTypeError(f"--{kind}s needs at least one name")
    return names


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="fxprobe overhead benchmarks: taps vs hooks vs the bare model.")
    p.add_argument("--quick", action="store_true",
                   help="small inputs, few rounds, no torch.compile: a smoke run (< 1 min)")
    p.add_argument("--out", type=Path, default=Path("bench-results"),
                   help="directory for results.json, results.md and the plot "
                        "(default: %(default)s)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="where to run (default: %(default)s)")
    p.add_argument("--models", default=",".join(MODELS),
                   help=f"comma-separated subset of {', '.join(MODELS)}")
    p.add_argument("--modes", default=",".join(MODES),
                   help=f"comma-separated subset of {', '.join(MODES)}")
    compile_group = p.add_mutually_exclusive_group()
    compile_group.add_argument("--compile", dest="compile", action="store_true", default=None,
                               help="measure torch.compile (default: on, off with --quick)")
    compile_group.add_argument("--no-compile", dest="compile", action="store_false")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (default: os.cpu_count())")
    p.add_argument("--dtype", default="float32", choices=tuple(_DTYPES))
    p.add_argument("--rounds", type=int, default=None,
                   help="interleaved rounds per group (default: from a time budget)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-plot", action="store_true", help="do not draw the plot")
    p.add_argument("--quiet", action="store_true", help="no progress line")
    p.add_argument("--from-json", type=Path, nargs="+", default=None, metavar="JSON",
                   help="do not run: render results.md / plot / docs from these results.json "
                        "files (several runs on one device are merged into one report)")
    p.add_argument("--docs", type=Path, default=None,
                   help="also fill in this device's generated block of a docs file "
                        "(docs/benchmarks.md); refused for --quick results")
    p.add_argument("--list", action="store_true", help="list models and modes, then exit")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the suite (or render saved results); returns a process exit code."""
    p = parser()
    try:
        args = p.parse_args(argv)
        models = _names("model", args.models, MODELS)
        modes = _names("mode", args.modes, MODES)
    except argparse.ArgumentTypeError as e:
        p.print_usage(sys.stderr)
        print(f"{p.prog}: error: {e}", file=sys.stderr)
        return 2
    except SystemExit as e:  # argparse's own errors and --help
        return int(e.code or 0)

    if args.list:
        for name, spec in MODELS.items():
            print(f"model {name:10s} {spec.description}")
        for name, mode in MODES.items():
            print(f"mode  {name:12s} {mode.description}")
        return 0

    if args.from_json is not None:
        try:
            results = merge([read_json(path) for path in args.from_json])
        except (OSError, ValueError) as e:
            print(f"{p.prog}: error: --from-json: {e}", file=sys.stderr)
            return 2
    else:
        if args.device == "cuda" and not torch.cuda.is_available():
            print(f"{p.prog}: error: --device cuda but torch.cuda.is_available() is False "
                  f"(torch {torch.__version__}); run on a machine with a GPU or use "
                  "--device cpu", file=sys.stderr)
            return 2
        if args.rounds is not None and args.rounds < 1:
            print(f"{p.prog}: error: --rounds must be at least 1", file=sys.stderr)
            return 2
        from .suite import Config, run

        config = Config(
            device=torch.device(args.device), quick=args.quick, models=models, modes=modes,
            dtype=_DTYPES[args.dtype], threads=args.threads or os.cpu_count() or 1,
            seed=args.seed, rounds=args.rounds,
            compile=(not args.quick) if args.compile is None else args.compile,
            progress=not args.quiet,
        )
        args.out.mkdir(parents=True, exist_ok=True)
        results = run(config, on_partial=lambda r: write_json(r, args.out / "results.json"))
    return _write(results, args)


def _write(results: Results, args: argparse.Namespace) -> int:
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    if args.from_json is None:
        write_json(results, out / "results.json")
    plot_name = None
    if not args.no_plot:
        why = report.plot(results, out / "overhead_vs_density.png")
        if why is None:
            plot_name = "overhead_vs_density.png"
        else:
            print(why, file=sys.stderr)
    (out / "results.md").write_text(report.markdown(results, plot=plot_name))
    written = [out / "results.md"] + ([out / "results.json"] if args.from_json is None else [])
    if plot_name:
        written.append(out / plot_name)
    if args.docs is not None:
        if results.environment.quick:
            print(f"not writing {args.docs}: these are --quick results (a smoke test); "
                  "run without --quick to publish numbers", file=sys.stderr)
            return 1
        try:
            report.update_docs(results, args.docs,
                               plot_path=_relative(out / plot_name, args.docs)
                               if plot_name else None)
        except (OSError, ValueError) as e:
            print(f"could not update {args.docs}: {e}", file=sys.stderr)
            return 1
        written.append(args.docs)
    if not args.quiet:
        print("wrote " + ", ".join(str(w) for w in written), file=sys.stderr)
    return 0


def _relative(target: Path, doc: Path) -> str:
    return os.path.relpath(target.resolve(), doc.resolve().parent)


if __name__ == "__main__":
    sys.exit(main())
