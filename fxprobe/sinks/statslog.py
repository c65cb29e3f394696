"""``fxprobe.StatsLogger``: a table of activation statistics every N steps of a training loop,
written through :mod:`logging` and handed to a sink (:mod:`fxprobe.sinks.loggers`); the
counting loop (:class:`EveryN`) is shared with ``fxprobe.dist.StatsLogger``."""

from __future__ import annotations

import inspect
import logging
import warnings
from collections.abc import Callable, Mapping
from typing import Any

from ..capture.stats.batch import collect
from ..capture.stats.math import Stats
from ..capture.stats.table import stats_table
from ..core.errors import ConfigError
from ..core.options import table_format

StatsSource = Callable[[], Mapping[str, Any]]


class EveryN:
    """Counts steps and acts on steps 0, N, 2N, ...: the loop shared by the stats loggers
    (this module's and :class:`fxprobe.dist.StatsLogger`). Subclasses implement
    :meth:`_act`."""

    def __init__(self, every: int, logger: logging.Logger | None, level: int, fmt: str,
                 sink: Callable[[int, Mapping[str, Stats]], Any] | None) -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ConfigError(f"StatsLogger(every={every!r}): every must be a positive int")
        if sink is not None and not callable(sink):
            raise ConfigError(f"StatsLogger(sink={sink!r}): sink must be callable as "
                              "sink(step, stats)")
        table_format(fmt)  # refused now, not at the first logging step
        self.every = every
        self.logger = logger if logger is not None else logging.getLogger("fxprobe")
        self.level = level
        self.fmt = fmt
        self.sink = sink
        """Also called as ``sink(step, stats)`` on logging steps (``fxprobe.TensorBoardSink``,
        ``fxprobe.CallbackSink``), whether or not ``logger`` is enabled."""
        self.count = 0
        """How many steps have been taken."""

    def step(self) -> Any:
        """Count one step; on every ``every``-th (from the first) log and return the stats."""
        index = self.count
        self.count += 1
        if index % self.every:
            return None
        return self._act(index)

    def _act(self, index: int) -> Any:
        raise NotImplementedError

    def __call__(self) -> Any:
        return self.step()

    def __enter__(self) -> Any:
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if exc_type is None:
            self.step()


class StatsLogger(EveryN):
    """Log a table of activation statistics every ``every`` steps of a training loop.

    Call :meth:`step` (or the logger itself) once after each forward, or run the forward inside
    ``with stats_logger:``. On steps 0, N, 2N, ... it reads the source and logs
    :func:`stats_table` through :mod:`logging`; on the other steps it does nothing at all, so
    the device is never waited for in between. Nothing is read when the logger would drop the
    record anyway and there is no ``sink``. A ``sink`` (:class:`fxprobe.TensorBoardSink`,
    :class:`fxprobe.CallbackSink`, or any ``sink(step, stats)``) also receives the stats.

    ``source`` is an object with a ``taps`` mapping (a tapped module) or a zero-argument callable
    returning one. Its values may be :class:`Stats` or tensors; tensors are summarised with
    :func:`stats_vector` and fetched in one transfer. Other values are skipped.

    Example:
        >>> slog = fxprobe.StatsLogger(tapped, every=100)
        >>> for x, y in loader:
        ...     loss = loss_fn(tapped(x), y); loss.backward(); opt.step()
        ...     slog.step()
    """

    def __init__(self, source: Any, every: int = 100, logger: logging.Logger | None = None,
                 level: int = logging.INFO, fmt: str = "simple",
                 sink: Callable[[int, Mapping[str, Stats]], Any] | None = None) -> None:
        super().__init__(every, logger, level, fmt, sink)
        # getattr_static: a ``taps`` property must not run (and maybe synchronise) here.
        if inspect.getattr_static(source, "taps", None) is not None:
            self._read: StatsSource = lambda: source.taps
        elif callable(source):
            self._read = source
        else:
            raise ConfigError(
                f"StatsLogger needs an object with a .taps mapping (a tapped module) or a "
                f"zero-argument callable returning a mapping; got {type(source).__name__}"
            )
        self.last: Mapping[str, Stats] | None = None
        """The statistics logged last, or None."""
        self._warned = False

    def step(self) -> Mapping[str, Stats] | None:
        """Count one step; on every ``every``-th (from the first) log and return the stats."""
        return super().step()  # type: ignore[no-any-return]

    def _act(self, index: int) -> Mapping[str, Stats] | None:
        log = self.logger.isEnabledFor(self.level)
        if self.sink is None and not self._warned and not _reaches_a_handler(self.logger,
                                                                            self.level):
            self._warned = True
            warnings.warn(
                f"StatsLogger: logger {self.logger.name!r} drops {logging.getLevelName(self.level)}"
                f" records (its level is {logging.getLevelName(self.logger.getEffectiveLevel())}"
                ", or no handler takes them), so nothing is logged"
                f"{'' if log else ' and step() returns None'}; call logging.basicConfig("
                "level=logging.INFO) or give the logger a handler, or pass a level it keeps "
                "(level=logging.WARNING) or a sink=", stacklevel=4)
        if not log and self.sink is None:
            return None
        stats = collect(self._read())
        self.last = stats
        if log:
            self.logger.log(self.level, "fxprobe activation stats, step %d:\n%s", index,
                            stats_table(stats, self.fmt))
        if self.sink is not None:
            self.sink(index, stats)
        return stats

    def __enter__(self) -> StatsLogger:
        return self


def _reaches_a_handler(logger: logging.Logger, level: int) -> bool:
    """Whether a record of ``level`` would reach a handler, as ``Logger.callHandlers`` does
    (handler filters aside): Python's last-resort handler takes only WARNING and above."""
    if not logger.isEnabledFor(level):
        return False
    any_handler = False
    current: logging.Logger | None = logger
    while current is not None:
        for h in current.handlers:
            any_handler = True
            if level >= h.level:
                return True
        current = current.parent if current.propagate else None
    last = logging.lastResort
    return not any_handler and last is not None and level >= last.level
