"""Drawing real model shapes: transformers traced by fx and by dynamo, graph breaks, folded
plumbing and pass-through modules, captions, collapsed and focused modules, and the height of
large pictures."""


from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import zoo
from reference import hook_values
from torch import fx, nn
from tv_venv import TvJob, run_tv, uses_tv
from viz_support import (
    _NODE,
    _unquote,
    needs_dot,
    parse_dot,
    svg_nodes,
    tapped_ids,
)

import fxprobe
from benchmarks.models import ResNet50


class Attention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        qkv = self.qkv(x).view(B, T, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        att = F.softmax((q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(C // self.heads)), dim=-1)
        return self.proj((att @ v).transpose(1, 2).reshape(B, T, C))


class Layer(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = Attention(d, heads)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.mlp(self.ln2(x)))


class Transformer12(nn.Module):
    """A BERT-base layout: embeddings, 12 pre-norm layers, hand-written attention."""

    def __init__(self, d: int = 768, heads: int = 12, layers: int = 12, vocab: int = 1000,
                 context: int = 128) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.zeros(1, context, d))
        self.layers = nn.ModuleList([Layer(d, heads) for _ in range(layers)])
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids) + self.pos[:, : ids.shape[1]]
        for layer in self.layers:
            x = layer(x)
        return self.head(self.ln(x))


@needs_dot
@pytest.mark.parametrize("name", ["resnet50", "transformer12"])
def test_large_graphs_render(name: str, tmp_path: Path) -> None:
    if name == "resnet50":
        model: nn.Module = ResNet50(width=8).eval()
        x = torch.randn(1, 3, 64, 64)
        ops: Any = [nn.Conv2d, torch.add]
    else:
        model, x, ops = Transformer12(d=48, heads=4).eval(), torch.zeros(1, 16, dtype=torch.long), \
            nn.Linear
    n_sites = len(fxprobe.sites(model))
    assert n_sites > (170 if name == "resnet50" else 380)
    for depth in (None, 2):  # timings are measured outside the tests (see docs/visualize.md)
        path = fxprobe.render(model, tmp_path / f"{name}.svg", example_input=x, ops=ops,
                              depth=depth)
        assert path.stat().st_size > 10_000


def _is_plumbing_value(v: Any) -> bool:
    return isinstance(v, (int, torch.Size, torch.device, torch.dtype)) or (
        isinstance(v, (tuple, list)) and all(isinstance(x, int) for x in v))


def _gpt2_like() -> tuple[nn.Module, torch.Tensor]:
    from benchmarks.models import GPT2

    torch.manual_seed(0)
    return GPT2(vocab=50, max_len=16, d_model=16, n_heads=2, n_layers=1).eval(), \
        torch.randint(0, 50, (1, 8))


def test_shape_plumbing_is_folded_by_default_and_shown_on_request() -> None:
    model, ids = _gpt2_like()
    # Reference: a stock fx trace run by an Interpreter; plumbing = nodes that produce sizes.
    gm = fx.symbolic_trace(model)
    values: list[Any] = []

    class Record(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            out = super().run_node(n)
            if n.op != "output":
                values.append(out)
            return out

    Record(gm).run(ids)
    names = list(fxprobe.sites(model))  # one per fx node, in graph order
    assert len(names) == len(values)
    plumbing = {n for n, v in zip(names, values, strict=True) if _is_plumbing_value(v)}
    assert {"h.0.attn.size", "h.0.attn.floordiv"} <= plumbing  # the model has some
    folded, folded_edges = parse_dot(fxprobe.to_dot(model, ids).source)
    shown, _ = parse_dot(fxprobe.to_dot(model, ids, show_plumbing=True).source)
    assert plumbing <= set(shown)
    assert not plumbing & set(folded)
    assert set(names) - plumbing <= set(folded)  # everything else is still drawn
    tips = " ".join(a.get("tooltip", "") for a in folded.values())
    assert "shape ops folded in: h.0.attn.size" in tips
    # The data flow between drawn nodes is kept: q's view still comes from the split.
    assert ("h.0.attn.getitem", "h.0.attn.view") in folded_edges
    # A tapped plumbing site is drawn even when folding.
    tapped, _ = parse_dot(fxprobe.to_dot(model, ids, ops="h.0.attn.floordiv").source)
    assert "h.0.attn.floordiv" in tapped and "h.0.attn.size" not in tapped


class _MaskedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, attn_mask: Any = None, is_causal: bool = False
                ) -> torch.Tensor:
        return self.lin(x) + is_causal  # attn_mask is unused, yet still a placeholder


class _Router(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_MaskedBlock() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x) if x.sum() > 0 else b(-x)  # data-dependent: each block is traced alone
        return x


def test_inputs_with_defaults_are_drawn_compactly() -> None:
    model, x = _Router(), torch.randn(2, 4)
    folded, edges = parse_dot(fxprobe.to_dot(model, x, fold=False).source)
    shown, shown_edges = parse_dot(fxprobe.to_dot(model, x, show_plumbing=True, fold=False).source)
    optional = [f"blocks.{i}.{n}" for i in range(3) for n in ("attn_mask", "is_causal")]
    assert set(optional) <= set(shown)
    assert not set(optional) & set(folded)
    notes = [n for n, a in folded.items() if a.get("label", "").startswith("inputs with defaults")]
    assert notes == [f"blocks.{i}/optional" for i in range(3)]
    assert all("attn_mask (default None)" in folded[n]["label"]
               and "is_causal (default False)" in folded[n]["label"] for n in notes)
    assert not [e for e in edges if e[0] in notes or e[1] in notes]
    assert len(edges) < len(shown_edges)


def _tiny_gpt2() -> nn.Module:
    """A Hugging Face GPT-2 from a tiny config (random init, nothing downloaded), eager
    attention so that the softmax is an op of the captured graph; fx cannot trace it."""
    tf = pytest.importorskip("transformers")
    config = tf.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=64,
                           bos_token_id=0, eos_token_id=0, pad_token_id=0)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return tf.GPT2LMHeadModel(config).eval()


def _reaches(edges: list[tuple[str, str]], a: str, b: str) -> bool:
    succ: dict[str, list[str]] = {}
    for x, y in edges:
        succ.setdefault(x, []).append(y)
    todo, seen = [a], {a}
    while todo:
        for y in succ.get(todo.pop(), []):
            if y == b:
                return True
            if y not in seen:
                seen.add(y)
                todo.append(y)
    return False


def _node_statements(source: str) -> list[str]:
    return [m.group(1) for line in source.splitlines() if (m := _NODE.match(line))
            and _unquote(m.group(1)) not in ("graph", "node", "edge")]


@needs_dot
def test_dynamo_graphs_are_drawn_op_by_op(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the layers in the model's one graph (tests/test_viz_shared.py draws them shared)
    monkeypatch.setenv("FXPROBE_DYNAMO_REGIONS", "marked")
    model = _tiny_gpt2()
    torch._dynamo.reset()  # so that a new sequence length recompiles below
    tapped = fxprobe.tap(model, ops=[F.softmax, torch.matmul])  # tracer="auto"
    # Before any forward nothing is captured: drawn as the plan of the model is drawn
    # (independent of dynamo: fx regions, hooked modules), the caption says what comes.
    before = fxprobe.to_dot(tapped).source
    plain = fxprobe.to_dot(model).source
    assert parse_dot(before) == parse_dot(plain)
    assert "its ops are drawn after a forward" in before
    ids = torch.randint(2, 100, (2, 7))
    with torch.no_grad():
        tapped(input_ids=ids, use_cache=False)
    assert tapped.dynamo_info and not tapped.fallbacks
    names = {s.name for s in tapped.sites}
    attn = [f"transformer.h.{i}.attn" for i in range(2)]
    # GPT2Attention's eager path: softmax(q @ k^T ...), then dropout, then @ v.
    assert {f"{a}.{op}" for a in attn for op in ("softmax", "matmul", "matmul_1")} == names
    source = fxprobe.to_dot(tapped).source
    nodes, edges = parse_dot(source)
    assert names <= set(nodes) and tapped_ids(nodes) == names
    for a in attn:
        assert _reaches(edges, f"{a}.matmul", f"{a}.softmax")
        assert _reaches(edges, f"{a}.softmax", f"{a}.matmul_1")
        assert "fxprobe-dynamo" in nodes[f"{a}.softmax"]["class"]
        assert nodes[f"{a}.softmax"]["label"].endswith("float32 [2, 2, 7, 7]")
    # The model's input is a site (named by the forward's parameter, as fx draws it).
    assert _reaches(edges, "input_ids", "transformer.h.0.attn.softmax")
    assert _reaches(edges, "transformer.h.1.attn.matmul_1", "/output")
    assert "1 graph(s) of the last capture drawn op by op" in source
    first = set(nodes)
    # A new sequence length runs the graph already captured (dynamic shapes); with gradients
    # on, dynamo captures the frame again: only the newest graph is drawn.
    with torch.no_grad():
        tapped(input_ids=torch.randint(2, 100, (2, 5)), use_cache=False)
    assert len(tapped.graphs) == 1, list(tapped.graphs)
    tapped(input_ids=torch.randint(2, 100, (2, 9)), use_cache=False)
    assert len(tapped.graphs) == 2, list(tapped.graphs)
    source = fxprobe.to_dot(tapped).source
    statements = _node_statements(source)
    assert len(statements) == len(set(statements)), "a node is drawn twice"
    nodes, _ = parse_dot(source)
    assert first <= set(nodes) and tapped_ids(nodes) == names
    newest = list(tapped.graphs)[-1]
    assert all(newest in a["tooltip"] for a in nodes.values() if "fxprobe-dynamo" in a["class"])
    assert nodes["transformer.h.0.attn.softmax"]["label"].endswith("float32 [2, 2, 9, 9]")
    # depth folds the captured ops like traced ones
    folded, folded_edges = parse_dot(fxprobe.to_dot(tapped, depth=1).source)
    assert "transformer.h/group" in tapped_ids(folded)
    assert not any(n.startswith("transformer.h.") for n in folded)
    assert all(a != b for a, b in folded_edges)
    path = tapped.render(tmp_path / "gpt2.svg")
    drawn = svg_nodes(path)
    for name in names:
        assert "fxprobe-tapped" in drawn[name][0], name
    assert "fxprobe-dynamo" in drawn["cluster_/"][0]


def test_dynamo_graph_breaks_are_drawn_one_after_another() -> None:
    model, args, _ = zoo.make("data_dependent")  # gate: a data-dependent branch
    tapped = fxprobe.tap(model, ops=nn.Linear)
    tapped(*args)
    assert [c.path for c in tapped.dynamo_info] == ["gate"]
    keys = [k for k in tapped.graphs if k.startswith("dynamo:gate:")]
    assert len(keys) == 2  # the condition, then the branch taken
    source = fxprobe.to_dot(tapped).source
    nodes, edges = parse_dot(source)
    assert "gate (Gate): runs under torch dynamo, 2 graphs, one after another" in source
    assert {"gate/dynamo0/return", "gate/dynamo1/return"} <= set(nodes)
    assert ("gate.sum", "gate.gt") in edges and ("gate.gt", "gate/dynamo0/return") in edges
    went_up = bool(model.stem(args[0]).sum() > 0)  # the branch Gate takes, eagerly
    taken = "gate.pos" if went_up else "gate.neg.0"
    assert taken in tapped_ids(nodes) and ("gate.neg.0" if went_up else "gate.pos") not in nodes
    assert '"gate/dynamo0/return" -> "' in source  # stacked: the second graph below the first


def test_a_model_under_tracer_dynamo_is_not_drawn_as_hooked_before_a_forward() -> None:
    model = _tiny_gpt2()
    tapped = fxprobe.tap(model, ops=torch.matmul, tracer="dynamo")
    nodes, _ = parse_dot(fxprobe.to_dot(tapped).source)
    label = nodes["/model"]["label"]
    assert "torch dynamo" in label and "hooks only" not in label
    assert "drawn after a forward" in nodes["/model"]["tooltip"]


class _Passes(nn.Module):
    """Identity and eval-mode Dropout between real ops, an optional input left at None, and a
    block whose inner op and output differ in shape (a collapsed block must show its own)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 6)
        self.skip = nn.Identity()
        self.drop = nn.Dropout(0.5)
        self.block = nn.Sequential(nn.Linear(6, 3), nn.Identity(), nn.Linear(3, 5))
        self.out = nn.Linear(5, 2)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        h = F.layer_norm(self.drop(self.skip(self.inp(x))), (6,), weight=mask)
        return self.out(self.block(h))


def _caption(source: str) -> str:
    m = re.search(r'label="([^"]*)\\l"', source.splitlines()[2])
    assert m is not None, source.splitlines()[2]
    return m.group(1)


def test_passthrough_modules_and_none_inputs_are_folded_and_listed() -> None:
    model = _Passes().eval()
    x = torch.randn(2, 4)
    source = fxprobe.to_dot(model, x).source
    nodes, edges = parse_dot(source)
    caption = _caption(source)
    for gone in ("skip", "drop", "block.1", "mask"):
        assert gone not in nodes, gone
    # Their input goes straight to their users, as eager runs it: inp -> block.0, block.0 ->
    # block.2 (the hand-read data flow of forward).
    assert ("inp", "layer_norm") in edges and ("block.0", "block.2") in edges
    assert "inputs at their default mask=None" in caption
    assert "modules that pass their input through 2 Identity, 1 Dropout" in caption
    plumbing = parse_dot(fxprobe.to_dot(model, x, show_plumbing=True).source)[0]
    assert {"skip", "drop", "block.1", "mask"} <= set(plumbing)
    assert "not drawn" not in _caption(fxprobe.to_dot(model, x, show_plumbing=True).source)
    # In train mode Dropout changes values: it is drawn.
    train = parse_dot(fxprobe.to_dot(model, x, train=True).source)[0]
    assert "drop" in train and "skip" not in train
    # An input the example gives a tensor is drawn, with its edge.
    given_nodes, given_edges = parse_dot(fxprobe.to_dot(model, (x, torch.ones(6))).source)
    assert "mask" in given_nodes and any(a == "mask" for a, _ in given_edges)


def test_caption_counts_are_those_of_sites_and_tapped_sites() -> None:
    model = _Passes().eval()
    tapped = fxprobe.tap(model, ops=nn.Linear)
    tapped(torch.randn(2, 4))
    caption = _caption(fxprobe.to_dot(tapped).source)
    listed = fxprobe.sites(model)
    assert f": {len(listed)} sites (" in caption, (caption, len(listed))
    assert f", {len(tapped.sites)} tapped (" in caption and len(tapped.sites) == 4
    one = fxprobe.tap(model, ops="out")
    assert ", 1 tapped (1 fx, 0 hook)" in _caption(fxprobe.to_dot(one).source)
    assert "1 sites" not in _caption(fxprobe.to_dot(nn.Sequential(nn.ReLU())).source)


def test_collapsed_module_shows_its_own_output_and_tapped_modules_are_outlined() -> None:
    model = _Passes().eval()
    x = torch.randn(2, 4)
    _, ref = hook_values(model, ["block", "block.0"], x)  # independent: eager hooks
    tapped = fxprobe.tap(model, ops="block.0")  # inside the block, another shape
    tapped(x)
    nodes = parse_dot(fxprobe.to_dot(tapped, depth=0).source)[0]
    label = nodes["block/group"]["label"]
    assert str(list(ref["block.0"].shape)) not in label, label
    nodes = parse_dot(fxprobe.to_dot(model, x, depth=0).source)[0]
    assert nodes["block/group"]["label"].endswith(f"float32 {list(ref['block'].shape)}")
    # A tapped module fx traced through: its box is outlined.
    source = fxprobe.to_dot(fxprobe.tap(model, ops="block")).source
    box = source[source.index('subgraph "cluster_block"') if 'subgraph "cluster_block"'
                 in source else source.index("subgraph cluster_block"):]
    first = box.splitlines()[1]
    assert "tapped module" in first and "penwidth=2.5" in first, first
    inner = parse_dot(fxprobe.to_dot(model).source)[0]
    assert "block.2" in inner  # untapped: no outline anywhere
    assert "tapped module" not in fxprobe.to_dot(model).source


def test_focus_draws_one_module_whole_and_checks_its_name() -> None:
    model = zoo.ResNetish().eval()
    target = "layer1.0"
    nodes = parse_dot(fxprobe.to_dot(model, focus=target).source)[0]
    assert {"layer1.0.conv1", "layer1.0.bn1", "layer1.0.conv2"} <= set(nodes)
    others = [n for n, _ in model.named_modules() if n.count(".") == 1 and n != target]
    assert others and all(f"{p}/group" in nodes for p in others), sorted(nodes)
    assert not any(n.startswith(tuple(p + "." for p in others)) for n in nodes)
    with pytest.raises(fxprobe.ConfigError, match="is not a module of"):
        fxprobe.to_dot(model, focus="layer1.O")


_VIT_SCRIPT = """
import struct, sys, torch, timm, fxprobe
torch.manual_seed(0)
vit = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8,
                        num_classes=10).eval()
x = torch.randn(1, 3, 32, 32)
for kw in ({"depth": 2}, {"focus": "blocks.3"}):
    png = fxprobe.to_dot(vit, x, **kw).pipe("png")
    assert png[:8] == b"\\x89PNG\\r\\n\\x1a\\n"
    print(sorted(kw)[0], struct.unpack(">II", png[16:24])[1])
"""


@needs_dot
@uses_tv(TvJob(_VIT_SCRIPT))
def test_timm_vit_at_depth_2_is_at_most_6000_px_tall() -> None:
    heights = dict(line.split() for line in run_tv(TvJob(_VIT_SCRIPT)).splitlines())
    assert int(heights["depth"]) <= 6000, heights  # 11,885 px before folding
    assert int(heights["focus"]) <= 6000, heights

