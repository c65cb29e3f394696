"""The ``fxprobe`` command: list a model's sites, draw its graph, run the demo or benchmarks.

Every mistake in what the user typed (a bad ``MODEL`` spec, a missing file or factory, a
factory that does not return a module, a bad ``--input`` or ``--ops``) is reported as one line
on stderr with exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import importlib.util
import math
import os
import re
import sys
import textwrap
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .core.errors import FxProbeError, UsageError
from .core.select import Selector, as_selector, select, where
from .core.site import Site

EXIT_USAGE = 2
EXIT_FAILED = 1

_DTYPES = {
    "float32": torch.float32, "float": torch.float32, "float16": torch.float16,
    "half": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64,
    "double": torch.float64, "int64": torch.int64, "long": torch.int64, "int32": torch.int32,
    "int": torch.int32, "int16": torch.int16, "int8": torch.int8, "uint8": torch.uint8,
    "bool": torch.bool,
}
_ALIASES = {"nn": "torch.nn", "F": "torch.nn.functional"}
_KINDS = ("module", "function", "fn", "op", "method", "re", "how", "name")

_SELECTOR_HELP = """\
selectors (--ops, repeatable or comma-separated; a site is selected if any matches):
  layer1.*.conv?       a glob on site names (as printed by `fxprobe sites`)
  module:Conv2d        calls of modules of a type or its subclasses: nn.Conv2d, a class
                       name of your own, or a dotted path mypkg.blocks.Block (a module fx
                       traces through has no call site of its own, only its ops)
  function:torch.add   a function, every spelling: also x + y and x.add(y) (alias fn:)
  op:add               the same, by canonical op name (add, relu, flatten, matmul, ...)
  method:view          tensor method calls x.view(...)
  re:attn\\.(q|k)       a regular expression searched in site names
  how:hook             sites reached by a module hook only (how:fx for op-level sites)
  name:GLOB            a glob, spelled out (for names that look like a selector kind)
