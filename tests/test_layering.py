"""The package's layering (docs/design.md): module-level imports form no cycle, and the lower
layers never import the runtime."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "fxprobe"


def _imports(path: Path) -> set[str]:
    """fxprobe modules that ``path`` imports when it is imported (not under TYPE_CHECKING,
    not inside functions)."""
    found: set[str] = set()
    for stmt in ast.parse(path.read_text()).body:
        if isinstance(stmt, ast.If) and "TYPE_CHECKING" in ast.unparse(stmt.test):
            continue
        if isinstance(stmt, ast.ImportFrom) and stmt.level == 1:
            if stmt.module:
                found.add(stmt.module.split(".")[0])
            else:
                found.update(a.name for a in stmt.names)
    return found


def _graph() -> dict[str, set[str]]:
    return {p.stem: _imports(p) for p in PACKAGE.glob("*.py") if p.stem != "__init__"}


def test_module_level_imports_have_no_cycle() -> None:
    graph = _graph()
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(name: str) -> None:
        state[name] = 1
        stack.append(name)
        for dep in sorted(graph.get(name, ())):
            if state.get(dep) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(dep):]
                                                                    + [dep]))
            if dep not in state:
                visit(dep)
        stack.pop()
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name)


def test_lower_layers_do_not_import_the_runtime() -> None:
    graph = _graph()
    for name in ("_site", "_ops", "_select", "_trace", "_rewrite", "_pipeline", "_program",
                 "_summary", "_viz", "_viz_items", "_viz_dot", "_shapes", "_extract", "_hooks",
                 "_record", "_mirror"):
        assert not graph[name] & {"_tap", "_api"}, f"{name} imports the runtime"
    for name in ("_site", "_ops", "_errors", "_options"):
        assert not graph[name] & {"_trace", "_rewrite", "_pipeline", "_program", "_tap",
                                  "_api"}, name
    assert "_api" not in graph["_tap"], "the runtime imports the entry points"
