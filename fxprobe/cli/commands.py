"""The commands of ``fxprobe``: ``sites``, ``graph``, ``demo`` and ``bench``; each takes the
parsed arguments and returns the exit status."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from ..core.errors import ConfigError, TraceError, UsageError
from ..core.select import select
from ..core.site import Site
from .arguments import load_model, parse_inputs, parse_kw, parse_ops


def cmd_sites(args: argparse.Namespace) -> int:
    from ..api import sites
    from ..present.summary import sites_table

    model, _ = load_model(args.model, parse_kw(args.kw))
    selectors = parse_ops(args.ops)
    with _factory_hint(args):
        listing = sites(model, train=args.train, tracer=args.tracer)
    records: list[Site] = list(listing.records)
    if selectors is not None:
        mode = "train" if args.train else "eval"
        records = select(records + list(listing.modules) + list(listing.inner), selectors,
                         context=f"{type(model).__name__} ({mode} mode)",
                         fallbacks=listing.fallbacks)
    print(sites_table(records, listing.fallbacks, args.format))
    return 0


def cmd_graph(args: argparse.Namespace) -> int:
    from ..runtime.views import render

    model, name = load_model(args.model, parse_kw(args.kw))
    inputs = parse_inputs(args.input)
    selectors = parse_ops(args.ops)
    out = Path(args.output or f"{name.rpartition('.')[2]}.svg")
    if not out.parent.is_dir():
        raise UsageError(f"-o {str(out)!r}: the folder {str(out.parent)!r} does not exist; "
                         "create it first or name a file in an existing folder")
    with _factory_hint(args):
        render(model, out, example_input=inputs or None, ops=selectors, depth=args.depth,
               tracer=args.tracer, train=args.train, rankdir=args.rankdir,
               show_plumbing=args.show_plumbing, focus=args.focus)
    print(f"wrote {out}")
    return 0


@contextlib.contextmanager
def _factory_hint(args: argparse.Namespace) -> Iterator[None]:
    """A model built by a factory that fails to trace or to run the example input: say which
    model, in words of its input (fx's ``Proxy(getitem_2)`` means a size traced from it), and
    that the factory may take the size as a keyword (``--kw image_size=64``)."""
    try:
        yield
    except (TraceError, ConfigError) as e:
        text = str(e)
        if args.model.endswith((".pt", ".pt2")) or not (
                isinstance(e, TraceError) or text.startswith("the example input")):
            raise
        text = re.sub(r"Proxy\(\w+\)", "a size traced from the input", text)
        given = " ".join(f"--kw {k}" for k in args.kw)
        raise UsageError(
            f"MODEL {args.model}{' ' + given if given else ''}: {text}. If the factory builds "
            "the model for another input size, pass its keywords: --kw NAME=VALUE (for "
            "example --kw image_size=64)") from e


def cmd_demo(args: argparse.Namespace) -> int:
    from ..api import tap
    from ..core.errors import RenderError
    from ..examples import small_cnn, small_cnn_input
    from ..runtime.views import render, summary

    model, x = small_cnn(), small_cnn_input()
    print("fxprobe demo: a small CNN whose classifier head torch.fx cannot trace. It runs:\n\n"
          "    model, x = fxprobe.examples.small_cnn(), fxprobe.examples.small_cnn_input()\n"
          "    tapped = fxprobe.tap(model, ops=[nn.Conv2d, torch.add, torch.flatten, nn.Linear])"
          "\n    tapped(x)\n"
          f"    print(tapped.summary())\n"
          f"    tapped.render({args.output!r}, example_input=x)\n")
    tapped = tap(model, ops=[nn.Conv2d, torch.add, torch.flatten, nn.Linear])
    with torch.no_grad():
        tapped(x)
    print(summary(tapped, args.format))
    out = Path(args.output)
    try:
        render(tapped, out, example_input=x)
    except RenderError as e:
        out = out.with_suffix(".dot")
        render(tapped, out, example_input=x)
        print(f"\n{e}\nwrote {out} instead (DOT text; any Graphviz viewer opens it)")
        return 0
    print(f"\nwrote {out}: tapped sites are orange; the head, which torch.fx cannot "
          "trace, runs under torch dynamo (drawn op by op from dynamo's two graphs, one after "
          "the other at the graph break)")
    return 0


def bench(argv: list[str], checkout: Path | None = None) -> int:
    """``fxprobe bench ARGS``: ``benchmarks.__main__.main(ARGS)`` of a source checkout.

    ``checkout`` is the repository holding ``benchmarks/`` (default: the one this package was
    installed from, in editable mode).
    """
    checkout = checkout or Path(__file__).resolve().parents[2]
    if (checkout / "benchmarks" / "__main__.py").is_file() and str(checkout) not in sys.path:
        sys.path.insert(0, str(checkout))
    try:
        module = importlib.import_module("benchmarks.__main__")
    except ModuleNotFoundError as e:
        if e.name not in ("benchmarks", "benchmarks.__main__"):
            raise
        raise UsageError(
            "the benchmarks live in fxprobe's source repository, not in the installed package; "
            "run `fxprobe bench` from an editable install of a clone (pip install -e .)"
        ) from e
    run = getattr(module, "main", None)
    if not callable(run):
        raise UsageError(f"{module.__file__} has no main(argv) function to run")
    return int(run(argv) or 0)