"""

_MODEL_HELP = """\
MODEL is package.module:factory or path/to/file.py:factory: a callable that takes no
arguments and returns the nn.Module (a class works, and so does a module-level model
instance). Modules are imported with the current directory on sys.path.
"""


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``fxprobe`` command with ``argv`` (default: ``sys.argv[1:]``); return the exit
    status."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list and args_list[0] == "bench":
        return _run(lambda: bench(args_list[1:]), "bench")
    parser = build_parser()
    args = parser.parse_args(args_list)
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    handler: Callable[[argparse.Namespace], int] = args.handler
    return _run(lambda: handler(args), args.command)


def _run(fn: Callable[[], int], command: str) -> int:
    from .core.errors import RenderError

    try:
        return fn()
    except RenderError as e:
        print(f"fxprobe {command}: error: {e}", file=sys.stderr)
        return EXIT_FAILED
    except FxProbeError as e:
        print(f"fxprobe {command}: error: {e}", file=sys.stderr)
        return EXIT_USAGE


# -- parser -----------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``fxprobe`` command and its subcommands."""
    from . import __name__ as package

    parser = argparse.ArgumentParser(
        prog="fxprobe",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=_para("Tap PyTorch models at op level: list their sites, draw the instrumented "
                    "graph, or run the demo."),
        epilog="examples:\n"
               "  fxprobe demo\n"
               "  fxprobe sites fxprobe.examples:small_cnn --ops module:Conv2d\n"
               "  fxprobe graph fxprobe.examples:small_cnn --input 1x3x32x32 -o cnn.svg\n"
               "  fxprobe graph mymodels.py:resnet50 --depth 2 --input 1x3x224x224\n\n"
               "`fxprobe COMMAND --help` describes each command; `python -m fxprobe` is "
               "`fxprobe demo`.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version(package)}")
    parser.set_defaults(command=None)
    sub = parser.add_subparsers(title="commands", metavar="COMMAND")

    p = sub.add_parser(
        "sites", help="list the sites of a model (what fxprobe can tap)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=_para("List every site of MODEL in execution order: its name (what ops= and "
                    "tapped.taps use), its op, the module path, and how fxprobe reaches it "
                    "(fx: at op level in a traced graph; hook: by a module hook, inside code "
                    "torch.fx could not trace). Modules that run as written are listed under "
                    "the table with the reason."),
        epilog=_MODEL_HELP + "\n" + _SELECTOR_HELP + "\nexample:\n"
               "  fxprobe sites fxprobe.examples:small_cnn --ops module:Conv2d,op:add",
    )
    _model_args(p, "list")
    p.add_argument("--format", choices=("text", "github", "html"), default="text",
                   help="table format: terminal text (default), GitHub Markdown, or HTML")
    p.set_defaults(command="sites", handler=cmd_sites)

    p = sub.add_parser(
        "graph", help="draw the instrumented graph to .svg/.png/.pdf/.dot",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=_para("Draw MODEL's sites as a graph: nodes are sites (name, op, dtype and "
                    "shape when --input is given), edges are data flow, clusters are modules. "
                    "Sites matched by --ops are filled orange; sites reached by a module hook "
                    "are dashed; modules that run as written (torch.fx could not trace them) "
                    "have a red dashed border and give the reason in their tooltip (SVG)."),
        epilog=_MODEL_HELP + "\n" + _SELECTOR_HELP + "\nexamples:\n"
               "  fxprobe graph fxprobe.examples:small_cnn --input 1x3x32x32 "
               "--ops module:Conv2d\n"
               "  fxprobe graph mymodels.py:bert --input 1x128:int64 --depth 3 -o bert.svg",
    )
    _model_args(p, "mark as tapped (filled orange)")
    p.add_argument("-o", "--output", metavar="FILE",
                   help="where to write; the suffix picks the format: .svg (default, named "
                        "after the factory), .png, .pdf (these need the Graphviz 'dot' "
                        "program) or .dot (DOT text, no Graphviz program needed)")
    p.add_argument("--depth", type=_depth, metavar="N",
                   help="draw every module nested deeper than N levels as one node "
                        "(0: only the model's direct children); default: draw everything")
    p.add_argument("--input", action="append", default=[], metavar="SPEC",
                   help="an example input, to show dtype and shape at every site: sizes "
                        "joined by 'x', optionally ':dtype' (1x3x224x224, 2x128:int64); "
                        "repeat the option or separate with commas for several positional "
                        "inputs. Floats are random normal, integers and bools zero.")
    p.add_argument("--rankdir", choices=("TB", "LR"), default="TB",
                   help="layout direction: top to bottom (default) or left to right")
    p.add_argument("--show-plumbing", action="store_true",
                   help="draw shape ops (size, shape, getitem on sizes), attributes and "
                        "submodule inputs with defaults as nodes; by default they are folded "
                        "into the ops they feed")
    p.set_defaults(command="graph", handler=cmd_graph)

    p = sub.add_parser(
        "demo", help="tap a built-in model, print what was captured, draw its graph",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=_para("Tap a small built-in CNN (residual add, in-place ReLU, torch.flatten, "
                    "and a classifier head that torch.fx cannot trace, reached by hooks), run "
                    "it on a seeded input, print the summary of what was captured, and draw "
                    "the graph. Needs no arguments."),
    )
    p.add_argument("-o", "--output", default="fxprobe-demo.svg", metavar="FILE",
                   help="where to draw the graph (default: fxprobe-demo.svg); the suffix picks "
                        "the format (.svg, .png, .pdf, .dot)")
    p.add_argument("--format", choices=("text", "github", "html"), default="text",
                   help="summary table format (default: text)")
    p.set_defaults(command="demo", handler=cmd_demo)

    sub.add_parser(
        "bench", add_help=False,
        help="run the benchmarks of a source checkout (arguments go to `python -m "
             "benchmarks`; `fxprobe bench --help` lists them)",
    )
    return parser


