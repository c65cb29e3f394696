"""Smoke test of the benchmark suite: the structure of what it writes, never its timings."""

from __future__ import annotations

import dataclasses
import gc
import json
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

# The suite lives outside the wheel, at the repository root; plain `pytest` (unlike
# `python -m pytest`) does not put that on sys.path.
_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from benchmarks import records, report  # noqa: E402
from benchmarks.__main__ import main  # noqa: E402
from benchmarks.modes import MODES, Mode, availability  # noqa: E402

APPROACHES = {"A/A control", "traced (no taps)", "taps", "module hooks", "global hook",
              "logging hook"}


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("bench")
    torch_threads = torch.get_num_threads()
    gc.freeze()  # the suite's gc.collect() after each group: only what the run made
    try:
        rc = main(["--quick", "--models", "chain", "--modes", "reference,stats",
                   "--rounds", "2", "--threads", "1", "--out", str(out), "--quiet",
                   "--no-plot"])
    finally:
        gc.unfreeze()
        torch.set_num_threads(torch_threads)
    assert rc == 0
    return out


def test_json_records_have_every_field(quick_run: Path) -> None:
    data = json.loads((quick_run / "results.json").read_text())
    assert data["schema"] == records.SCHEMA
    env_fields = {f.name for f in dataclasses.fields(records.Environment)}
    assert set(data["environment"]) == env_fields
    assert data["environment"]["quick"] is True
    assert data["environment"]["threads"] == 1
    fields = {f.name for f in dataclasses.fields(records.Measurement)}
    assert data["measurements"]
    for m in data["measurements"]:
        assert set(m) == fields
        assert m["status"] in ("ok", "unavailable", "failed")
        for key in ("device_name", "torch_version", "dtype"):
            assert isinstance(m[key], str) and m[key]
        assert m["threads"] == 1
    assert data["compile"] == []
    assert any("torch.compile" in s for s in data["skipped"])


def test_measurements_cover_the_approaches_and_phases(quick_run: Path) -> None:
    results = records.read_json(quick_run / "results.json")
    ok = [m for m in results.measurements if m.status == "ok"]
    assert {m.approach for m in ok} == APPROACHES
    assert {m.phase for m in ok} == {"inference", "train"}
    assert {m.mode for m in ok} == {"-", "reference", "stats"}
    for m in ok:
        assert m.rounds == 2 and m.iters >= 1
        assert len(m.samples_ms) == len(m.baseline_samples_ms) == m.rounds
        assert m.overhead_us_ci_low is not None and m.overhead_us_ci_high is not None
        assert m.overhead_us_ci_low <= m.overhead_us <= m.overhead_us_ci_high  # type: ignore[operator]
        assert m.baseline_ms is not None and m.treatment_ms is not None
        assert m.ratio_p5 is not None and m.ratio_p95 is not None
        assert m.ratio_p5 <= m.ratio <= m.ratio_p95  # type: ignore[operator]
    taps_all = report.find(results, approach="taps", mode="reference", density="all",
                           phase="inference")
    hooks_all = report.find(results, approach="module hooks", mode="reference",
                            density="all", phase="inference")
    assert taps_all is not None and hooks_all is not None
    # Same module calls on both sides; a hook fires once per call.
    assert taps_all.n_sites == hooks_all.n_sites == 200
    assert taps_all.stale_values == 0 and hooks_all.stale_values == 0
    stats = report.find(results, approach="taps", mode="stats", density="all")
    assert stats is not None and stats.floor_us is not None and stats.floor_us > 0


def test_markdown_report(quick_run: Path) -> None:
    md = (quick_run / "results.md").read_text()
    for heading in ("## Targets", "## Host cost per site", "## Every inference measurement",
                    "## Capture modes", "## Training step", "## torch.compile"):
        assert heading in md
    assert "| model " in md and "--quick" in md


def test_from_json_rerenders_and_refuses_to_publish_quick_results(quick_run: Path,
                                                                  tmp_path: Path) -> None:
    docs = tmp_path / "bench.md"
    docs.write_text("x\n<!-- BEGIN GENERATED RESULTS: cpu -->\nold\n"
                    "<!-- END GENERATED RESULTS: cpu -->\ny\n")
    args = ["--from-json", str(quick_run / "results.json"), "--out", str(tmp_path / "r"),
            "--quiet", "--no-plot"]
    assert main(args) == 0
    assert (tmp_path / "r" / "results.md").exists()
    assert main([*args, "--docs", str(docs)]) == 1
    assert "old" in docs.read_text()
    report.update_docs(records.read_json(quick_run / "results.json"), docs)
    text = docs.read_text()
    assert "old" not in text and "\n### Targets\n" in text
    assert text.startswith("x\n<!-- BEGIN") and text.endswith("-->\ny\n")


