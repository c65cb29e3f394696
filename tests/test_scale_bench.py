"""benchmarks/scale.py runs end to end at a tiny size (2 layers, one repeat), so that it does
not rot: every approach gives a row (nnsight's says it is not installed where it is not), the
approaches record the same values, and the JSON and Markdown records are written."""

from __future__ import annotations

import importlib.util
import inspect
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import scale  # noqa: E402

pytest.importorskip("transformers")


def test_scale_benchmark_smoke(tmp_path: Path) -> None:
    assert scale.main(["--layers", "2", "--repeats", "1", "--seq", "8", "--no-new-shapes",
                       "--in-process", "--quiet", "--out", str(tmp_path)]) == 0
    record = json.loads((tmp_path / "scale.json").read_text())
    rows = {r["approach"]: r for r in record["rows"]}
    assert set(rows) == {"fxprobe", "hooks", "nnsight"}
    for name in ("fxprobe", "hooks"):
        r = rows[name]
        assert r["status"] == "ok", r
        assert r["agrees_with_hooks"] is True
        assert r["first_s"] > 0 and r["warm_ms"] > 0 and r["layers"] == 2
    if importlib.util.find_spec("nnsight") is None:
        assert rows["nnsight"]["status"] == "nnsight not installed"
    else:
        assert rows["nnsight"]["status"] == "ok" and rows["nnsight"]["agrees_with_hooks"]
    assert "| fxprobe | 2 |" in (tmp_path / "scale.md").read_text()


def test_scale_benchmark_refuses_an_unknown_approach() -> None:
    with pytest.raises(SystemExit, match="nnsigt"):
        scale.main(["--approaches", "nnsigt", "--layers", "2"])


def test_scale_benchmark_child_command_is_what_measure_takes(monkeypatch) -> None:
    """What the parent hands a child process (``--child``) is a call of ``measure``."""
    sent = []

    def run(cmd, **kwargs):
        sent.append(json.loads(cmd[cmd.index("--child") + 1]))
        raise scale.subprocess.TimeoutExpired(cmd, 0)

    monkeypatch.setattr(scale.subprocess, "run", run)
    args = scale.parser().parse_args(["--layers", "2", "--approaches", "hooks", "--quiet"])
    args.size = "tiny"
    (row,) = scale.run_all(args)
    assert row["status"] == "timed out"
    inspect.signature(scale.measure).bind(**sent[0])


def test_the_torch_references_record_what_hooks_record(tmp_path: Path) -> None:
    """``compile`` and ``regional`` (torch alone, compiled whole or layer by layer) record the
    layers' outputs and make the edit as the hooks do."""
    assert scale.main(["--layers", "2", "--repeats", "1", "--seq", "8", "--no-new-shapes",
                       "--in-process", "--quiet", "--approaches", "hooks,compile,regional",
                       "--out", str(tmp_path)]) == 0
    rows = {r["approach"]: r for r in json.loads((tmp_path / "scale.json").read_text())["rows"]}
    for name in ("compile", "regional"):
        assert rows[name]["status"] == "ok", rows[name]
        assert rows[name]["agrees_with_hooks"] is True, rows[name]


def test_scale_targets_table_sets_medians_against_the_shallowest_depth() -> None:
    def row(layers: int, first: float, warm_ms: float, new: float, edit: float, round_: int,
            approach: str = "fxprobe") -> dict[str, object]:
        return {"approach": approach, "layers": layers, "status": "ok", "round": round_,
                "first_s": first, "new_length_s": new, "new_batch_s": new,
                "new_length_warm_ms": warm_ms, "new_batch_warm_ms": 2 * warm_ms,
                "first_edit_s": edit, "bare_ms": warm_ms / 2, "warm_ms": warm_ms / 2,
                "warm_ratio": 1.0}

    rows = [row(2, 2.0, 10.0, 0.011, 0.0, 0), row(2, 9.0, 10.0, 0.011, 0.0, 1),
            row(2, 2.2, 10.0, 0.011, 0.0, 2),  # median 2.2: a slow round does not count
            row(32, 3.3, 20.0, 0.022, 0.05, 0), row(32, 3.0, 20.0, 0.030, 0.05, 1),
            row(32, 3.4, 20.0, 0.022, 0.05, 2),  # 3.3 / 2.2 = 1.5, 0.022 / 0.020 = 1.1
            row(80, 4.5, 40.0, 0.044, 0.1, 0), row(80, 4.5, 40.0, 0.044, 0.1, 1),
            row(80, 4.5, 40.0, 0.044, 0.1, 2),  # 4.5 / 2.2 = 2.05: over 2x
            row(2, 0.01, 1.0, 0.001, 0.0, 0, "hooks"), row(80, 0.05, 1.0, 0.001, 0.0, 0, "hooks")]
    lines = scale.targets(rows)
    # each new shape against the warm call at that shape (the batch of 2: twice as long)
    assert "| fxprobe | 32 | 1.50 | 1.10 | 0.55 | 0.050 | yes |" in lines
    assert "| fxprobe | 80 | 2.05 | 1.10 | 0.55 | 0.100 | no |" in lines
    assert "| fxprobe | 2 | 1.00 | 1.10 | 0.55 | 0.000 | yes |" in lines  # its new shapes too
    assert not any("| hooks |" in line for line in lines)  # targets are fxprobe's
