"""Graph export: DOT golden files, structure against torch.fx and eager hooks, real rendering.

Golden files live in tests/golden/; after a deliberate change to the drawing, regenerate them
with ``FXPROBE_REGEN_GOLDEN=1 pytest tests/test_viz.py`` and review the diff.
"""

from __future__ import annotations

import difflib
import inspect
import math
import os
import re
import shutil
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import zoo
from reference import hook_values, model_state, states_equal
from torch import fx, nn

import fxprobe
from benchmarks.models import ResNet50
from fxprobe import examples as _examples

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = Path(__file__).resolve().parent / "golden"
REGEN = os.environ.get("FXPROBE_REGEN_GOLDEN") == "1"
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


def normalize(source: str) -> str:
    # Absolute paths and line numbers of tests/zoo.py vary; test_fallback_reason checks them.
    source = source.replace(str(ROOT) + os.sep, "")
    return re.sub(r"zoo\.py:\d+", "zoo.py:LINE", source)


def check_golden(name: str, source: str) -> None:
    path = GOLDEN / f"{name}.dot"
    text = normalize(source)
    if REGEN:
        GOLDEN.mkdir(exist_ok=True)
        path.write_text(text, encoding="utf-8")
        return
    assert path.exists(), f"{path} is missing; run FXPROBE_REGEN_GOLDEN=1 pytest {__file__}"
    expected = path.read_text(encoding="utf-8")
    if text != expected:
        diff = "".join(difflib.unified_diff(expected.splitlines(True), text.splitlines(True),
                                            str(path), "to_dot output", n=1))
        pytest.fail(f"DOT text differs from {path.name} (regenerate with "
                    f"FXPROBE_REGEN_GOLDEN=1 if intended):\n{diff[:6000]}")


def _golden_cases() -> dict[str, Any]:
    def zoo_dot(name: str, **kw: Any) -> Any:
        def make() -> str:
            model, args, kwargs = zoo.make(name)
            return str(fxprobe.to_dot(model, args, example_kwargs=kwargs, **kw).source)
        return make

    def tapped_demo() -> str:
        tapped = fxprobe.tap(_examples.small_cnn(), ops=[nn.Conv2d, torch.add, nn.Linear])
        with torch.no_grad():
            tapped(_examples.small_cnn_input())
        return str(fxprobe.to_dot(tapped).source)

    return {
        "resnet": zoo_dot("resnet", ops=[nn.Conv2d, torch.add]),
        "resnet_depth0": zoo_dot("resnet", ops=nn.Conv2d, depth=0),
        "resnet_depth1_lr": zoo_dot("resnet", ops="layer2.*", depth=1, rankdir="LR"),
        "resnet_hooks": zoo_dot("resnet", ops=nn.Conv2d, tracer="hooks"),
        "encoder_depth1": zoo_dot("encoder", ops=nn.Linear, depth=1),
        "lstm": zoo_dot("lstm"),
        "data_dependent": zoo_dot("data_dependent", ops=nn.Linear),
        "untraceable_top": zoo_dot("untraceable_top", ops=nn.Linear),
        "multi_io": zoo_dot("multi_io", ops=torch.mul),
        "inplace_train": zoo_dot("inplace", ops=F.relu, train=True),
        "tapped_small_cnn": tapped_demo,
    }


GOLDEN_CASES = _golden_cases()


@pytest.mark.parametrize("name", sorted(GOLDEN_CASES))
def test_dot_matches_golden(name: str) -> None:
    source = GOLDEN_CASES[name]()
    assert source == GOLDEN_CASES[name](), "to_dot is not deterministic"
    assert not re.search(r"0x[0-9a-f]{6,}", source), "a memory address leaked into the DOT text"
    check_golden(name, source)


# -- structure against independent references ---------------------------------------------

def test_edges_follow_torch_fx_data_flow() -> None:
    model, args, _ = zoo.make("resnet")
    nodes, edges = parse_dot(fxprobe.to_dot(model).source)
    gm = fx.symbolic_trace(model)  # plain fx: module calls named by their target
    calls = [n.target for n in gm.graph.nodes if n.op == "call_module"]
    once = {t for t in calls if calls.count(t) == 1}  # a second call gets a _1 site name
    expected = set()
    for node in gm.graph.nodes:
        if node.op != "call_module" or node.target not in once:
            continue
        for user in node.users:
            if user.op == "call_module" and user.target in once:
                expected.add((str(node.target), str(user.target)))
    drawn = set(edges)
    assert expected and expected <= drawn, sorted(expected - drawn)[:5]
    modules = {n for n, m in model.named_modules() if not list(m.children())}
    assert modules <= set(nodes)


