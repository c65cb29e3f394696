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
from .arguments import example_of, load_model, parse_kw, parse_ops


def cmd_sites(args: argparse.Namespace) -> int:
    from ..api import sites
    from ..present.summary import sites_table

    model, _ = load_model(args.model, parse_kw(args.kw))
    example = example_of(args.input, args.tokens)
    selectors = parse_ops(args.ops)
    artifact = args.model.endswith((".pt", ".pt2"))
    if artifact and example is not None:
        raise UsageError(f"{args.model} is read from its graph, which names every site; "
                         "leave out --input and --tokens")
    with _factory_hint(args), quiet_tracing():
        listing = sites(model, train=args.train, tracer=args.tracer, example_input=example)
    records: list[Site] = list(listing.records)
    if selectors is not None:
        mode = "train" if args.train else "eval"
        records = select(records + list(listing.modules) + list(listing.inner), selectors,
                         context=f"{type(model).__name__} ({mode} mode)",
                         fallbacks=listing.fallbacks)
    print(sites_table(records, listing.fallbacks, args.format))
    if example is None and listing.fallbacks and args.tracer in ("auto", "fx+dynamo") \
            and not artifact:
        which = "these modules" if len(listing.fallbacks) > 1 else "this module"
        print(f"\nfxprobe.tap captures {which} with torch dynamo at the first forward: "
              "pass an example input (--tokens 1x16 "
              "for a transformer, --input 1x3x224x224) to list the sites it finds, with their "
              "canonical names")
    return 0


@contextlib.contextmanager
def quiet_tracing() -> Iterator[None]:
    """No warnings of torch.fx, torch dynamo or transformers on the terminal while
    fxprobe traces and runs a model to list or draw its sites: what could not be traced is
    reported in the table (modules that run as written), not as tracebacks."""
    import logging
    import warnings

    loggers = [logging.getLogger(n) for n in ("torch._dynamo", "torch.fx", "transformers")]
    levels = [lg.level for lg in loggers]
    try:
        for lg in loggers:
            lg.setLevel(logging.ERROR)
        with warnings.catch_warnings():
            # torch's and the model library's; fxprobe's own (a forward it cannot reach) stay
            warnings.filterwarnings("ignore", module=r"(torch|transformers)(\.|$)")
            yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


def cmd_graph(args: argparse.Namespace) -> int:
    from ..present import viz
    from ..runtime.views import render, view_for_input

    model, name = load_model(args.model, parse_kw(args.kw))
    inputs = example_of(args.input, args.tokens)
    selectors = parse_ops(args.ops)
    out = Path(args.output or f"{name.rpartition('.')[2]}.svg")
    if not out.parent.is_dir():
        raise UsageError(f"-o {str(out)!r}: the folder {str(out.parent)!r} does not exist; "
                         "create it first or name a file in an existing folder")
    drawing = dict(depth=args.depth, rankdir=args.rankdir, show_plumbing=args.show_plumbing,
                   focus=args.focus, fold=args.fold)
    with _factory_hint(args), quiet_tracing():
        if inputs is None:
            render(model, out, ops=selectors, tracer=args.tracer, train=args.train, **drawing)
        else:  # captured as fxprobe.tap would: dynamo's graphs drawn op by op
            viz.check_drawing(args.depth, args.rankdir, args.fold)
            viz.check_path(out)
            view = view_for_input(model, inputs, ops=selectors, tracer=args.tracer,
                                  train=args.train)
            viz.render(view, out, example_input=inputs, **drawing)
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