def test_bad_arguments_return_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--models", "resnet5"]) == 2
    assert "resnet50" in capsys.readouterr().err
    assert main(["--modes", "nope"]) == 2
    assert main(["--list"]) == 0
    assert "gpt2" in capsys.readouterr().out


def test_a_mode_this_build_lacks_is_reported_unavailable() -> None:
    fake = Mode("future", "", lambda dev: {"no_such_option": True}, MODES["reference"].hook)
    why = availability(fake, torch.device("cpu"))
    assert why is not None and why.startswith("unavailable in this build")
    assert availability(MODES["reference"], torch.device("cpu")) is None


def test_hooks_are_gone_after_a_run(quick_run: Path) -> None:
    # The suite installs hooks only around its own slots; a module built now sees none.
    assert not nn.modules.module._global_forward_hooks


def test_bandwidth_probe_records_how_it_read(quick_run: Path) -> None:
    env = records.read_json(quick_run / "results.json").environment
    assert env.read_gbps > 0 and env.copy_gbps > 0
    assert "fastest of sum" in env.read_basis and "amax" in env.read_basis


def test_results_are_written_as_they_are_produced(tmp_path: Path, young_gc: None) -> None:
    from benchmarks.suite import Config, run

    seen: list[records.Results] = []
    threads = torch.get_num_threads()
    try:
        final = run(Config(device=torch.device("cpu"), quick=True, models=("chain",),
                           modes=("reference",), dtype=torch.float32, threads=1, rounds=1,
                           progress=False), on_partial=seen.append)
    finally:
        torch.set_num_threads(threads)
    assert len(seen) >= 2  # one per group
    assert len(seen[0].measurements) < len(final.measurements)
    assert "incomplete run" in seen[0].skipped[0]
    assert seen[-1].measurements == final.measurements
    assert "incomplete run: 0 of" in seen[-1].skipped[0]


def test_from_json_merges_runs_of_one_device(quick_run: Path, tmp_path: Path) -> None:
    base = records.read_json(quick_run / "results.json")
    other = dataclasses.replace(
        base, environment=dataclasses.replace(base.environment, fxprobe_commit="abc1234"),
        measurements=tuple(dataclasses.replace(m, model="mlp") for m in base.measurements))
    second = tmp_path / "second.json"
    records.write_json(other, second)
    out = tmp_path / "merged"
    assert main(["--from-json", str(quick_run / "results.json"), str(second), "--out", str(out),
                 "--quiet", "--no-plot"]) == 0
    md = (out / "results.md").read_text()
    assert f"{base.environment.fxprobe_commit} / abc1234" in md
    assert "| mlp " in md and "| chain " in md
    merged = records.merge([base, other])
    assert len(merged.measurements) == 2 * len(base.measurements)
    cuda = dataclasses.replace(other, environment=dataclasses.replace(
        other.environment, device="cuda"))
    with pytest.raises(ValueError, match="device"):
        records.merge([base, cuda])
    records.write_json(cuda, second)
    assert main(["--from-json", str(quick_run / "results.json"), str(second), "--out",
                 str(out), "--quiet", "--no-plot"]) == 2


def test_cuda_before_records_render() -> None:
    # The H200 records of commit 97755d0 that docs/benchmarks.md shows as the "before".
    root = Path(_ROOT) / "benchmarks" / "results" / "cuda-h200-before"
    runs = [records.read_json(root / f"{n}.json") for n in ("gpt2", "resnet50", "chain_mlp")]
    merged = records.merge(runs)
    assert merged.environment.device == "cuda" and "H200" in merged.environment.device_name
    assert merged.environment.fxprobe_commit == "97755d0"
    assert {m.model for m in merged.measurements} == {"gpt2", "resnet50", "chain", "mlp"}
    assert "## Targets" in report.markdown(merged)


def test_instruction_counts_are_read_from_callgrind_dumps(tmp_path: Path) -> None:
    from benchmarks.instructions import _totals, main

    dump = tmp_path / "cg.out.1"
    dump.write_text("version: 1\ncreator: callgrind-3.19.0\nevents: Ir DLmr DLmw\n"
                    "fn=(1) f\n0 5 1 0\nsummary: 1234567 89 10\ntotals: 1234567 89 10\n")
    assert _totals(dump) == {"Ir": 1234567, "DLmr": 89, "DLmw": 10}
    dump.write_text("not a dump\n")
    with pytest.raises(SystemExit, match="not a callgrind dump"):
        _totals(dump)
    with pytest.raises(SystemExit):  # two counts, the first smaller
        main(["--calls", "15,5"])
