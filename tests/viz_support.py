"""What test_viz_models, test_viz share."""

from __future__ import annotations

import re
import shutil
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


HAS_DOT = shutil.which("dot") is not None


needs_dot = pytest.mark.skipif(not HAS_DOT, reason="the Graphviz 'dot' program is not installed")


_ID = r'("(?:[^"\\]|\\.)*"|[\w.]+)'


_NODE = re.compile(rf"^\s*{_ID} \[(.*)\]$")


_EDGE = re.compile(rf"^\s*{_ID} -> {_ID}( \[.*\])?$")


_ATTR = re.compile(r'(\w+)=("(?:[^"\\]|\\.)*"|[^\s"\]]+)')


def _unquote(s: str) -> str:
    return s[1:-1].replace('\\"', '"') if s.startswith('"') else s


def parse_dot(source: str) -> tuple[dict[str, dict[str, str]], list[tuple[str, str]]]:
    """Nodes (id -> attributes) and visible edges of DOT text written by graphviz."""
    nodes: dict[str, dict[str, str]] = {}
    edges: list[tuple[str, str]] = []
    for line in source.splitlines():
        m = _EDGE.match(line)
        if m:
            if "invis" not in (m.group(3) or ""):
                edges.append((_unquote(m.group(1)), _unquote(m.group(2))))
            continue
        m = _NODE.match(line)
        if m and _unquote(m.group(1)) not in ("graph", "node", "edge"):
            nodes[_unquote(m.group(1))] = {k: _unquote(v) for k, v in _ATTR.findall(m.group(2))}
    return nodes, edges


def tapped_ids(nodes: dict[str, dict[str, str]]) -> set[str]:
    return {n for n, a in nodes.items() if "fxprobe-tapped" in a.get("class", "")}


_SVG = "{http://www.w3.org/2000/svg}"


_XLINK = "{http://www.w3.org/1999/xlink}"


def svg_nodes(path: Path) -> dict[str, tuple[str, str]]:
    """SVG node title -> (class, tooltip)."""
    out = {}
    for g in ET.parse(path).getroot().iter(f"{_SVG}g"):
        cls = g.get("class", "")
        title = g.find(f"{_SVG}title")
        if title is None or not (cls.startswith("node") or cls.startswith("cluster")):
            continue
        link = g.find(f".//{_SVG}a")
        tip = link.get(f"{_XLINK}title", "") if link is not None else ""
        out[title.text or ""] = (cls, tip)
    return out

