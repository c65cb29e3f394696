"""The ``fxprobe`` command: ``python -m fxprobe`` in subprocesses (run side by side), and its
parsing in process."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
import types
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
import zoo
from torch import nn

import fxprobe
from fxprobe import cli as _cli
from fxprobe.cli import app as _app
from fxprobe.cli import arguments as _arguments
from fxprobe.cli import commands as _commands
from fxprobe.core.errors import UsageError

MODELS = textwrap.dedent("""\
    import torch.nn as nn

    class Gate(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 4)

        def forward(self, x):
            return self.a(x) if x.sum() > 0 else x

    def good():
        return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), Gate())

    def lm():
        return nn.Sequential(nn.Embedding(30, 4), nn.Linear(4, 3))

    def not_module():
        return [1, 2]

    def broken():
        raise ValueError("no weights here")

    instance = nn.Linear(2, 2)
    """)

HAS_DOT = shutil.which("dot") is not None
FXPROBE = [sys.executable, "-m", "fxprobe"]  # this interpreter's, whatever PATH holds

# name -> (command, expected exit status, text expected in stdout or stderr)
COMMANDS: dict[str, tuple[list[str], int, str]] = {
    "demo": ([*FXPROBE, "demo"], 0, "wrote fxprobe-demo.svg"),
    "bad spec": ([*FXPROBE, "sites", "models.py"], 2,
                 "is not package.module:factory or path/to/file.py:factory"),
    "missing file": ([*FXPROBE, "graph", "nowhere/models.py:good"], 2,
                     "no such file: nowhere/models.py"),
    "missing factory": ([*FXPROBE, "sites", "models.py:godo"], 2,
                        "models.py has no 'godo' (MODEL 'models.py:godo'). Did you mean 'good'?"),
    "not a module": ([*FXPROBE, "graph", "models.py:not_module"], 2,
                     "returned list, not a torch.nn.Module"),
    "bad input": ([*FXPROBE, "graph", "models.py:good", "--input", "3xq"], 2,
                  "--input '3xq': sizes must be positive integers"),
    "huge input": ([*FXPROBE, "graph", "models.py:good", "--input", "100000x100000x100000"], 2,
                   "--input '100000x100000x100000' would take"),
    "missing folder": ([*FXPROBE, "graph", "models.py:good", "-o", "/nonexistent/a.svg"], 2,
                       "the folder '/nonexistent' does not exist"),
    "empty ops": ([*FXPROBE, "sites", "models.py:good", "--ops", ""], 2,
                  "--ops was given but is empty"),
    # torch.export.load logs a traceback before it raises: neither may show.
    "text as pt2": ([*FXPROBE, "sites", "text.pt2"], 2,
                    "cannot load text.pt2: it is not a zip archive; a .pt MODEL must be written "
                    "by torch.jit.save, a .pt2 MODEL by torch.export.save"),
    "zip as pt2": ([*FXPROBE, "graph", "other.pt2"], 2, "cannot load other.pt2: RuntimeError:"),
    "text as pt": ([*FXPROBE, "sites", "text.pt"], 2, "cannot load text.pt: it is not a zip"),
}


# Run as a process of their own: the demo (the README's command), and the loads that torch
# logs a traceback for (a process's own logging, which pytest's would hide). The other bad
# inputs run in this process (``_cli.main``), their output read from the file descriptors.
SUBPROCESS = ("demo", "text as pt2", "zip as pt2", "text as pt")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every command of SUBPROCESS, started together (each pays for importing torch), each
    waited for until it exits, however long a loaded machine takes."""
    # This checkout's fxprobe (an editable install may point to another worktree).
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    results: dict[str, Any] = {}
    procs = {}
    for name in SUBPROCESS:
        cmd = COMMANDS[name][0]
        cwd = tmp_path_factory.mktemp(name.replace(" ", "_"))
        (cwd / "models.py").write_text(MODELS)
        (cwd / "text.pt2").write_text("not a program\n")
        (cwd / "text.pt").write_text("not a program\n")
        with zipfile.ZipFile(cwd / "other.pt2", "w") as z:
            z.writestr("notes.txt", "a zip archive, not a saved program")
        procs[name] = (subprocess.Popen(cmd, cwd=cwd, env=env, text=True,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE), cwd)
    for name, (proc, cwd) in procs.items():
        out, err = proc.communicate()
        results[name] = types.SimpleNamespace(rc=proc.returncode, out=out, err=err, cwd=cwd)
    return results