def _para(text: str) -> str:
    return textwrap.fill(text, 88)


def _model_args(p: argparse.ArgumentParser, verb: str) -> None:
    p.add_argument("model", metavar="MODEL",
                   help="package.module:factory, path/to/file.py:factory, or a saved "
                        "model.pt (TorchScript) or model.pt2 (torch.export)")
    p.add_argument("--ops", action="append", default=[], metavar="SELECTOR",
                   help=f"{verb} only the sites a selector matches; repeatable, or "
                        "comma-separated (see selectors below)")
    p.add_argument("--tracer", choices=("auto", "fx", "hooks"), default="auto",
                   help="auto (default): fx where it can, hooks elsewhere; fx: fail if "
                        "anything cannot be traced; hooks: module hooks only")
    p.add_argument("--train", action="store_true",
                   help="use the model's train-mode graph (default: eval mode)")


def _depth(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a depth; pass an integer >= 0")
    return value


def _version(package: str) -> str:
    try:
        from importlib.metadata import version

        return version(package)
    except Exception:  # not installed: a source tree on sys.path
        return "(source)"


# -- commands ---------------------------------------------------------------------------------

def cmd_sites(args: argparse.Namespace) -> int:
    from .api import sites
    from .present.summary import sites_table

    model, _ = load_model(args.model)
    selectors = parse_ops(args.ops)
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
    from .runtime.views import render

    model, name = load_model(args.model)
    inputs = parse_inputs(args.input)
    selectors = parse_ops(args.ops)
    out = Path(args.output or f"{name.rpartition('.')[2]}.svg")
    if not out.parent.is_dir():
        raise UsageError(f"-o {str(out)!r}: the folder {str(out.parent)!r} does not exist; "
                         "create it first or name a file in an existing folder")
    render(model, out, example_input=inputs or None, ops=selectors, depth=args.depth,
           tracer=args.tracer, train=args.train, rankdir=args.rankdir,
           show_plumbing=args.show_plumbing)
    print(f"wrote {out}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from .api import tap
    from .core.errors import RenderError
    from .examples import small_cnn, small_cnn_input
    from .runtime.views import render, summary

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
    checkout = checkout or Path(__file__).resolve().parent.parent
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


# -- MODEL, --input and --ops -----------------------------------------------------------------

def load_model(spec: str) -> tuple[Any, str]:
    """Import ``package.module:factory`` or ``path/to/file.py:factory`` and build the model,
    or load a deployed artifact: ``model.pt`` (TorchScript) or ``model.pt2`` (torch.export).

    Returns:
        The model and the factory's (or file's) name.

    Raises:
        UsageError: a malformed spec, a missing file, module or factory, a factory that raises
        or does not return an ``nn.Module``, an artifact that does not load.
    """
    if spec.endswith((".pt", ".pt2")):
        return _load_artifact(spec), Path(spec).stem
    target, sep, attr = spec.rpartition(":")
    if not sep or not target or not re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", attr):
        raise UsageError(
            f"MODEL {spec!r} is not package.module:factory or path/to/file.py:factory "
            "(for example fxprobe.examples:small_cnn or models.py:make_model)"
        )
    if target.endswith(".py") or "/" in target or os.sep in target:
        module = _import_file(target, spec)
    else:
        module = _import_module(target, spec)
    obj: Any = module
    for i, part in enumerate(attr.split(".")):
        if not hasattr(obj, part):
            where_ = target if i == 0 else f"{target}:{'.'.join(attr.split('.')[:i])}"
            names = [n for n in dir(obj) if not n.startswith("_")]
            close = difflib.get_close_matches(part, names, n=3, cutoff=0.5)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise UsageError(f"{where_} has no {part!r} (MODEL {spec!r}){hint}")
        obj = getattr(obj, part)
    if isinstance(obj, nn.Module):
        return obj, attr
    if not callable(obj):
        raise UsageError(f"{spec} is a {type(obj).__name__}, not a factory; MODEL must name a "
                         "callable that returns the model")
    try:
        model = obj()
    except Exception as e:
        raise UsageError(f"calling {spec}() raised {_one_line(e)}; the factory must build "
                         "the model with no arguments") from e
    if not isinstance(model, nn.Module):
        raise UsageError(f"{spec}() returned {type(model).__name__}, not a torch.nn.Module; "
                         "the factory must return the model")
    return model, attr


def _load_artifact(spec: str) -> Any:
    from .frontends.script import quiet_jit

    if not os.path.isfile(spec):
        raise UsageError(f"no such file: {spec} (MODEL)")
    try:
        if spec.endswith(".pt2"):
            return torch.export.load(spec)
        with quiet_jit():
            return torch.jit.load(spec)
    except Exception as e:
        raise UsageError(f"cannot load {spec}: {_one_line(e)}; a .pt MODEL must be written by "
                         "torch.jit.save, a .pt2 MODEL by torch.export.save") from e


def _import_file(target: str, spec: str) -> Any:
    path = Path(target)
    if not path.is_file():
        raise UsageError(f"no such file: {target} (MODEL {spec!r})")
    name = "fxprobe_model_" + re.sub(r"\W", "_", path.stem)
    loader_spec = importlib.util.spec_from_file_location(name, path)
    if loader_spec is None or loader_spec.loader is None:
        raise UsageError(f"cannot import {target} as Python (MODEL {spec!r})")
    module = importlib.util.module_from_spec(loader_spec)
    folder = str(path.resolve().parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)  # so that the file can import its neighbours
    sys.modules[name] = module
    try:
        loader_spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[name]
        raise UsageError(f"importing {target} failed: {_one_line(e)}") from e
    return module


def _import_module(target: str, spec: str) -> Any:
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)  # as `python -m` does
    try:
        return importlib.import_module(target)
    except ModuleNotFoundError as e:
        if e.name and (target == e.name or target.startswith(e.name + ".")):
            raise UsageError(
                f"no module named {e.name!r} (MODEL {spec!r}); run from the directory that "
                "contains it, or give the file: path/to/file.py:factory"
            ) from e
        raise UsageError(f"importing {target} failed: {_one_line(e)}") from e
    except Exception as e:
        raise UsageError(f"importing {target} failed: {_one_line(e)}") from e


_MAX_INPUT_BYTES = 8 * 2**30


def parse_inputs(specs: Sequence[str]) -> tuple[torch.Tensor, ...]:
    """``["1x3x224x224", "2x8:int64"]`` -> seeded example tensors (comma-separated works too).

    Raises:
        UsageError: a size that is not a positive integer, or an unknown dtype.
    """
    gen = torch.Generator().manual_seed(0)
    tensors = []
    for text in (t.strip() for s in specs for t in s.split(",")):
        sizes_text, _, dtype_name = text.partition(":")
        dtype = _DTYPES.get(dtype_name or "float32")
        parts = sizes_text.lower().split("x")
        if dtype is None or not all(p.isdigit() and int(p) > 0 for p in parts):
            problem = (f"unknown dtype {dtype_name!r} (use {', '.join(_DTYPES)})"
                       if dtype is None else "sizes must be positive integers joined by 'x'")
            raise UsageError(f"--input {text!r}: {problem}; for example 1x3x224x224 or "
                             "2x128:int64")
        shape = [int(p) for p in parts]
        size = math.prod(shape) * dtype.itemsize
        if size > _MAX_INPUT_BYTES:
            raise UsageError(
                f"--input {text!r} would take {size / 2**30:,.1f} GiB; an example input only "
                "needs the model's real shape at batch 1 (e.g. 1x3x224x224)"
            )
        try:
            if dtype.is_floating_point:
                tensors.append(torch.randn(shape, generator=gen).to(dtype))
            else:
                tensors.append(torch.zeros(shape, dtype=dtype))
        except RuntimeError as e:  # out of memory for an input under the limit
            raise UsageError(f"--input {text!r}: cannot allocate it: {_one_line(e)}") from e
    return tuple(tensors)


def parse_ops(texts: Sequence[str]) -> list[Selector] | None:
    """``--ops`` values -> selectors (None when none was given). See ``fxprobe sites --help``.

    Raises:
        UsageError: an unknown selector kind, or a name that cannot be found.
    """
    if texts and not any(t.strip() for text in texts for t in text.split(",")):
        raise UsageError("--ops was given but is empty; leave --ops out to list every site, or "
                         "name what to select (e.g. --ops 'layer1.*' or --ops module:Conv2d)")
    parts = [t.strip() for text in texts for t in text.split(",") if t.strip()]
    return [parse_selector(t) for t in parts] if parts else None


def parse_selector(text: str) -> Selector:
    """One ``--ops`` value: a glob, or ``kind:value`` with the kinds of ``--help``."""
    kind, sep, value = text.partition(":")
    if not sep:
        return as_selector(text)
    if kind not in _KINDS or not value:
        raise UsageError(
            f"--ops {text!r}: unknown selector {kind + ':'!r}; use a glob on site names or "
            f"one of {', '.join(k + ':' for k in _KINDS)} followed by a name"
        )
    if kind == "name":
        return as_selector(value)
    if kind == "re":
        try:
            return as_selector(re.compile(value))
        except re.error as e:
            raise UsageError(f"--ops {text!r}: not a regular expression: {e}") from e
    if kind == "how":
        if value not in ("fx", "hook", "script", "export"):
            raise UsageError(f"--ops {text!r}: use how:fx, how:hook, how:script or how:export")
        return where(lambda s: s.how == value, text)
    if kind == "op":
        return where(lambda s: s.op_key == value, text)
    if kind == "method":
        return where(lambda s: s.kind == "call_method" and s.target == value, text)
    if kind == "module":
        cls = _resolve(value)
        if isinstance(cls, type) and issubclass(cls, nn.Module):
            sel = as_selector(cls)
            return Selector(sel, text)
        return where(lambda s: _type_named(s, value), text)
    fn = _resolve(value)
    if fn is None or not callable(fn) or isinstance(fn, type):
        raise UsageError(
            f"--ops {text!r}: cannot find a function {value!r}; spell it out as it is "
            "imported (torch.flatten, torch.nn.functional.relu, operator.add), or use "
            f"op:{value.rpartition('.')[2]} to match it by op name"
        )
    return Selector(as_selector(fn), text)


def _resolve(name: str) -> Any:
    """``torch.flatten``, ``nn.Conv2d``, ``F.relu``, ``Conv2d`` (in torch.nn), or None."""
    head, _, rest = name.partition(".")
    head = _ALIASES.get(head, head)
    full = f"{head}.{rest}" if rest else head
    if "." not in full:
        return getattr(torch.nn, full, None) or getattr(torch, full, None)
    module_name, _, attr = full.rpartition(".")
    while module_name:
        try:
            obj: Any = importlib.import_module(module_name)
        except Exception:
            module_name, _, more = module_name.rpartition(".")
            attr = f"{more}.{attr}"
            continue
        for part in attr.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                return None
        return obj
    return None


def _type_named(site: Site, name: str) -> bool:
    mtype = site.module_type
    if site.kind == "call_module" and mtype is None and site.type_name:  # .pt/.pt2: no class
        return name in (site.type_name, site.type_name.rpartition(".")[2])
    if site.kind != "call_module" or mtype is None:
        return False
    return any(name in (c.__name__, c.__qualname__, f"{c.__module__}.{c.__qualname__}")
               for c in mtype.__mro__)


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__
