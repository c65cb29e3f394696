"""Where activation statistics go in a training loop: TensorBoard, any callable, Lightning.

Every sink writes one scalar per site and statistic, tagged ``site/stat`` (``layer1.0.conv1/std``),
so TensorBoard groups a site's statistics in one section. A sink is called only on the steps
:class:`~fxprobe.StatsLogger` logs (every N, one transfer to the host); other steps read nothing.

TensorBoard and Lightning are optional: they are imported when a sink that needs them is made.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ..capture.stats.batch import collect
from ..capture.stats.math import FIELDS, Stats
from ..core.errors import ConfigError
from ..core.options import Sink
from ..core.view import Viewable
from .statslog import StatsLogger


def _fields(fields: Iterable[str]) -> tuple[str, ...]:
    chosen = (fields,) if isinstance(fields, str) else tuple(fields)
    unknown = [f for f in chosen if f not in FIELDS]
    if unknown or not chosen:
        what = f"unknown {', '.join(map(repr, unknown))}" if unknown else "empty"
        raise ConfigError(f"fields={list(chosen)!r}: {what}; choose among {', '.join(FIELDS)}")
    return chosen


def stats_scalars(stats: Mapping[str, Stats], fields: Iterable[str] = FIELDS, prefix: str = ""
            ) -> dict[str, float]:
    """``{"site/stat": value}`` for every site and chosen statistic, sites in order.

    Counts (``nan_count``, ``inf_count``) are given as floats like the rest, so that every
    logger accepts them.

    Args:
        stats: ``{site: Stats}`` (what :meth:`StatsLogger.step` returns).
        fields: the statistics to write, among ``mean, std, min, max, absmax, zero_frac,
            nan_count, inf_count``.
        prefix: put before every tag (``"act/"`` gives ``act/layer1/std``).

    Example:
        >>> stats_scalars({"fc": stats}, fields=["mean", "std"])
        {'fc/mean': 0.01, 'fc/std': 0.98}
    """
    chosen = _fields(fields)
    return {f"{prefix}{site}/{f}": float(getattr(s, f)) for site, s in stats.items()
            for f in chosen}


class StatsSink(Sink):
    """A stats sink (``sink(step, stats)``, what :class:`~fxprobe.StatsLogger` hands its
    statistics to every N steps) that is a :class:`Sink` too: ``fxprobe.tap(model,
    to=sink)`` hands it every forward's values, whose statistics it writes at step = the
    forwards written before (one transfer to the host per forward)."""

    _forwards = 0

    def __call__(self, step: int, stats: Mapping[str, Stats]) -> None:
        raise NotImplementedError

    def write(self, values: Mapping[str, Any], inputs: Any = ()) -> None:
        step, self._forwards = self._forwards, self._forwards + 1
        self(step, collect(values))


class TensorBoardSink(StatsSink):
    """A :class:`~fxprobe.StatsLogger` sink writing ``site/stat`` scalars to TensorBoard
    (or ``fxprobe.tap(model, to=...)``'s: every forward's statistics, see :class:`StatsSink`).

    Args:
        writer: a ``torch.utils.tensorboard.SummaryWriter``, or a log directory to open one in
            (``tensorboard`` must then be installed).
        fields: the statistics to write (all eight by default).
        prefix: put before every tag.

    Example:
        >>> slog = fxprobe.StatsLogger(tapped, every=100,
        ...                            sink=fxprobe.TensorBoardSink("runs/exp1"))
    """

    def __init__(self, writer: Any, fields: Iterable[str] = FIELDS, prefix: str = "") -> None:
        self.fields = _fields(fields)
        self.prefix = prefix
        if isinstance(writer, (str, os.PathLike)):
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:  # torch raises this when tensorboard is missing
                raise ImportError(
                    "TensorBoardSink(log_dir) needs the tensorboard package: pip install "
                    "tensorboard (or pass a SummaryWriter-like object with add_scalar)") from e
            writer = SummaryWriter(log_dir=os.fspath(writer))
        if not callable(getattr(writer, "add_scalar", None)):
            raise ConfigError(
                f"TensorBoardSink needs a SummaryWriter (an object with add_scalar) or a log "
                f"directory; got {type(writer).__name__}")
        self.writer = writer

    def __call__(self, step: int, stats: Mapping[str, Stats]) -> None:
        for tag, value in stats_scalars(stats, self.fields, self.prefix).items():
            self.writer.add_scalar(tag, value, step)

    def flush(self) -> None:
        """Write pending events to disk (a writer with no ``flush`` has none)."""
        getattr(self.writer, "flush", lambda: None)()

    def close(self) -> None:
        """Flush and close the writer (as ``tapped.remove()`` does, where it is ``to=``)."""
        getattr(self.writer, "close", lambda: None)()


class CallbackSink(StatsSink):
    """A :class:`~fxprobe.StatsLogger` sink calling ``fn(scalars, step=step)`` (or
    ``fxprobe.tap(model, to=...)``'s: every forward's statistics, see :class:`StatsSink`).

    That is the signature of ``wandb.log`` and ``mlflow.log_metrics``, so either can be passed
    as is; ``scalars`` is ``{"site/stat": float}``. For a CSV, write the dict's items.

    Args:
        fn: called once per logging step.
        fields: the statistics to pass (all eight by default).
        prefix: put before every tag.
        drop_nonfinite: leave out NaN and ±Inf values (some loggers refuse them); NaN is what
            the statistics of an empty or all-NaN tensor are.

    Example:
        >>> slog = fxprobe.StatsLogger(tapped, every=100, sink=fxprobe.CallbackSink(wandb.log))
    """

    def __init__(self, fn: Callable[..., Any], fields: Iterable[str] = FIELDS,
                 prefix: str = "", drop_nonfinite: bool = False) -> None:
        if not callable(fn):
            raise ConfigError(
                f"CallbackSink needs a callable taking (scalars, step=...), such as wandb.log or "
                f"mlflow.log_metrics; got {type(fn).__name__}")
        self.fn = fn
        self.fields = _fields(fields)
        self.prefix = prefix
        self.drop_nonfinite = drop_nonfinite

    def __call__(self, step: int, stats: Mapping[str, Stats]) -> None:
        values = stats_scalars(stats, self.fields, self.prefix)
        if self.drop_nonfinite:
            values = {k: v for k, v in values.items() if math.isfinite(v)}
        self.fn(values, step=step)


def lightning_callback(source: Any = None, every: int = 50, fields: Iterable[str] = FIELDS,
                       prefix: str = "", package: str | None = None) -> Any:
    """A Lightning ``Callback`` logging ``site/stat`` scalars every ``every`` training batches.

    After every training batch it steps a :class:`~fxprobe.StatsLogger`; on every
    ``every``-th batch (from the first) it sends one scalar per site and statistic to each of
    the trainer's loggers (``logger.log_metrics``), at the step where Lightning puts that
    batch's ``self.log`` metrics, so it works with TensorBoard, CSV, W&B and MLflow loggers
    alike. On the other batches nothing is read
    from the device.

    Args:
        source: what ``StatsLogger`` reads: a tapped module or a callable returning
            ``{name: tensor or Stats}``. ``None`` finds the one ``fxprobe.TappedModule`` inside
            the ``LightningModule`` when training starts.
        every: log on batch 0, N, 2N, ...
        fields: the statistics to write (all eight by default).
        prefix: put before every tag.
        package: ``"lightning.pytorch"`` or ``"pytorch_lightning"``, whichever your Trainer
            comes from; by default the first that imports.

    Returns:
        An instance of that package's ``Callback``.

    Raises:
        ImportError: neither Lightning package is installed.
        ConfigError: ``source`` is None and the LightningModule holds no tapped module, or
            several (raised when training starts).

    Example:
        >>> trainer = L.Trainer(callbacks=[fxprobe.lightning_callback(every=100)])
    """
    base = _lightning_callback_base(package)
    chosen = _fields(fields)
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ConfigError(f"lightning_callback(every={every!r}): every must be a positive int")

    class FxProbeStats(base):  # type: ignore[misc, valid-type]
        """Logs fxprobe activation statistics to the trainer's loggers."""

        def __init__(self) -> None:
            super().__init__()
            self.stats_logger: StatsLogger | None = None
            self._trainer: Any = None

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            found = source if source is not None else _find_tapped(pl_module)
            self.stats_logger = StatsLogger(found, every=every, sink=self._emit,
                                            level=_QUIET)

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                               batch_idx: int) -> None:
            self._trainer = trainer
            if self.stats_logger is not None:
                self.stats_logger.step()

        def _emit(self, index: int, stats: Mapping[str, Stats]) -> None:
            values = stats_scalars(stats, chosen, prefix)
            step = _logging_step(self._trainer)
            for lg in self._trainer.loggers:
                lg.log_metrics(values, step=step)

    return FxProbeStats()


