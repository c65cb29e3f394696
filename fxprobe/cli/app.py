"""The ``fxprobe`` command line: the parser of the command and its subcommands, and ``main``,
which runs one and turns fxprobe's errors into one line on stderr and an exit status."""

from __future__ import annotations

import argparse
import sys
import textwrap
from collections.abc import Callable, Sequence

from ..core.errors import FxProbeError
from .commands import bench, cmd_demo, cmd_graph, cmd_sites

EXIT_USAGE = 2
EXIT_FAILED = 1

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
  how:hook             sites reached by a module hook only (how:fx, how:dynamo: op level)
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
    from ..core.errors import RenderError

    try:
        return fn()
    except RenderError as e:
        print(f"fxprobe {command}: error: {e}", file=sys.stderr)
        return EXIT_FAILED
    except FxProbeError as e:
        print(f"fxprobe {command}: error: {e}", file=sys.stderr)
        return EXIT_USAGE


# -- parser ---------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``fxprobe`` command and its subcommands."""
    from .. import __name__ as package

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
                    "torch.fx could not trace; dynamo: in a graph torch dynamo captured, "
                    "found by running --input or --tokens). Modules that run as written are "
                    "listed under the table with the reason."),
        epilog=_MODEL_HELP + "\n" + _SELECTOR_HELP + "\nexample:\n"
               "  fxprobe sites fxprobe.examples:small_cnn --ops module:Conv2d,op:add\n"
               "  fxprobe sites models.py:gpt2 --tokens 1x16 --ops 'blocks.*.resid_post'",
    )
    _model_args(p, "list")
    _input_args(p, "to list the sites torch dynamo finds (in code torch.fx cannot trace: "
                   "a Hugging Face model) and their canonical names (blocks.0.resid_post), "
                   "as fxprobe.tap finds them at the first forward")
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
    _input_args(p, "to show dtype and shape at every site, and to draw the graphs torch "
                   "dynamo captures (a Hugging Face model) op by op, as fxprobe.tap runs them")
    p.add_argument("--no-fold", dest="fold", action="store_false",
                   help="draw every block; by default a run of three or more sibling blocks "
                        "of one class is drawn as its first block and one node for the rest "
                        "(its tooltip lists their sites)")
    p.add_argument("--rankdir", choices=("TB", "LR"), default="TB",
                   help="layout direction: top to bottom (default) or left to right")
    p.add_argument("--focus", metavar="MODULE",
                   help="draw this module whole (blocks.3) and the modules beside it as one "
                        "node each (with --depth: everything else at that depth)")
    p.add_argument("--show-plumbing", action="store_true",
                   help="draw shape ops (size, shape, getitem on sizes), attributes, inputs "
                        "left at a constant default and modules that pass their input "
                        "through (Identity, Dropout in eval mode) as nodes; by default they "
                        "are folded and the caption lists them")
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
    p.add_argument("--tracer", choices=("auto", "fx", "hooks", "dynamo", "fx+dynamo"),
                   default="auto",
                   help="auto (default): fx where it can, torch dynamo where fx cannot (its "
                        "sites are found by running an example input: --input or --tokens), "
                        "hooks where dynamo fails too; fx: fail if anything cannot be traced; "
                        "hooks: module hooks only; dynamo: the whole model under dynamo; "
                        "fx+dynamo: auto without hooks")
    p.add_argument("--train", action="store_true",
                   help="use the model's train-mode graph (default: eval mode)")
    p.add_argument("--kw", action="append", default=[], metavar="NAME=VALUE",
                   help="a keyword argument of the factory, VALUE a Python literal "
                        "(--kw image_size=64 --kw dropout=0.1); repeatable")


def _input_args(p: argparse.ArgumentParser, why: str) -> None:
    p.add_argument("--input", action="append", default=[], metavar="SPEC",
                   help=f"an example input, {why}: sizes joined by 'x', optionally ':dtype' "
                        "(1x3x224x224, 2x128:int64); repeat the option or separate with "
                        "commas for several positional inputs. Floats are random normal, "
                        "integers and bools zero.")
    p.add_argument("--tokens", metavar="BxT",
                   help="token ids for a transformer, as its first positional input "
                        "(input_ids): BATCHxLENGTH int64 zeros, e.g. 1x16 (same as --input "
                        "1x16:int64); comes before any --input")


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
