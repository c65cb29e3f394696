"""The package's layering, as docs/design.md states it, checked on every import of every module:
module-level, function-level and ``TYPE_CHECKING`` ones alike (parsed with ``ast``, nothing is
imported).

Layers, lowest first; a module may import its own layer and the layers its row names::

    core       records and vocabulary           -> (nothing of fxprobe)
    capture    pipeline, rewrite, in-place, stats -> core
    frontends  fx, hooks, dynamo, script, export -> core, capture
    sinks      disk, captures, loggers, dist     -> core, capture.stats
    present    tables and pictures               -> core, capture.stats
    runtime    TappedModule, programs, artifacts -> everything above but the entry points
    (top)      api, cli, examples, dist, __init__, __main__ -> anything

Within ``frontends``, a frontend does not reach into another one's modules: each family below
imports only itself and ``mirror`` (the copied module tree that every model frontend starts
from). Nothing in ``frontends`` combines them: the ``tracer="auto"`` lifecycle (fx, then
dynamo, then hooks) runs them together, so it lives in ``runtime/lifecycle.py``.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "fxprobe"

LAYERS = ("core", "capture", "frontends", "sinks", "present", "runtime")
ALLOWED: dict[str, tuple[str, ...]] = {
    "core": ("core",),
    "capture": ("core", "capture"),
    "frontends": ("core", "capture", "frontends"),
    "sinks": ("core", "capture.stats", "sinks"),
    "present": ("core", "capture.stats", "present"),
    "runtime": ("core", "capture", "frontends", "sinks", "present", "runtime"),
}
FRONTEND_FAMILIES: dict[str, tuple[str, ...]] = {
    "fx": ("fx", "fx_tracer"),
    "fx_tracer": ("fx_tracer",),
    "hooks": ("hooks",),
    "mirror": ("wrappers",),
    "wrappers": (),
    "dynamo": ("dynamo", "dynamo_inline", "dynamo_kv", "dynamo_names", "dynamo_quiet",
               "dynamo_rearm",
               "dynamo_shapes",
               "dynamo_versions", "dynamo_blocks", "dynamo_blocks_cache",
               "canonical", "attention", "sharding"),
    "dynamo_versions": ("dynamo_versions", "dynamo_names"),
    "dynamo_shapes": ("dynamo_shapes",),
    "attention": ("attention",),
    "dynamo_names": ("dynamo_names", "dynamo_shapes", "dynamo_blocks", "dynamo_blocks_cache"),
    "dynamo_blocks": ("dynamo_blocks", "dynamo_inline", "dynamo_shapes"),
    "dynamo_blocks_cache": ("dynamo_blocks_cache", "dynamo_blocks", "dynamo_inline"),
    "dynamo_quiet": ("dynamo_quiet",),
    "dynamo_rearm": ("dynamo_rearm",),
    "dynamo_kv": ("dynamo_kv",),
    "dynamo_inline": ("dynamo_inline",),
    "dynamo_reach": ("dynamo_reach", "canonical"),
    "sharding": ("sharding", "dynamo_names"),
    "canonical_ends": ("canonical_ends", "canonical_graph", "dynamo_names", "dynamo_blocks",
                       "attention"),
    "canonical": ("canonical", "canonical_graph", "canonical_data", "canonical_layout",
                  "canonical_sites", "canonical_ends", "dynamo_names", "attention"),
    "canonical_sites": ("canonical_sites", "canonical_data", "canonical_graph", "dynamo_names",
                        "attention"),
    "canonical_data": ("canonical_data", "canonical_graph", "dynamo_names", "attention"),
    "canonical_layout": ("canonical_layout",),
    "canonical_graph": ("canonical_graph", "dynamo_names", "attention"),
    "script": ("script", "script_build"),
    "script_build": ("script", "script_build"),
    "export": ("export",),
}


def module_name(path: Path, root: Path) -> str:
    rel = path.relative_to(root.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(mod: str, level: int, package: list[str]) -> str:
    if not level:
        return mod
    base = package[: len(package) - level + 1]
    return ".".join(base + ([mod] if mod else []))


def _is_module(root: Path, name: str) -> bool:
    path = root.parent / name.replace(".", "/")
    return path.with_suffix(".py").exists() or path.is_dir()


IMPORTERS = ("import_module", "__import__")


def _imported_by_name(node: ast.AST) -> str | None:
    """The constant name an ``importlib.import_module(...)`` or ``__import__(...)`` imports."""
    if not isinstance(node, ast.Call) or not node.args:
        return None
    called = getattr(node.func, "attr", None) or getattr(node.func, "id", None)
    first = node.args[0]
    if called in IMPORTERS and isinstance(first, ast.Constant) and isinstance(first.value, str):
        return first.value
    return None


def imports_of(path: Path, root: Path) -> list[tuple[int, str]]:
    """(line, absolute module) of every fxprobe import in ``path``, wherever it stands:
    ``import``, ``from ... import`` (relative ones resolved) and ``importlib.import_module`` /
    ``__import__`` of a constant name (a name computed at run time cannot be checked here)."""
    name = module_name(path, root)
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            mod = _resolve(node.module or "", node.level, package)
            if mod.split(".")[0] != root.name:
                continue
            # ``from . import x`` names modules; ``from .x import y`` names things of x.
            for alias in node.names:
                sub = f"{mod}.{alias.name}"
                found.append((node.lineno, sub if _is_module(root, sub) else mod))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names
                      if a.name.split(".")[0] == root.name]
        elif (target := _imported_by_name(node)) is not None:
            level = len(target) - len(target.lstrip("."))
            mod = _resolve(target.lstrip("."), level, package) if level else target
            if mod.split(".")[0] == root.name:
                found.append((node.lineno, mod))
    return found


def _layer(parts: list[str]) -> str | None:
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else None


def violations(root: Path) -> list[str]:
    """Every import that breaks the layering, as ``'importer:line -> imported (why)'``, and every
    frontend module that belongs to no family."""
    out: list[str] = []
    for path in sorted(root.rglob("*.py")):
        me = module_name(path, root).split(".")
        layer = _layer(me)
        if layer is None:
            continue  # the top: api, cli, examples, dist, __init__, __main__
        if layer == "frontends" and len(me) > 2 and me[2] not in FRONTEND_FAMILIES:
            out.append(f"{'.'.join(me)} (frontend {me[2]} is in no family of FRONTEND_FAMILIES)")
        for line, target in imports_of(path, root):
            them = target.split(".")
            where = f"{'.'.join(me)}:{line} -> {target}"
            other = _layer(them)
            if other is None:
                # the package itself (``import fxprobe``, ``from fxprobe import tap``,
                # ``from .. import tap``) or a module of the top: the entry points
                out.append(f"{where} (the entry points sit above every layer)")
                continue
            inner = ".".join(them[1:])
            if not any(inner == a or inner.startswith(a + ".") for a in ALLOWED[layer]):
                out.append(f"{where} ({layer} may import only {', '.join(ALLOWED[layer])})")
                continue
            if layer == other == "frontends" and len(me) > 2 and len(them) > 2:
                mine, theirs = me[2], them[2]
                family = FRONTEND_FAMILIES.get(mine, ())
                if theirs not in ("mirror", "wrappers") and theirs not in family:
                    out.append(f"{where} (frontend {mine} reaches into frontend {theirs})")
    return sorted(set(out))


def cycles(root: Path) -> list[list[str]]:
    """Import cycles between modules, counting every import (function-level too)."""
    graph: dict[str, set[str]] = {}
    for path in root.rglob("*.py"):
        name = module_name(path, root)
        graph[name] = {t for _, t in imports_of(path, root) if t != name}
    found: list[list[str]] = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(name: str) -> None:
        state[name] = 1
        stack.append(name)
        for dep in sorted(graph.get(name, ())):
            if dep not in graph:
                continue
            if state.get(dep) == 1:
                found.append(stack[stack.index(dep):] + [dep])
            elif dep not in state:
                visit(dep)
        stack.pop()
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name)
    # A package's __init__ importing its own modules is how packages are made, not a circle.
    return [c for c in found if not all(m == c[0] or m.startswith(c[0] + ".") for m in c)]


def test_no_import_breaks_the_layering() -> None:
    found = violations(PACKAGE)
    assert not found, "imports that break the layering:\n" + "\n".join(found)


def test_no_import_cycle() -> None:
    found = cycles(PACKAGE)
    assert not found, "import cycles:\n" + "\n".join(" -> ".join(c) for c in found)


def _plant(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "fxprobe"
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for d in [root, *[p for p in root.rglob("*") if p.is_dir()]]:
        (d / "__init__.py").touch()
    return root


def test_the_checks_fail_on_planted_violations(tmp_path: Path) -> None:
    root = _plant(tmp_path, {
        "core/site.py": "def f():\n    from ..runtime.tapped import TappedModule\n",
        "present/viz.py": "from ..frontends import fx\n",
        "frontends/fx.py": "",
        "frontends/export.py": "from .script import types\n",
        "frontends/script.py": "from ..core.site import Site\n",
        "capture/rewrite.py": "import fxprobe.api\n",
        "runtime/tapped.py": "from ..present import viz\n",
        "sinks/disk.py": "from ..capture.stats import math\nfrom ..capture import pipeline\n",
        "capture/stats/math.py": "",
        "capture/pipeline.py": "",
        "api.py": "from .runtime import tapped\n",
        # the package itself, however it is spelled, and imports by name at run time
        "core/ops.py": "from fxprobe import tap\nfrom .. import tap\nimport fxprobe\n"
                       "import importlib\n"
                       "def f():\n    importlib.import_module('fxprobe.runtime.tapped')\n"
                       "    return importlib.import_module('..sinks.disk', __package__)\n",
        # a frontend that imports only core still has to belong to a family
        "frontends/orphan.py": "from ..core.site import Site\n",
    })
    found = violations(root)
    assert found == [
        "fxprobe.capture.rewrite:1 -> fxprobe.api (the entry points sit above every layer)",
        "fxprobe.core.ops:1 -> fxprobe (the entry points sit above every layer)",
        "fxprobe.core.ops:2 -> fxprobe (the entry points sit above every layer)",
        "fxprobe.core.ops:3 -> fxprobe (the entry points sit above every layer)",
        "fxprobe.core.ops:6 -> fxprobe.runtime.tapped (core may import only core)",
        "fxprobe.core.ops:7 -> fxprobe.sinks.disk (core may import only core)",
        "fxprobe.core.site:2 -> fxprobe.runtime.tapped (core may import only core)",
        "fxprobe.frontends.export:1 -> fxprobe.frontends.script "
        "(frontend export reaches into frontend script)",
        "fxprobe.frontends.orphan (frontend orphan is in no family of FRONTEND_FAMILIES)",
        "fxprobe.present.viz:1 -> fxprobe.frontends.fx "
        "(present may import only core, capture.stats, present)",
        "fxprobe.sinks.disk:2 -> fxprobe.capture.pipeline "
        "(sinks may import only core, capture.stats, sinks)",
    ]
    (root / "core" / "ops.py").write_text("def g():\n    from . import site\n")
    (root / "core" / "site.py").write_text("from .ops import g\n")
    assert cycles(root) == [["fxprobe.core.ops", "fxprobe.core.site", "fxprobe.core.ops"]]


@pytest.mark.parametrize("layer", LAYERS)
def test_every_layer_is_a_package_with_a_docstring(layer: str) -> None:
    init = PACKAGE / layer / "__init__.py"
    assert init.exists(), f"fxprobe/{layer}/ is no package"
    assert ast.get_docstring(ast.parse(init.read_text())), f"fxprobe/{layer}/__init__.py"


def named_in(text: str, layer: str, path: Path) -> bool:
    """Whether docs/design.md names the module: as ``stem.py``, in backquotes, as
    ``layer/path``, or as a word of the map (the ``text`` block at the top). A word anywhere
    else is not enough: ``points`` must not pass on the words "entry points"."""
    stem = re.escape(path.stem)
    rel = re.escape(path.relative_to(PACKAGE / layer).with_suffix("").as_posix())
    drawn = re.search(r"```text\n(.*?)```", text, re.S)
    return any(re.search(pattern, text) for pattern in (
        rf"(?<![\w]){stem}\.py\b", rf"`{stem}`", rf"\b{layer}/{rel}\b")) \
        or bool(drawn and re.search(rf"(?<![\w.]){stem}(?![\w])", drawn.group(1)))


def layer_rule_gaps(text: str) -> list[str]:
    """What design.md's table of layers leaves out of what ``ALLOWED`` enforces."""
    gaps: list[str] = []
    for layer, allowed in ALLOWED.items():
        row = next((line for line in text.splitlines() if line.startswith(f"| `{layer}/`")),
                   None)
        if row is None:
            gaps.append(f"no row for {layer}/")
            continue
        said = set(re.findall(r"[\w.]+", row.split("|")[2]))
        gaps += [f"{layer}/ row does not allow {other}" for other in allowed
                 if other != layer and other not in said]
    return gaps