def _in_process(name: str, cwd: Path, capfd: pytest.CaptureFixture[str]) -> Any:
    """COMMANDS[name] through ``_cli.main`` in ``cwd``, as ``python -m fxprobe`` runs it."""
    (cwd / "models.py").write_text(MODELS)
    (cwd / "text.pt").write_text("not a program\n")
    capfd.readouterr()
    try:
        rc = _cli.main(COMMANDS[name][0][len(FXPROBE):])
    except SystemExit as e:  # argparse's own errors
        rc = e.code
    out, err = capfd.readouterr()
    return types.SimpleNamespace(rc=rc, out=out, err=err, cwd=cwd)


@pytest.mark.parametrize("name", [n for n, c in COMMANDS.items() if c[1] == 2])
def test_bad_input_is_one_line_exit_2_no_traceback(
        runs: dict[str, Any], name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capfd: pytest.CaptureFixture[str]) -> None:
    if name in runs:
        r = runs[name]
    else:
        monkeypatch.chdir(tmp_path)
        r = _in_process(name, tmp_path, capfd)
    _, status, text = COMMANDS[name]
    assert r.rc == status, r.err
    assert "Traceback" not in r.err and r.out == ""
    assert len(r.err.strip().splitlines()) == 1, r.err
    assert r.err.startswith("fxprobe ") and text in r.err


def test_demo_prints_summary_and_writes_picture(runs: dict[str, Any]) -> None:
    r = runs["demo"]
    assert r.rc == 0, r.err
    # the summary table: one row per tapped site, the fallback under it
    for site in ("stem.0", "block.conv1", "block.add", "flatten", "head.quick"):
        assert f"\n{site} " in r.out
    # the head, which torch.fx cannot trace, ran under torch dynamo (tracer="auto")
    assert "head: 2 graph(s) captured by dynamo" in r.out
    assert "\nhead.quick     Linear         dynamo" in r.out
    if HAS_DOT:
        assert "wrote fxprobe-demo.svg" in r.out
        assert (r.cwd / "fxprobe-demo.svg").read_bytes().startswith(b"<?xml")
    else:
        assert (r.cwd / "fxprobe-demo.dot").exists()


# -- in process -------------------------------------------------------------------------------

