"""The text table of ``{site: Stats}``: what ``fxprobe.stats_table`` prints and the stats
loggers log (here, below the sinks and the readers, so that both may read it)."""

from __future__ import annotations

from collections.abc import Mapping

from .math import Stats

_HEADERS = ("site", "shape", "dtype", "mean", "std", "min", "max", "absmax", "zeros %", "nan",
            "inf")


def stats_table(stats: Mapping[str, Stats], fmt: str = "simple") -> str:
    """A text table of ``{site: Stats}``, one row per site, in the mapping's order.

    Args:
        stats: site name -> :class:`Stats` (a :class:`StatsBatch` is fetched).
        fmt: any ``tabulate`` table format (``"simple"``, ``"github"``, ``"plain"`` ...).

    Returns:
        The table; columns site, shape, dtype, mean, std, min, max, absmax, zeros %, nan, inf.

    Example:
        >>> print(stats_table(StatsBatch.from_tensors(tapped.taps)))
    """
    from tabulate import tabulate

    rows = []
    for name, s in stats.items():
        shape = "x".join(map(str, s.shape)) if s.shape else "scalar"
        rows.append([name, shape, s.dtype.removeprefix("torch."), s.mean, s.std, s.min, s.max,
                     s.absmax, 100.0 * s.zero_frac, s.nan_count, s.inf_count])
    return tabulate(rows, headers=_HEADERS, tablefmt=fmt,
                    floatfmt=("", "", "", ".4g", ".4g", ".4g", ".4g", ".4g", ".1f", "", ""),
                    disable_numparse=[0, 1, 2])