def test_every_site_is_a_node_and_tapped_ones_are_marked() -> None:
    for name in ("resnet", "data_dependent", "untraceable_top", "lstm", "multi_io"):
        model, args, kwargs = zoo.make(name)
        listing = fxprobe.sites(model)
        tapped = fxprobe.tap(model, ops=fxprobe.where(
            lambda s: s.module_type in (nn.Linear, nn.Conv2d) or s.op_key == "add"))
        nodes, _ = parse_dot(fxprobe.to_dot(tapped, show_plumbing=True).source)
        assert set(listing) <= set(nodes), name
        chosen = {s.name for s in listing.records
                  if s.module_type in (nn.Linear, nn.Conv2d) or s.op_key == "add"}
        assert tapped_ids(nodes) == chosen, name
        hooks = {n for n, a in nodes.items() if "fxprobe-hook" in a.get("class", "")}
        assert hooks == {s.name for s in listing.records if s.how == "hook"}, name


def test_shapes_come_from_the_example_input() -> None:
    model, args, _ = zoo.make("resnet")
    paths = [n for n, m in model.named_modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    _, ref = hook_values(model, paths, *args)
    nodes, _ = parse_dot(fxprobe.to_dot(model, args).source)
    for path in paths:
        expected = f"{ref[path].dtype}".removeprefix("torch.") + f" {list(ref[path].shape)}"
        assert nodes[path]["label"].endswith(expected), (path, nodes[path]["label"])
    assert nodes["/output"]["label"] == f"output\\nfloat32 {list(model(*args).shape)}"


def test_shapes_come_from_the_last_forward_of_a_tapped_module() -> None:
    model, args, _ = zoo.make("encoder")
    tapped = fxprobe.tap(model, ops=nn.Linear)
    before, _ = parse_dot(fxprobe.to_dot(tapped).source)
    assert all("float32" not in a["label"] for a in before.values())  # nothing ran yet
    tapped(*args)
    paths = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    _, ref = hook_values(model, paths, *args)
    nodes, _ = parse_dot(fxprobe.to_dot(tapped).source)
    for path in paths:
        assert nodes[path]["label"].endswith(f"float32 {list(ref[path].shape)}")
    assert "float32" not in nodes["norm1"]["label"]  # not tapped, no example input


def test_example_input_leaves_model_taps_rng_and_hooks_alone() -> None:
    model, args, _ = zoo.make("resnet")
    model.train()  # BatchNorm would update its running statistics
    calls: list[str] = []
    model.conv1.register_forward_hook(lambda m, a, o: calls.append("user hook"))
    tapped = fxprobe.tap(model, ops=nn.Conv2d)
    tapped(*args)
    taps_before = {k: v.clone() for k, v in tapped.taps.items()}
    calls.clear()
    x = torch.randn(1, 3, 8, 8) * 5
    state = model_state(model)
    rng = torch.get_rng_state()
    fxprobe.to_dot(model, x)
    fxprobe.to_dot(tapped, x)
    assert calls == []
    assert torch.equal(rng, torch.get_rng_state())
    assert states_equal(state, model_state(model))
    assert taps_before.keys() == tapped.taps.keys()
    assert all(torch.equal(v, tapped.taps[k]) for k, v in taps_before.items())


def test_depth_collapses_deeper_modules() -> None:
    model, args, _ = zoo.make("resnet")
    for depth in (0, 1):
        nodes, edges = parse_dot(fxprobe.to_dot(model, args, ops=nn.Conv2d, depth=depth).source)
        groups = {n.removesuffix("/group") for n in nodes if n.endswith("/group")}
        expected = {n for n, m in model.named_modules()
                    if n and n.count(".") == depth and list(m.children())}
        assert groups == expected
        deepest = max(n.count(".") + 1 for n in nodes if "/" not in n)
        assert deepest <= depth + 1
        assert all(a != b for a, b in edges)
        # a collapsed module holding a tapped conv is marked as holding taps
        convs = {n for n, m in model.named_modules() if isinstance(m, nn.Conv2d)}
        for g in groups:
            holds = any(c.startswith(g + ".") for c in convs)
            assert ("fxprobe-tapped" in nodes[f"{g}/group"]["class"]) == holds


def test_fallback_module_is_drawn_with_its_reason() -> None:
    model, args, _ = zoo.make("data_dependent")
    source = fxprobe.to_dot(model, args).source
    nodes, _ = parse_dot(source)
    lines, first = inspect.getsourcelines(zoo.Gate.forward)
    offset = next(i for i, line in enumerate(lines) if "if x.sum() > 0" in line)
    assert "fxprobe-fallback" in nodes["gate"]["class"]
    tip = nodes["gate"]["tooltip"]
    assert "cannot be used as inputs to control flow" in tip
    assert f"zoo.py:{first + offset}: if x.sum() > 0:" in tip
    assert re.search(r'subgraph "?cluster_gate"? \{\n[^\n]*class="fxprobe-fallback"', source)


def test_top_level_fallback_marks_inputs_and_outputs() -> None:
    model, args, _ = zoo.make("untraceable_top")
    nodes, edges = parse_dot(fxprobe.to_dot(model, args).source)
    assert "fxprobe-fallback" in nodes["/model"]["class"]
    assert ("/input", "/model") in edges and ("/model", "/output") in edges
    assert nodes["/input"]["label"] == f"input\\nfloat32 {list(args[0].shape)}"
    assert nodes["/input"]["shape"] == "invhouse" and nodes["/output"]["shape"] == "house"


def test_sites_that_did_not_run_say_so() -> None:
    model = _examples.gated_mlp()
    x = torch.ones(2, 8)
    went_up = bool(model.embed(x).mean() > 0)  # the branch Router takes, eagerly
    nodes, _ = parse_dot(fxprobe.to_dot(model, x).source)
    skipped = "gate.down.0" if went_up else "gate.up"
    assert nodes[skipped]["label"].endswith("not run")
    ran = "gate.up" if went_up else "gate.down.0"
    assert "float32 [2, 8]" in nodes[ran]["label"]


# -- errors -----------------------------------------------------------------------------------

def test_bad_arguments_raise_config_errors(tmp_path: Path) -> None:
    model, args, _ = zoo.make("resnet")
    tapped = fxprobe.tap(model, ops=nn.Conv2d)
    with pytest.raises(fxprobe.ConfigError, match="depth=-1"):
        fxprobe.to_dot(model, depth=-1)
    with pytest.raises(fxprobe.ConfigError, match="rankdir"):
        fxprobe.to_dot(model, rankdir="up")
    with pytest.raises(fxprobe.ConfigError, match="ops cannot be given with a TappedModule"):
        fxprobe.to_dot(tapped, ops=nn.Linear)
    with pytest.raises(fxprobe.ConfigError, match=r"does not run through ResNetish.*RuntimeError"):
        fxprobe.to_dot(model, torch.randn(2, 5))
    with pytest.raises(fxprobe.ConfigError, match=r"\.svg, \.png, \.pdf, \.dot"):
        tapped.render(tmp_path / "graph.jpeg")
    with pytest.raises(fxprobe.SelectorError, match="matches no site"):
        fxprobe.to_dot(model, ops=nn.LSTM)
    with pytest.raises(fxprobe.ConfigError, match="tracer="):
        fxprobe.to_dot(model, tracer="jit")  # type: ignore[arg-type]


def test_missing_dot_program_is_a_clear_error(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    model, args, _ = zoo.make("shared")
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(fxprobe.RenderError, match=r"needs the Graphviz 'dot'.*apt install"):
        fxprobe.render(model, tmp_path / "g.svg")
    written = fxprobe.render(model, tmp_path / "g.dot", example_input=args)
    assert written.read_text().startswith("// fxprobe.to_dot\ndigraph")


# -- real rendering ---------------------------------------------------------------------------

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


@needs_dot
def test_svg_shows_every_tapped_site_and_marks_fallbacks(tmp_path: Path, dynamo_fails: None
                                                         ) -> None:
    model, args, _ = zoo.make("data_dependent")  # with dynamo failing: gate runs as written
    tapped = fxprobe.tap(model, ops=[nn.Linear, torch.relu])
    tapped(*args)
    path = tapped.render(tmp_path / "dd.svg", example_input=args)
    nodes = svg_nodes(path)
    for site in tapped.sites:
        assert "fxprobe-tapped" in nodes[site.name][0], site.name
    fallback_paths = {f.path for f in tapped.fallbacks}
    assert fallback_paths == {"gate"}
    assert "fxprobe-fallback" in nodes["gate"][0]
    assert "control flow" in nodes["gate"][1]
    assert "fxprobe-fallback" in nodes["cluster_gate"][0]
    assert "fxprobe-hook" in nodes["gate.pos"][0]


@needs_dot
@pytest.mark.parametrize("suffix", ["png", "pdf"])
def test_binary_formats_by_suffix(tmp_path: Path, suffix: str) -> None:
    model, args, _ = zoo.make("shared")
    path = fxprobe.render(model, tmp_path / f"g.{suffix}", example_input=args)
    magic = {"png": b"\x89PNG", "pdf": b"%PDF"}[suffix]
    assert path.read_bytes().startswith(magic)


# -- large graphs -----------------------------------------------------------------------------

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


# -- the examples in the docs -----------------------------------------------------------------

@needs_dot
@pytest.mark.parametrize("doc", ["docs/visualize.md"])
def test_doc_examples_run(doc: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                          capsys: pytest.CaptureFixture[str]) -> None:
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / doc).read_text(), flags=re.S)
    assert blocks, f"{doc} has no python example"
    monkeypatch.chdir(tmp_path)
    scope: dict[str, object] = {"__name__": "__docs__"}
    for i, code in enumerate(blocks):
        try:
            exec(compile(code, f"{doc}[{i}]", "exec"), scope)
        except Exception as e:
            raise AssertionError(f"{doc} example {i} failed: {e!r}\n{code}") from e


