"""Graph export: DOT golden files, structure against torch.fx and eager hooks, real rendering.

Golden files live in tests/golden/; after a deliberate change to the drawing, regenerate them
with ``FXPROBE_REGEN_GOLDEN=1 pytest tests/test_viz.py`` and review the diff.
"""

from __future__ import annotations

import difflib
import inspect
import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import zoo
from reference import hook_values, model_state, states_equal
from torch import fx, nn
from viz_support import (
    ROOT,
    needs_dot,
    parse_dot,
    svg_nodes,
    tapped_ids,
)

import fxprobe
from fxprobe import examples as _examples

GOLDEN = Path(__file__).resolve().parent / "golden"


REGEN = os.environ.get("FXPROBE_REGEN_GOLDEN") == "1"


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

