"""Pictures a person can look at: repeated blocks fold, collapsed blocks carry their sites in
tooltips, a TorchScript graph reads top-down in execution order.

Checked on the SVG Graphviz writes (node positions, tooltips) of small models; the heights of
torchvision's resnet50 and vit_b_16 are checked in the torchvision venv (a subprocess, as in
tests/test_torchvision.py), and skip where it is absent.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import fxprobe

ROOT = Path(__file__).resolve().parent.parent
HAS_DOT = shutil.which("dot") is not None
needs_dot = pytest.mark.skipif(not HAS_DOT, reason="the Graphviz 'dot' program is not installed")
TV_PYTHON = Path(os.environ.get("FXPROBE_TV_PYTHON") or Path(
    os.environ.get("FXPROBE_TV_VENV", "/work/venv-tv")) / "bin" / "python")
_SVG = "{http://www.w3.org/2000/svg}"
_XLINK = "{http://www.w3.org/1999/xlink}"


def svg_nodes(svg: bytes) -> dict[str, dict[str, Any]]:
    """Node id -> its y (the first text line's baseline, growing downwards) and tooltip."""
    out: dict[str, dict[str, Any]] = {}
    for g in ET.fromstring(svg).iter(f"{_SVG}g"):
        if "node" not in g.get("class", "").split():
            continue
        title = g.find(f"{_SVG}title")
        text = g.find(f".//{_SVG}text")
        link = g.find(f".//{_SVG}a")
        if title is None or text is None:
            continue
        tip = link.get(f"{_XLINK}title", "") if link is not None else ""
        out[title.text or ""] = {"y": float(text.get("y", "0")), "tooltip": tip,
                                 "label": " ".join(t.text or "" for t in g.iter(f"{_SVG}text"))}
    return out


def svg_height(svg: bytes) -> float:
    """The picture's height in pixels at Graphviz's 96 dpi (the SVG says it in points)."""
    m = re.search(rb'<svg width="([\d.]+)pt" height="([\d.]+)pt"', svg)
    assert m is not None
    return float(m.group(2)) * 96 / 72


# -- TorchScript: top-down in execution order ------------------------------------------------

class InplaceStem(nn.Module):
    """conv -> bn -> in-place ReLU (a ``prim::If`` in TorchScript's IR) -> conv -> ReLU."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(4)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(4, 4, 3, padding=1)
        self.relu2 = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu2(self.conv2(self.relu(self.bn1(self.conv1(x)))))


def _dot_edges(source: str) -> set[tuple[str, str]]:
    return {(a.strip('"'), b.strip('"')) for a, b, rest in
            re.findall(r'^\s*("[^"]+"|[\w.]+) -> ("[^"]+"|[\w.]+)(.*)$', source, flags=re.M)
            if "invis" not in rest}


def test_script_inplace_relu_keeps_its_data_flow() -> None:
    scripted = torch.jit.script(InplaceStem().eval())
    edges = _dot_edges(fxprobe.to_dot(scripted).source)
    # the in-place ReLU's value comes out of a prim::If whose own input is only the flag
    assert {("x", "conv1"), ("conv1", "bn1"), ("bn1", "relu"), ("relu", "conv2"),
            ("conv2", "relu2"), ("relu2", "/output")} <= edges
    assert ("bn1", "/output") not in edges


@needs_dot
def test_script_reads_top_down_in_execution_order() -> None:
    scripted = torch.jit.script(InplaceStem().eval())
    nodes = svg_nodes(fxprobe.to_dot(scripted).pipe("svg"))
    order = ["x", "conv1", "bn1", "relu", "conv2", "relu2", "/output"]
    ys = [nodes[n]["y"] for n in order]
    assert ys == sorted(ys) and len(set(ys)) == len(ys), dict(zip(order, ys, strict=True))