# -- shape plumbing and inputs with defaults ------------------------------------------------

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
    folded, edges = parse_dot(fxprobe.to_dot(model, x).source)
    shown, shown_edges = parse_dot(fxprobe.to_dot(model, x, show_plumbing=True).source)
    optional = [f"blocks.{i}.{n}" for i in range(3) for n in ("attn_mask", "is_causal")]
    assert set(optional) <= set(shown)
    assert not set(optional) & set(folded)
    notes = [n for n, a in folded.items() if a.get("label", "").startswith("inputs with defaults")]
    assert notes == [f"blocks.{i}/optional" for i in range(3)]
    assert all("attn_mask (default None)" in folded[n]["label"]
               and "is_causal (default False)" in folded[n]["label"] for n in notes)
    assert not [e for e in edges if e[0] in notes or e[1] in notes]
    assert len(edges) < len(shown_edges)


# -- graphs torch dynamo captured -------------------------------------------------------------

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
def test_dynamo_graphs_are_drawn_op_by_op(tmp_path: Path) -> None:
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
    assert tapped.captures and not tapped.fallbacks
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
    # A new sequence length: dynamo captures the frame again; only the newest is drawn.
    with torch.no_grad():
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
    assert [c.path for c in tapped.captures] == ["gate"]
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


# -- big models: what is folded, what is outlined, what a collapsed module says -------------

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
def test_timm_vit_at_depth_2_is_at_most_6000_px_tall() -> None:
    import subprocess

    from test_features import TV_PYTHON

    if not TV_PYTHON.exists():
        pytest.skip(f"no venv with timm at {TV_PYTHON}")
    run = subprocess.run([str(TV_PYTHON), "-c", _VIT_SCRIPT],
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
                         text=True)
    if run.returncode != 0 and "No module named 'timm'" in run.stderr:
        pytest.skip(f"{TV_PYTHON} has no timm")
    assert run.returncode == 0, run.stderr[-3000:]
    heights = dict(line.split() for line in run.stdout.splitlines())
    assert int(heights["depth"]) <= 6000, heights  # 11,885 px before folding
    assert int(heights["focus"]) <= 6000, heights
