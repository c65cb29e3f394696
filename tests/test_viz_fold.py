"""Pictures a person can look at: repeated blocks fold, collapsed blocks carry their sites in
tooltips, a TorchScript graph reads top-down in execution order.

Checked on the SVG Graphviz writes (node positions, tooltips) of small models; the heights of
torchvision's resnet50 and vit_b_16 are checked in the torchvision venv (a subprocess, as in
tests/test_torchvision.py), and skip where it is absent.
"""

from __future__ import annotations

import json
import re
import shutil
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from tv_venv import TvJob, run_tv, uses_tv

import fxprobe

ROOT = Path(__file__).resolve().parent.parent
HAS_DOT = shutil.which("dot") is not None
needs_dot = pytest.mark.skipif(not HAS_DOT, reason="the Graphviz 'dot' program is not installed")
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


# -- repeated blocks fold ----------------------------------------------------------------------

class Block(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, d)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.act(self.fc1(x)))


class Stack(nn.Module):
    """An embedding, four blocks in a ModuleList, a head (its fc1/fc2 are Linears of one
    class and numbered names, but leaves: they never fold)."""

    def __init__(self, n: int = 4) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.blocks = nn.ModuleList(Block() for _ in range(n))
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _nodes(svg: bytes) -> dict[str, dict[str, Any]]:
    return svg_nodes(svg)


@needs_dot
def test_repeated_blocks_fold_after_the_first() -> None:
    model, x = Stack().eval(), torch.randn(2, 4)
    dot = fxprobe.to_dot(model, x, ops="blocks.2.fc2")
    nodes = _nodes(dot.pipe("svg"))
    assert "blocks.0.fc1" in nodes and "blocks.0.add" in nodes  # the first block, whole
    assert not any(n.startswith(("blocks.1.", "blocks.2.", "blocks.3.")) for n in nodes)
    fold = nodes["blocks.1/fold"]
    assert "blocks.1 ... blocks.3: Block ×3" in fold["label"]
    # the tooltip names every site it stands for, with its shape (hand-counted: 4 per block)
    names = [f"blocks.{i}.{n}" for i in (1, 2, 3) for n in ("fc1", "act", "fc2", "add")]
    for name in names:
        assert re.search(rf"{re.escape(name)}: \S+ float32 \[2, 8\]", fold["tooltip"]), name
    assert "12 sites, 1 tapped" in fold["label"]
    assert "tapped: blocks.2.fc2" in fold["tooltip"]
    # top-down in execution order: embed, the first block, the fold, the head
    ys = [nodes[n]["y"] for n in ("embed", "blocks.0.fc1", "blocks.0.add", "blocks.1/fold",
                                  "head")]
    assert ys == sorted(ys)
    # edges into and out of the fold: from the first block's output, to the head
    edges = _dot_edges(dot.source)
    assert ("blocks.0.add", "blocks.1/fold") in edges and ("blocks.1/fold", "head") in edges
    assert "repeated blocks drawn as one node" in dot.source


@needs_dot
def test_fold_false_draws_every_block_and_fold_is_checked() -> None:
    model, x = Stack().eval(), torch.randn(2, 4)
    nodes = _nodes(fxprobe.to_dot(model, x, fold=False).pipe("svg"))
    assert {f"blocks.{i}.fc2" for i in range(4)} <= set(nodes)
    assert not any(n.endswith("/fold") for n in nodes)
    with pytest.raises(fxprobe.ConfigError, match="fold='no'"):
        fxprobe.to_dot(model, fold="no")  # type: ignore[arg-type]


def test_short_runs_and_focus_do_not_fold() -> None:
    x = torch.randn(2, 4)
    two = fxprobe.to_dot(Stack(2).eval(), x).source  # two blocks: nothing to gain
    assert "/fold" not in two and '"blocks.1.fc2"' in two
    focused = fxprobe.to_dot(Stack().eval(), x, focus="blocks.2").source
    assert "/fold" not in focused and '"blocks.2.fc2"' in focused


def test_depth_draws_blocks_as_nodes_then_folds_open_blocks() -> None:
    """depth=0: the ModuleList is one node; depth=1: one node per block (nothing folded);
    depth=2 and the default: the first block drawn, the others one node."""
    model, x = Stack().eval(), torch.randn(2, 4)
    ids = {d: set(re.findall(r'^\s*"([^"]+/(?:group|fold))" \[', fxprobe.to_dot(
        model, x, depth=d).source, flags=re.M)) for d in (0, 1, 2, None)}
    assert ids[0] == {"blocks/group"}
    assert ids[1] == {f"blocks.{i}/group" for i in range(4)}
    assert ids[2] == ids[None] == {"blocks.1/fold"}


@needs_dot
def test_collapsed_modules_list_their_sites_and_shapes_in_the_tooltip() -> None:
    model, x = Stack().eval(), torch.randn(2, 4)
    nodes = _nodes(fxprobe.to_dot(model, x, depth=0).pipe("svg"))
    tip = nodes["blocks/group"]["tooltip"]
    for i in range(4):
        assert f"blocks.{i}.fc1: Linear float32 [2, 8]" in tip
        assert f"blocks.{i}.add: operator.add float32 [2, 8]" in tip


def test_a_tapped_module_and_an_artifact_fold_too() -> None:
    model, x = Stack().eval(), torch.randn(2, 4)
    tapped = fxprobe.tap(model, ops="blocks.*.fc2")
    with torch.no_grad():
        tapped(x)
    source = fxprobe.to_dot(tapped).source
    assert '"blocks.1/fold"' in source and "3 tapped" in source
    scripted = torch.jit.script(model)
    source = fxprobe.to_dot(scripted).source
    assert '"blocks.1/fold"' in source and '"blocks.0.fc2"' in source


# -- torchvision's resnet50 and vit_b_16 at the default settings -----------------------------

_HEIGHTS = r"""
import json, re, sys, torch, torchvision
import fxprobe
def height(dot):
    m = re.search(rb'<svg width="([\d.]+)pt" height="([\d.]+)pt"', dot.pipe("svg"))
    return float(m.group(2)) * 96 / 72
x = torch.randn(1, 3, 32, 32)  # small: the layout is that of 224 x 224, the convs cheaper
r50 = torchvision.models.resnet50().eval()
vit = torchvision.models.vit_b_16(image_size=32).eval()
print(json.dumps({"resnet50": height(fxprobe.to_dot(r50, x)),
                  "resnet50 depth=1": height(fxprobe.to_dot(r50, x, depth=1)),
                  "vit_b_16": height(fxprobe.to_dot(vit, x))}))
"""


@needs_dot
@uses_tv(TvJob(_HEIGHTS))
def test_resnet50_and_vit_b_16_fit_in_4000_px_by_default() -> None:
    stdout = run_tv(TvJob(_HEIGHTS))
    h = json.loads(stdout.strip().splitlines()[-1])
    assert h["resnet50"] <= 4000 and h["vit_b_16"] <= 4000, h
    # depth changes a CNN: one node per block is shorter than the blocks drawn (folded)
    assert h["resnet50 depth=1"] < h["resnet50"] / 1.5, h
