"""The command line reaches every frontend: with an example input (``--tokens``, ``--input``)
``fxprobe sites`` and ``fxprobe graph`` capture a model as ``fxprobe.tap`` does (torch dynamo
where fx cannot trace: a Hugging Face GPT-2) and list each site with its canonical name.

The reference for the listing is ``fxprobe.tap`` on the same model and input; for the values
behind the canonical names, transformers' own ``output_hidden_states``.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest
import torch

import fxprobe
from fxprobe.cli import main

transformers = pytest.importorskip("transformers")

_MODEL = textwrap.dedent("""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    def gpt2():
        torch.manual_seed(0)
        config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=32,
                            bos_token_id=0, eos_token_id=0)
        return GPT2LMHeadModel(config).eval()
""")


@pytest.fixture(scope="module")
def spec(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("models") / "hf_tiny.py"
    path.write_text(_MODEL)
    return f"{path}:gpt2"


def _model(spec: str) -> torch.nn.Module:
    from fxprobe.cli.arguments import load_model

    return load_model(spec)[0]


def _rows(out: str) -> list[dict[str, str]]:
    """The rows of a ``--format github`` table, by column name."""
    lines = [x for x in out.splitlines() if x.startswith("|")]
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    return [dict(zip(head, (c.strip() for c in x.strip("|").split("|")), strict=True))
            for x in lines[2:]]


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_sites_with_tokens_list_what_tap_finds_with_canonical_names(
        spec: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(["sites", spec, "--tokens", "1x8", "--format", "github"], capsys)
    assert code == 0, err
    assert "Traceback" not in err and "torch._dynamo" not in err and "WARNING" not in err
    rows = _rows(out)
    ids = torch.zeros(1, 8, dtype=torch.long)
    tapped = fxprobe.tap(_model(spec))  # every site, as the listing finds them
    with torch.no_grad():
        tapped(ids)
    known = tapped.known_sites()
    assert [r["name"] for r in rows] == [s.name for s in known.records]
    assert [r["canonical"] for r in rows] == [", ".join(s.canonical) for s in known.records]
    assert [r["how"] for r in rows] == [s.how for s in known.records]
    assert {"blocks.0.resid_post", "blocks.1.resid_post", "embed"} <= {
        c for s in known.records for c in s.canonical}
    # fxprobe.sites(model, example_input=ids), which the command calls, tabulates the same
    assert "canonical" in str(known.table())


def test_sites_selects_by_canonical_name_and_the_values_are_the_hidden_states(
        spec: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(["sites", spec, "--tokens", "1,8", "--ops", "blocks.*.resid_post",
                           "--format", "github"], capsys)
    assert code == 0, err
    names = [r["name"] for r in _rows(out)]
    model = _model(spec)
    tapped = fxprobe.tap(model, ops="blocks.*.resid_post")
    ids = torch.arange(8).reshape(1, 8)
    with torch.no_grad():
        tapped(ids)
        states = model(ids, output_hidden_states=True).hidden_states
    assert names == list(tapped.taps) and len(names) == 2
    # blocks.0.resid_post is the residual stream after block 0 (the last one has ln_f after it)
    torch.testing.assert_close(tapped.taps[names[0]], states[1])


def test_sites_without_an_example_input_say_how_to_reach_dynamo(
        spec: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(["sites", spec], capsys)
    assert code == 0, err
    assert "with torch dynamo at the first forward" in out and "--tokens" in out
    code, out, err = _run(["sites", spec, "--ops", "blocks.*.resid_post"], capsys)
    assert code == 2 and "matches no site" in err


def test_graph_with_tokens_draws_dynamo_graph_and_marks_the_selection(
        spec: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_path = tmp_path / "gpt2.dot"
    code, out, err = _run(["graph", spec, "--tokens", "1x8", "--ops", "blocks.*.resid_post",
                           "-o", str(out_path)], capsys)
    assert code == 0, err
    assert "Traceback" not in err and "torch._dynamo" not in err
    source = out_path.read_text()
    tapped_nodes = set(re.findall(r'^\s*"([^"]+)" \[[^\n]*fxprobe-tapped', source, flags=re.M))
    tapped = fxprobe.tap(_model(spec), ops="blocks.*.resid_post")
    with torch.no_grad():
        tapped(torch.zeros(1, 8, dtype=torch.long))
    assert tapped_nodes == set(tapped.taps)
    assert "runs under torch dynamo" in source
    assert "= blocks.0.resid_post, blocks.1.resid_pre" in source
    assert "float32 [1, 8, 32]" in source  # shapes of the forward that ran


def test_bad_tokens_are_one_line_errors(spec: str, capsys: pytest.CaptureFixture[str]) -> None:
    for bad in ("16", "1x0", "ax16", "1x2x3"):
        code, _, err = _run(["sites", spec, "--tokens", bad], capsys)
        assert code == 2 and "--tokens" in err and "BATCHxLENGTH" in err, err


class _Gate(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bn = torch.nn.BatchNorm1d(4)
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.bn(x)
        return self.fc(x) if x.sum() > 0 else -x  # fx cannot trace it: dynamo captures it


def test_drawing_a_train_mode_model_for_an_input_leaves_its_buffers() -> None:
    from fxprobe.runtime.views import view_for_input

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), _Gate()).train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(8, 4) + 3
    view = view_for_input(model, (x,), ops="1.fc", train=True)
    assert [s.name for s in view.selected] == ["1.fc"] and view.selected[0].how == "dynamo"
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # running stats untouched
    assert model.training
