"""The text table of ``{site: Stats}``: what ``fxprobe.stats_table`` prints and the stats
loggers log (here, below the sinks and the readers, so that both may read it)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ...core.errors import ConfigError
from ...core.options import table_format
from .batch import collect
from .math import Stats

_HEADERS = ("site", "shape", "dtype", "mean", "std", "min", "max", "absmax", "zeros %", "nan",
            "inf")


def stats_table(stats: Mapping[str, Any], fmt: str = "simple") -> str:
    """A text table of ``{site: Stats}``, one row per site, in the mapping's order.

    Args:
        stats: site name -> :class:`Stats` or tensor (a :class:`StatsBatch` is fetched;
            tensors are summarised with :func:`stats_vector`, as ``tapped.taps`` holds them).
        fmt: ``"text"``, ``"github"`` (or ``"markdown"``), ``"html"``, as ``summary`` takes
            them, or any ``tabulate`` table format (``"simple"``, ``"plain"`` ...).

    Raises:
        ConfigError: ``fmt`` is no table format, or a value is neither Stats nor a real
            tensor.

    Returns:
        The table; columns site, shape, dtype, mean, std, min, max, absmax, zeros %, nan, inf.

    Example:
        >>> print(stats_table(StatsBatch.from_tensors(tapped.taps)))
    """
    from tabulate import tabulate

    tablefmt = table_format(fmt)
    if not all(isinstance(v, Stats) for v in stats.values()):
        bad = [f"{n!r} ({type(v).__name__}{', complex' if isinstance(v, torch.Tensor) else ''})"
               for n, v in stats.items() if not isinstance(v, Stats) and not (
                   isinstance(v, torch.Tensor) and not v.is_complex())]
        if bad:
            raise ConfigError(
                f"stats_table needs Stats or real tensors as values; got {', '.join(bad)}")
        stats = collect(stats)
    rows = []
    for name, s in stats.items():
        shape = "x".join(map(str, s.shape)) if s.shape else "scalar"
        rows.append([name, shape, s.dtype.removeprefix("torch."), s.mean, s.std, s.min, s.max,
                     s.absmax, 100.0 * s.zero_frac, s.nan_count, s.inf_count])
    return tabulate(rows, headers=_HEADERS, tablefmt=tablefmt,
                    floatfmt=("", "", "", ".4g", ".4g", ".4g", ".4g", ".4g", ".1f", "", ""),
                    disable_numparse=[0, 1, 2])
