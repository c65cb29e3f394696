"""``fxprobe.dist``: statistics and values of tapped sites across ``torch.distributed`` ranks.

The public face of :mod:`fxprobe.sinks.dist`, which documents each call.
"""

from .core.names import moved
from .sinks.dist import CrossRankStatsLogger, gather, reduce_stats

__all__ = ["CrossRankStatsLogger", "gather", "reduce_stats"]

__getattr__ = moved(__name__, {"StatsLogger": ("CrossRankStatsLogger", CrossRankStatsLogger)})