def test_design_doc_names_every_module_and_layer_rule() -> None:
    """docs/design.md is the map of the code: every module of every layer is on it, and its
    table of layers states what this test enforces."""
    text = (PACKAGE.parent / "docs" / "design.md").read_text()
    missing = [f"{p.parent.name}/{p.stem}" for layer in LAYERS
               for p in sorted((PACKAGE / layer).rglob("*.py"))
               if p.stem != "__init__" and not named_in(text, layer, p)]
    assert not missing, f"docs/design.md does not mention {missing}"
    gaps = layer_rule_gaps(text)
    assert not gaps, f"docs/design.md's table of layers: {gaps}"


def test_the_doc_checks_fail_on_planted_gaps() -> None:
    """A module named only inside another word, and a layer rule said only as part of a longer
    name, are not named."""
    points = PACKAGE / "capture" / "points.py"
    assert not named_in("```text\n capture/ rewrite\n```\nthe entry points", "capture", points)
    assert named_in("```text\n capture/ rewrite, points (per-call steps)\n```", "capture",
                    points)
    assert named_in("see `capture/points.py`", "capture", points)
    rows = "\n".join(f"| `{layer}/` | {', '.join(a for a in allowed if a != layer)} | x |"
                     for layer, allowed in ALLOWED.items())
    assert layer_rule_gaps(rows) == []
    assert layer_rule_gaps(rows.replace("| core, capture.stats |", "| core, capture.statsx |")) \
        == ["sinks/ row does not allow capture.stats", "present/ row does not allow capture.stats"]
