"""The statistics table and StatsLogger: text and tensor tables, logging every n steps, callables
and contexts, dropped records, bad arguments, collect."""

from __future__ import annotations

import logging

import pytest
import torch
from nosync import record_ops

from fxprobe.capture.stats.batch import collect
from fxprobe.capture.stats.math import Stats
from fxprobe.capture.stats.table import stats_table
from fxprobe.core.errors import ConfigError
from fxprobe.sinks.statslog import StatsLogger

NAN = float("nan")


def _stats(**kw: object) -> Stats:
    base: dict[str, object] = dict(shape=(2, 3), dtype="torch.float32", numel=6, mean=0.5,
                                   std=1.25, min=-1.0, max=2.0, absmax=2.0, zero_frac=0.5,
                                   nan_count=0, inf_count=0)
    base.update(kw)
    return Stats(**base)  # type: ignore[arg-type]


def test_stats_table_text() -> None:
    table = stats_table({"layer1.0": _stats(), "fc": _stats(shape=(), numel=1, mean=123456.0,
                                                            std=NAN, nan_count=3)})
    header = table.splitlines()[0].split()
    assert header == ["site", "shape", "dtype", "mean", "std", "min", "max", "absmax", "zeros",
                      "%", "nan", "inf"]
    rows = [line.split() for line in table.splitlines()[2:]]
    assert rows[0] == ["layer1.0", "2x3", "float32", "0.5", "1.25", "-1", "2", "2", "50.0", "0",
                       "0"]
    assert rows[1] == ["fc", "scalar", "float32", "1.235e+05", "nan", "-1", "2", "2", "50.0",
                       "3", "0"]
    assert stats_table({"0": _stats()}, fmt="github").startswith("| site")


def test_stats_table_of_tensors() -> None:
    # As tapped.taps holds them: tensors are summarised (numbers by hand below).
    table = stats_table({"a": torch.tensor([[0.0, 1.0], [2.0, -4.0]]), "s": _stats()})
    rows = [line.split() for line in table.splitlines()[2:]]
    assert rows[0] == ["a", "2x2", "float32", "-0.25", "2.63", "-4", "2", "4", "25.0", "0", "0"]
    assert rows[1][0] == "s" and rows[1][3] == "0.5"
    with pytest.raises(ConfigError, match=r"'b' \(str\), 'c' \(Tensor, complex\)"):
        stats_table({"a": torch.ones(2), "b": "x",  # type: ignore[dict-item]
                     "c": torch.ones(2, dtype=torch.complex64)})


class _Source:
    def __init__(self) -> None:
        self.reads = 0
        self.value: dict[str, torch.Tensor] = {"x": torch.tensor([0.0, 1.0, 2.0])}

    @property
    def taps(self) -> dict[str, torch.Tensor]:
        self.reads += 1
        return self.value


def test_stats_logger_logs_every_n_steps_only(caplog: pytest.LogCaptureFixture) -> None:
    src = _Source()
    slog = StatsLogger(src, every=3)
    caplog.set_level(logging.INFO, logger="fxprobe")
    results = [slog.step() for _ in range(7)]
    assert [r is not None for r in results] == [True, False, False, True, False, False, True]
    assert src.reads == 3  # the source is read only on logging steps
    assert len(caplog.records) == 3
    assert all(r.name == "fxprobe" and r.levelno == logging.INFO for r in caplog.records)
    assert "step 3" in caplog.records[1].getMessage()
    assert "x" in caplog.records[0].getMessage() and "33.3" in caplog.records[0].getMessage()
    assert slog.last is not None and slog.last["x"].mean == 1.0


def test_stats_logger_callable_stats_context_and_disabled(caplog: pytest.LogCaptureFixture
                                                          ) -> None:
    calls = []

    def source() -> dict[str, object]:
        calls.append(1)
        return {"s": _stats(), "skip": "not a tensor"}

    logger = logging.getLogger("fxprobe.test")
    caplog.set_level(logging.DEBUG, logger="fxprobe.test")
    slog = StatsLogger(source, every=2, logger=logger, level=logging.DEBUG)
    for _ in range(3):
        with slog:
            pass
    assert slog.count == 3 and len(calls) == 2 and len(caplog.records) == 2
    assert list(slog.last or {}) == ["s"]
    with pytest.raises(RuntimeError), slog:  # a failed step is not counted
        raise RuntimeError("boom")
    assert slog.count == 3
    quiet = StatsLogger(source, every=1, logger=logger, level=5)  # below the logger's level
    calls.clear()
    quiet()
    assert calls == []


def test_stats_logger_says_once_when_its_logger_drops_the_records(
        caplog: pytest.LogCaptureFixture) -> None:
    import warnings

    src = _Source()
    quiet = logging.getLogger("fxprobe.test.default_level")  # WARNING, Python's default
    slog = StatsLogger(src, every=1, logger=quiet)
    with pytest.warns(UserWarning, match="'fxprobe.test.default_level' drops INFO records "
                      r"\(its level is WARNING.*step\(\) returns None.*basicConfig") as seen:
        assert [slog.step() for _ in range(3)] == [None] * 3
    assert len(seen) == 1 and src.reads == 0
    alone = logging.getLogger("fxprobe.test.no_handler")  # enabled, but no handler takes it
    alone.setLevel(logging.INFO)
    alone.propagate = False
    try:
        with pytest.warns(UserWarning, match="no handler takes them") as seen:
            assert StatsLogger(src, every=1, logger=alone).step() is not None
        assert "returns None" not in str(seen[0].message)
    finally:
        alone.propagate = True
    caplog.set_level(logging.INFO, logger="fxprobe.test.kept")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # kept: nothing to say
        StatsLogger(src, every=1, logger=logging.getLogger("fxprobe.test.kept")).step()
        StatsLogger(src, every=1, logger=quiet, sink=lambda i, st: None).step()


def test_stats_logger_rejects_bad_arguments() -> None:
    with pytest.raises(ConfigError, match="every"):
        StatsLogger(lambda: {}, every=0)
    with pytest.raises(ConfigError, match="taps"):
        StatsLogger(42)


def test_collect_keeps_order_and_fetches_once() -> None:
    values = {"t1": torch.ones(2), "s": _stats(), "t2": torch.zeros(3), "other": (1, 2)}
    with record_ops() as ops:
        out = collect(values)
    assert list(out) == ["t1", "s", "t2"] and ops.count("cpu") == 1
    assert out["t2"].zero_frac == 1.0 and out["s"] is values["s"]