def _logging_step(trainer: Any) -> int:
    """The step Lightning's own ``self.log`` gives this batch's metrics: the batches that
    stepped before it. ``trainer.global_step`` already counts this batch's optimizer step
    (one late), and counts each optimizer of a manual step."""
    loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    step = getattr(loop, "_batches_that_stepped", None)
    if isinstance(step, int):
        return step
    return int(trainer.global_step)  # Lightning before 1.6 logged at global_step


_QUIET = 1  # below any logger's level: the callback's StatsLogger writes no logging table


def _lightning_callback_base(package: str | None) -> type:
    import importlib

    names = [package] if package is not None else ["lightning.pytorch", "pytorch_lightning"]
    for name in names:
        if name not in ("lightning.pytorch", "pytorch_lightning"):
            raise ConfigError(
                f"lightning_callback(package={name!r}): use 'lightning.pytorch' or "
                "'pytorch_lightning'")
        try:
            return importlib.import_module(name).Callback  # type: ignore[no-any-return]
        except ImportError:
            continue
    raise ImportError(
        "fxprobe.lightning_callback needs PyTorch Lightning: pip install lightning "
        f"(tried {', '.join(names)})")


def _find_tapped(pl_module: Any) -> Any:
    # A TappedModule is the one module that hands the readers a View (no import of the runtime).
    found = [(path, m) for path, m in pl_module.named_modules() if isinstance(m, Viewable)]
    if len(found) != 1:
        where = ", ".join(repr(p) for p, _ in found) or "none"
        raise ConfigError(
            f"lightning_callback(source=None) looks for one fxprobe.TappedModule inside the "
            f"LightningModule, and found {len(found)} ({where}); pass source= (a tapped module "
            "or a callable returning {name: tensor})")
    return found[0][1]
