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
    "dynamo": ("dynamo", "dynamo_names", "dynamo_quiet", "dynamo_shapes", "canonical",
               "attention"),
    "dynamo_shapes": ("dynamo_shapes",),
    "attention": ("attention",),
    "dynamo_names": ("dynamo_names", "dynamo_shapes"),
    "dynamo_quiet": ("dynamo_quiet",),
    "canonical": ("canonical", "canonical_graph", "canonical_layout", "dynamo_names",
                  "attention"),
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


def imports_of(path: Path, root: Path) -> list[tuple[int, str]]:
    """(line, absolute module) of every fxprobe import in ``path``, wherever it stands."""
    name = module_name(path, root)
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod.split(".")[0] != root.name:
                continue
            # ``from . import x`` names modules; ``from .x import y`` names things of x.
            for alias in node.names:
                sub = f"{mod}.{alias.name}"
                is_module = (root.parent / sub.replace(".", "/")).with_suffix(".py").exists() \
                    or (root.parent / sub.replace(".", "/")).is_dir()
                found.append((node.lineno, sub if is_module else mod))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names
                      if a.name.split(".")[0] == root.name]
    return found


def _layer(parts: list[str]) -> str | None:
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else None


def violations(root: Path) -> list[str]:
    """Every import that breaks the layering, as ``'importer:line -> imported (why)'``."""
    out: list[str] = []
    for path in sorted(root.rglob("*.py")):
        me = module_name(path, root).split(".")
        layer = _layer(me)
        if layer is None:
            continue  # the top: api, cli, examples, dist, __init__, __main__
        for line, target in imports_of(path, root):
            them = target.split(".")
            where = f"{'.'.join(me)}:{line} -> {target}"
            other = _layer(them)
            if other is None:
                if len(them) > 1:
                    out.append(f"{where} (the entry points sit above every layer)")
                continue
            inner = ".".join(them[1:])
            if not any(inner == a or inner.startswith(a + ".") for a in ALLOWED[layer]):
                out.append(f"{where} ({layer} may import only {', '.join(ALLOWED[layer])})")
                continue
            if layer == other == "frontends" and len(me) > 2 and len(them) > 2:
                mine, theirs = me[2], them[2]
                family = FRONTEND_FAMILIES.get(mine)
                if family is None:
                    out.append(f"{where} (frontend {mine} is in no family of FRONTEND_FAMILIES)")
                elif theirs not in ("mirror", "wrappers") and theirs not in family:
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
    })
    found = violations(root)
    assert found == [
        "fxprobe.capture.rewrite:1 -> fxprobe.api (the entry points sit above every layer)",
        "fxprobe.core.site:2 -> fxprobe.runtime.tapped (core may import only core)",
        "fxprobe.frontends.export:1 -> fxprobe.frontends.script "
        "(frontend export reaches into frontend script)",
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


def test_design_doc_names_every_module_and_layer_rule() -> None:
    """docs/design.md is the map of the code: every module of every layer is on it, and its
    table of layers states what this test enforces."""
    text = (PACKAGE.parent / "docs" / "design.md").read_text()
    missing = [f"{p.parent.name}/{p.stem}" for layer in LAYERS
               for p in sorted((PACKAGE / layer).rglob("*.py"))
               if p.stem != "__init__" and p.stem not in text]
    assert not missing, f"docs/design.md does not mention {missing}"
    for layer, allowed in ALLOWED.items():
        row = next((line for line in text.splitlines() if line.startswith(f"| `{layer}/`")),
                   None)
        assert row is not None, f"docs/design.md has no row for {layer}/"
        said = row.split("|")[2]
        for other in allowed:
            if other != layer:
                assert other in said, f"design.md's {layer}/ row does not allow {other}"