@pytest.fixture
def models(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "models.py").write_text(MODELS)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_sites_and_graph_commands(models: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _cli.main(["sites", "models.py:good", "--ops", "module:Linear"]) == 0
    table, _, notes = capsys.readouterr().out.partition("\n\n")
    lines = table.splitlines()
    assert lines[0].split() == ["name", "op", "module", "path", "how"]
    assert [line.split() for line in lines[2:]] == [["0", "Linear", "0", "fx"],
                                                   ["2.a", "Linear", "2.a", "hook"]]
    assert "runs as written (hook fallback): 2 (Gate)" in notes
    assert _cli.main(["sites", "models.py:good", "--format", "github"]) == 0
    assert capsys.readouterr().out.startswith("| name ")

    out = "g.svg" if HAS_DOT else "g.dot"
    assert _cli.main(["graph", "models.py:good", "-o", out, "--ops", "how:hook"]) == 0
    assert capsys.readouterr().out == f"wrote {out}\n"
    text = (models / out).read_text()
    assert "2.a" in text and "fallback" in text  # before a forward: as fx and hooks see it
    # with an example input, captured as fxprobe.tap does: the Gate under torch dynamo
    assert _cli.main(["graph", "models.py:good", "--input", "3x4", "-o", out,
                      "--ops", "how:dynamo"]) == 0
    assert capsys.readouterr().out == f"wrote {out}\n"
    text = (models / out).read_text()
    assert "2.a" in text and "torch dynamo" in text and "float32 [3, 4]" in text
    if HAS_DOT:  # the default output is named after the factory
        assert _cli.main(["graph", "models.py:good", "--depth", "0", "--rankdir", "LR"]) == 0
        assert capsys.readouterr().out == "wrote good.svg\n"


@pytest.mark.parametrize("argv, text", [
    (["sites", "models.py:broken"], "calling models.py:broken() raised ValueError: no weights"),
    (["sites", "no_such_package_xyz.models:make"], "no module named 'no_such_package_xyz'"),
    (["sites", "models.py:"], "is not package.module:factory"),
    (["sites", "models.py:good", "--ops", "modul:Linear"], "unknown selector 'modul:'"),
    (["sites", "models.py:good", "--ops", "module:Conv2d"], "matches no site"),
    (["sites", "models.py:good", "--ops", "function:torch.flaten"],
     "cannot find a function 'torch.flaten'"),
    (["sites", "models.py:good", "--ops", "re:("], "not a regular expression"),
    (["graph", "models.py:good", "--input", "2x5"], "does not run through Sequential"),
    (["graph", "models.py:good", "--input", "2x4:complex7"], "unknown dtype 'complex7'"),
    (["graph", "models.py:lm", "--input", "1x16"],
     "'0' is an nn.Embedding, which needs integer indices, and the example input is float32. "
     "Give int64 ids: on the command line --input 1x16:int64"),
    (["graph", "models.py:good", "-o", "g.jpeg"], "cannot tell the format"),
    (["sites", "models.py:good", "--tracer", "fx"], "could not trace"),
])
def test_errors_in_process(models: Path, argv: list[str], text: str,
                           capsys: pytest.CaptureFixture[str]) -> None:
    assert _cli.main(argv) == 2
    err = capsys.readouterr().err
    assert text in err and "Traceback" not in err


def test_missing_dot_program_exits_1_with_hint(models: Path, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("PATH", str(models))
    assert _cli.main(["graph", "models.py:good", "-o", "g.svg"]) == 1
    assert "install Graphviz" in capsys.readouterr().err
    assert _cli.main(["graph", "models.py:good", "-o", "g.dot"]) == 0
    assert (models / "g.dot").read_text().startswith("// fxprobe.to_dot")


def test_token_ids_as_the_hint_says(models: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _cli.main(["graph", "models.py:lm", "--input", "1x16:int64", "-o", "lm.dot"]) == 0
    assert "int64 [1, 16]" in (models / "lm.dot").read_text()


def test_model_specs_that_work(models: Path) -> None:
    model, name = _arguments.load_model("models.py:instance")  # a module-level model
    assert isinstance(model, nn.Linear) and name == "instance"
    model, _ = _arguments.load_model("fxprobe.examples:small_cnn")
    assert type(model).__name__ == "SmallCNN"
    model, _ = _arguments.load_model(f"{models / 'models.py'}:good")  # an absolute path
    assert isinstance(model, nn.Sequential)


def test_parse_inputs() -> None:
    a, b, c = _arguments.parse_inputs(["1x3x8x8", "2x5:int64,4:bool"])
    assert a.shape == (1, 3, 8, 8) and a.dtype == torch.float32 and a.std() > 0
    assert b.shape == (2, 5) and b.dtype == torch.int64 and not b.any()
    assert c.dtype == torch.bool
    assert torch.equal(_arguments.parse_inputs(["1x3x8x8"])[0], a)  # seeded
    for bad in ("", "0x3", "1x-3", "1x3:float7", "3,,"):
        with pytest.raises(UsageError, match="--input"):
            _arguments.parse_inputs([bad])


def test_selectors_match_what_they_say() -> None:
    model, args, _ = zoo.make("resnet")
    records = fxprobe.sites(model).records

    def chosen(text: str) -> list[str]:
        sel = _arguments.parse_selector(text)
        return [s.name for s in records if sel(s)]

    convs = [n for n, m in model.named_modules() if isinstance(m, nn.Conv2d)]
    assert chosen("module:Conv2d") == convs
    assert chosen("module:nn.Conv2d") == convs == chosen("module:torch.nn.Conv2d")
    blocks = [n for n, m in model.named_modules() if type(m).__name__ == "BasicBlock"]
    assert blocks and chosen("module:BasicBlock") == []  # traced through: no call site
    assert chosen("function:torch.flatten") == ["flatten"] == chosen("fn:torch.flatten")
    adds = [n for n in fxprobe.sites(model).names if n.endswith(".add")]
    assert chosen("op:add") == adds == chosen("function:operator.add")
    assert chosen("layer2.0.*conv?") == ["layer2.0.conv1", "layer2.0.conv2"]
    assert chosen(r"re:downsample\.0$") == ["layer2.0.downsample.0"]
    assert chosen("how:hook") == []
    assert chosen("name:fc") == ["fc"]
    enc = fxprobe.sites(zoo.make("encoder")[0]).records
    sel = _arguments.parse_selector("method:transpose")
    assert [s.name for s in enc if sel(s)] == ["attn.transpose", "attn.transpose_1"]
    gated = fxprobe.sites(zoo.make("data_dependent")[0]).records
    sel = _arguments.parse_selector("how:hook")
    assert [s.name for s in gated if sel(s)] == ["gate.pos"]
    sel = _arguments.parse_selector("module:zoo.Gate")  # a dotted path to the user's class
    assert [s.name for s in gated if sel(s)] == ["gate"]


def test_help_is_complete(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        _cli.main(["--help"])
    assert exit_.value.code == 0
    top = capsys.readouterr().out
    for command in ("sites", "graph", "demo", "bench"):
        assert f"    {command}" in top
    for command, options in (("sites", ["--ops", "--tracer", "--train", "--format", "module:"]),
                             ("graph", ["--ops", "-o", "--depth", "--input", "--rankdir",
                                        "--show-plumbing", "function:torch.add", "MODEL is"]),
                             ("demo", ["-o", "--format"])):
        with pytest.raises(SystemExit):
            _cli.main([command, "--help"])
        text = capsys.readouterr().out
        assert all(o in text for o in options), (command, text)
    assert _cli.main([]) == 2
    assert "usage: fxprobe" in capsys.readouterr().err


def test_bench_runs_the_checkout_benchmarks_or_says_why(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    seen: list[list[str]] = []
    fake = types.ModuleType("benchmarks.__main__")
    fake.main = lambda argv: seen.append(argv) or 0  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "benchmarks.__main__", fake)
    assert _cli.main(["bench", "--quick", "--models", "resnet"]) == 0
    assert seen == [["--quick", "--models", "resnet"]]

    monkeypatch.setitem(sys.modules, "benchmarks", None)  # not importable
    monkeypatch.delitem(sys.modules, "benchmarks.__main__")
    code = _app._run(lambda: _commands.bench(["--quick"], checkout=tmp_path), "bench")
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "benchmarks live in fxprobe's source repository" in err


def test_python_m_fxprobe_is_the_demo(models: Path, monkeypatch: pytest.MonkeyPatch,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    import runpy

    monkeypatch.setattr(sys, "argv", ["fxprobe", "-o", "m.dot"])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_module("fxprobe", run_name="__main__")
    assert exit_.value.code == 0
    assert "wrote m.dot" in capsys.readouterr().out
    assert (models / "m.dot").read_text().startswith("// fxprobe.to_dot")


# -- artifacts and factory keywords -------------------------------------------------------------

SIZED = textwrap.dedent("""\
    import torch, torch.nn as nn

    class Patches(nn.Module):  # checks its input size as torchvision's ViT does
        def __init__(self, image_size=8):
            super().__init__()
            self.image_size = image_size
            self.proj = nn.Conv2d(3, 4, 2, stride=2)

        def forward(self, x):
            torch._assert(x.shape[2] == self.image_size,
                          f"Expected {self.image_size} but got {x.shape[2]}")
            return self.proj(x).flatten(1)

    def patches(image_size=8, bias=True):
        m = Patches(image_size)
        if not bias:
            m.proj.bias = None
        return m
    """)


@pytest.fixture(scope="module")
def saved_artifacts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The scripted and the exported model, saved once for the module (each test reads a copy
    of its own: scripting and exporting were most of each test's time)."""
    path = tmp_path_factory.mktemp("artifacts")
    model, args, _ = zoo.make("resnet")
    torch.jit.save(torch.jit.script(model), path / "m.pt")
    torch.export.save(torch.export.export(model, args), path / "m.pt2")
    return path


@pytest.fixture
def artifacts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, saved_artifacts: Path) -> Path:
    monkeypatch.chdir(tmp_path)
    for name in ("m.pt", "m.pt2"):
        shutil.copyfile(saved_artifacts / name, tmp_path / name)
    (tmp_path / "sized.py").write_text(SIZED)
    return tmp_path


@pytest.mark.parametrize("artifact, said", [("m.pt", "ResNetish (TorchScript)"),
                                            ("m.pt2", "ExportedProgram (torch.export)")])
def test_wrong_input_for_an_artifact_is_one_line_exit_2(
        artifacts: Path, capsys: pytest.CaptureFixture[str], artifact: str, said: str) -> None:
    assert _cli.main(["graph", artifact, "--input", "1x5", "-o", "g.dot"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert f"the example input (float32 [1, 5]) does not run through {said}" in err
    assert not (artifacts / "g.dot").exists()


@pytest.mark.parametrize("artifact, how", [("m.pt", "TorchScript graph"),
                                           ("m.pt2", "torch.export graph")])
def test_artifact_footer_says_which_graph(artifacts: Path, capsys: pytest.CaptureFixture[str],
                                          artifact: str, how: str) -> None:
    assert _cli.main(["sites", artifact]) == 0
    out = capsys.readouterr().out
    footer = out.strip().splitlines()[-1]
    rows = len(out.partition("\n\n")[0].splitlines()) - 2
    assert footer == f"{rows} sites: {rows} at op level ({how})", footer
    assert "(fx)" not in out


@pytest.mark.parametrize("kind", ["script", "export"])
def test_sites_of_a_tapped_artifact_lists_every_tap(
        artifacts: Path, capsys: pytest.CaptureFixture[str], kind: str) -> None:
    model, args, _ = zoo.make("resnet")
    if kind == "script":  # module calls fx would trace through are taps of their own here
        tapped = fxprobe.tap(torch.jit.script(model), ops=["layer1", "layer2.0", "fc"])
        names = list(tapped.script_module.fxprobe_names)
        tapped.save("t.pt")
        path = "t.pt"
    else:
        tapped = fxprobe.tap(torch.export.export(model, args), ops=["layer1", "fc"])
        out = tapped.exported().module()(*args)[1]
        names = [s.name for s in tapped.sites]
        assert len(out) == len(names)  # what the program returns, independently counted
        torch.export.save(tapped.exported(), "t.pt2")
        path = "t.pt2"
    assert _cli.main(["sites", path]) == 0
    out = capsys.readouterr().out
    listed = [line.split()[0] for line in out.partition("\n\n")[0].splitlines()[2:]]
    assert sorted(listed) == sorted(names) and len(names) >= 2, (listed, names)


def test_kw_passes_factory_keywords_as_literals(
        artifacts: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _arguments.parse_kw(["image_size=64", "act=gelu", "p=0.5", "s=(2, 2)",
                                "name='x y'", "flag=False"]) == {
        "image_size": 64, "act": "gelu", "p": 0.5, "s": (2, 2), "name": "x y", "flag": False}
    for bad, said in [("image_size", "write NAME=VALUE"), ("2x=1", "write NAME=VALUE"),
                      ("a=[1,", "is not a Python literal")]:
        with pytest.raises(UsageError, match=re.escape(said)):
            _arguments.parse_kw([bad])
    with pytest.raises(UsageError, match="given twice"):
        _arguments.parse_kw(["a=1", "a=2"])
    model, _ = _arguments.load_model("sized.py:patches", {"image_size": 4, "bias": False})
    assert model.image_size == 4 and model.proj.bias is None
    with pytest.raises(UsageError, match="for a factory MODEL"):
        _arguments.load_model("m.pt", {"image_size": 4})
    with pytest.raises(UsageError, match=r"patches\(colour=1\) raised TypeError"):
        _arguments.load_model("sized.py:patches", {"colour": 1})
    # The factory's default size does not fit the input: the model is named, --kw suggested,
    # fx's Proxy(...) wording is not shown.
    assert _cli.main(["graph", "sized.py:patches", "--input", "1x3x4x4", "-o", "p.dot"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert "MODEL sized.py:patches" in err and "--kw" in err and "Proxy(" not in err, err
    assert _cli.main(["graph", "sized.py:patches", "--kw", "image_size=4", "--input",
                      "1x3x4x4", "-o", "p.dot"]) == 0
    assert "float32 [1, 4, 2, 2]" in (artifacts / "p.dot").read_text()  # Conv2d, 4x4 -> 2x2
