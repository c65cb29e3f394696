"""Tests of the training-loop sinks against independent references.

References: activations computed by hand from the model's own layers, their statistics computed
with numpy in float64, TensorBoard event files read back with tensorboard's
``EventAccumulator``, Lightning's ``CSVLogger`` file read back with ``csv``.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from nosync import forbid_sync
from torch import nn

import fxprobe
from fxprobe.capture.stats.math import FIELDS
from fxprobe.core.errors import ConfigError
from fxprobe.sinks.loggers import CallbackSink, TensorBoardSink, lightning_callback, stats_scalars
from fxprobe.sinks.statslog import StatsLogger


def np_stats(t: torch.Tensor) -> dict[str, float]:
    """The eight statistics by numpy, in float64 (finite elements for the moments)."""
    a = t.detach().double().numpy().ravel()
    fin = a[np.isfinite(a)]
    return {
        "mean": float(fin.mean()), "std": float(fin.std(ddof=1)), "min": float(fin.min()),
        "max": float(fin.max()), "absmax": float(np.abs(fin).max()),
        "zero_frac": float((a == 0).mean()), "nan_count": float(np.isnan(a).sum()),
        "inf_count": float(np.isinf(a).sum()),
    }


def close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-6)


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3)).eval()


def _by_hand(model: nn.Sequential, x: torch.Tensor) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        h = torch.relu(model[0](x))
        return {"1": h, "2": model[2](h)}


def test_stats_scalars_tags_and_values() -> None:
    model, x = _model(), torch.randn(4, 6)
    tapped = fxprobe.tap(model, ops=["1", "2"])
    tapped(x)
    got = stats_scalars(StatsLogger(tapped, every=1, sink=lambda i, s: None).step() or {},
                        fields=["mean", "zero_frac"], prefix="act/")
    want = _by_hand(model, x)
    assert list(got) == ["act/1/mean", "act/1/zero_frac", "act/2/mean", "act/2/zero_frac"]
    for site in ("1", "2"):
        ref = np_stats(want[site])
        assert close(got[f"act/{site}/mean"], ref["mean"])
        assert close(got[f"act/{site}/zero_frac"], ref["zero_frac"])


def test_tensorboard_event_files_read_back(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard", reason="tensorboard is not installed")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    model = _model()
    tapped = fxprobe.tap(model, ops=["1", "2"])
    sink = TensorBoardSink(tmp_path)
    slog = StatsLogger(tapped, every=2, sink=sink)
    torch.manual_seed(1)
    inputs = [torch.randn(4, 6) for _ in range(5)]
    for x in inputs:
        tapped(x)
        slog.step()
    sink.close()
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    assert sorted(tags) == sorted(f"{s}/{f}" for s in ("1", "2") for f in FIELDS)
    for site in ("1", "2"):
        for f in FIELDS:
            events = acc.Scalars(f"{site}/{f}")
            assert [e.step for e in events] == [0, 2, 4]
            for e in events:
                want = np_stats(_by_hand(model, inputs[e.step])[site])[f]
                assert close(e.value, want), (site, f, e.step, e.value, want)


def test_tensorboard_sink_on_a_writer_with_fields_and_prefix(tmp_path: Path) -> None:
    """A SummaryWriter passed in (not a log directory): only the chosen fields, under the
    prefix, readable after flush() while the writer stays open."""
    pytest.importorskip("tensorboard", reason="tensorboard is not installed")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    model = _model()
    tapped = fxprobe.tap(model, ops=["1", "2"])
    writer = SummaryWriter(log_dir=str(tmp_path))
    sink = TensorBoardSink(writer, fields=["max", "zero_frac"], prefix="act/")
    slog = StatsLogger(tapped, every=1, sink=sink)
    torch.manual_seed(3)
    inputs = [torch.randn(4, 6) for _ in range(3)]
    try:
        for x in inputs:
            tapped(x)
            slog.step()
        sink.flush()
        acc = EventAccumulator(str(tmp_path))
        acc.Reload()
    finally:
        writer.close()
    assert sorted(acc.Tags()["scalars"]) == [
        "act/1/max", "act/1/zero_frac", "act/2/max", "act/2/zero_frac"]
    for site in ("1", "2"):
        for f in ("max", "zero_frac"):
            events = acc.Scalars(f"act/{site}/{f}")
            assert [e.step for e in events] == [0, 1, 2]
            for e in events:
                want = np_stats(_by_hand(model, inputs[e.step])[site])[f]
                assert close(e.value, want), (site, f, e.step, e.value, want)


def test_sink_is_not_called_and_nothing_syncs_between_logging_steps() -> None:
    model = _model()
    tapped = fxprobe.tap(model, ops=["1", "2"])
    calls: list[tuple[dict[str, float], int]] = []
    slog = StatsLogger(tapped, every=3, sink=CallbackSink(
        lambda values, step: calls.append((values, step)), fields=["max"]))
    torch.manual_seed(2)
    inputs = [torch.randn(4, 6) for _ in range(7)]
    for i, x in enumerate(inputs):
        tapped(x)
        if i % 3:
            with forbid_sync():
                assert slog.step() is None
        else:
            slog.step()
    assert [step for _, step in calls] == [0, 3, 6]
    for values, step in calls:
        ref = _by_hand(model, inputs[step])
        assert list(values) == ["1/max", "2/max"]
        assert close(values["1/max"], float(ref["1"].max()))
        assert close(values["2/max"], float(ref["2"].max()))


def test_callback_sink_drops_nonfinite_on_request() -> None:
    values = {"a": torch.tensor([1.0, float("nan"), 3.0]), "e": torch.empty(0)}
    kept: list[dict[str, float]] = []
    StatsLogger(lambda: values, every=1,
                sink=CallbackSink(lambda v, step: kept.append(v), drop_nonfinite=True)).step()
    assert kept[0]["a/nan_count"] == 1.0 and kept[0]["a/mean"] == 2.0
    assert "e/mean" not in kept[0] and kept[0]["e/nan_count"] == 0.0


def test_sink_arguments_are_checked() -> None:
    with pytest.raises(ConfigError, match="unknown 'median'.*choose among mean"):
        CallbackSink(print, fields=["mean", "median"])
    with pytest.raises(ConfigError, match="wandb.log"):
        CallbackSink(42)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="add_scalar"):
        TensorBoardSink(object())


def test_lightning_callback_writes_site_stat_metrics(tmp_path: Path) -> None:
    L = pytest.importorskip("lightning.pytorch", reason="lightning is not installed")
    from lightning.pytorch.loggers import CSVLogger

    seen: list[tuple[int, dict[str, torch.Tensor]]] = []

    class Module(L.LightningModule):  # type: ignore[misc, name-defined]
        def __init__(self) -> None:
            super().__init__()
            self.raw = _model().train()
            self.net = fxprobe.tap(self.raw, ops=["1", "2"])

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            (x,) = batch
            seen.append((batch_idx, _by_hand(self.raw, x)))  # before this step's update
            loss = self.net(x).square().mean()
            self.log("loss", loss, on_step=True, on_epoch=False)
            return loss

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.5)

    torch.manual_seed(3)
    data = torch.utils.data.TensorDataset(torch.randn(20, 6))
    loader = torch.utils.data.DataLoader(data, batch_size=4)
    trainer = L.Trainer(max_steps=5, logger=CSVLogger(tmp_path, name="run"),
                        callbacks=[lightning_callback(every=2, fields=["mean", "std"])],
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, accelerator="cpu", log_every_n_steps=1)
    trainer.fit(Module(), loader)
    (path,) = tmp_path.glob("run/*/metrics.csv")
    rows = list(csv.DictReader(path.open()))
    logged = [r for r in rows if r.get("1/mean")]
    # Batches 0, 2, 4 are logged, at the step where Lightning puts their own self.log
    # metrics (the loss of batch 0 at step 0), not at the global step after their update.
    losses = {int(r["step"]): float(r["loss"]) for r in rows if r.get("loss")}
    assert sorted(losses) == [0, 1, 2, 3, 4]
    assert [int(r["step"]) for r in logged] == [0, 2, 4]
    assert {k for k in rows[0] if "/" in k} == {"1/mean", "1/std", "2/mean", "2/std"}
    for r, (batch_idx, ref) in zip(logged, [seen[0], seen[2], seen[4]], strict=True):
        assert batch_idx == int(r["step"])
        assert close(losses[batch_idx], float(ref["2"].square().mean()))
        for site in ("1", "2"):
            want = np_stats(ref[site])
            assert close(float(r[f"{site}/mean"]), want["mean"])
            assert close(float(r[f"{site}/std"]), want["std"])
