"""fxprobe: tap any PyTorch model at op level, with hooks where tracing fails.

Example:
    >>> import torch, torch.nn as nn, fxprobe
    >>> model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Flatten())
    >>> tapped = fxprobe.tap(model, ops=nn.ReLU)
    >>> out = tapped(torch.randn(2, 4))
    >>> tapped.taps["1"].shape
    torch.Size([2, 8])
"""

from . import dist
from .api import sites, tap
from .capture.stats.batch import StatsBatch
from .capture.stats.math import Stats, stats_vector
from .capture.stats.sampling import Sample, sample_vector
from .capture.stats.table import stats_table
from .core.errors import (
    ConfigError,
    DiskError,
    DynamoError,
    FxProbeError,
    InterventionError,
    RemovedError,
    RenderError,
    SelectorError,
    SelectorTypeError,
    SiteNotRunError,
    TraceError,
    UnknownSiteError,
    UnsupportedModelError,
)
from .core.record import Grads, InOut, Taps
from .core.select import Selector, where
from .core.site import Site
from .core.view import DynamoInfo, Fallback
from .frontends.attention import attention_probs
from .present.summary import Table
from .runtime.artifact import TappedArtifact, TappedExport, TappedScript
from .runtime.extract import extractor
from .runtime.features import Features, features
from .runtime.program import SiteNames
from .runtime.tapped import TappedModule
from .runtime.views import render, summary, to_dot
from .sinks.captures import Captures, open_captures
from .sinks.disk import Disk
from .sinks.loggers import CallbackSink, TensorBoardSink, lightning_callback, stats_scalars
from .sinks.statslog import StatsLogger

__all__ = [
    "CallbackSink",
    "DynamoError",
    "DynamoInfo",
    "Captures",
    "ConfigError",
    "Disk",
    "DiskError",
    "Fallback",
    "Features",
    "FxProbeError",
    "Grads",
    "InOut",
    "InterventionError",
    "RemovedError",
    "RenderError",
    "Selector",
    "SelectorError",
    "SelectorTypeError",
    "Site",
    "SiteNames",
    "SiteNotRunError",
    "Sample",
    "Stats",
    "StatsBatch",
    "StatsLogger",
    "Table",
    "Taps",
    "TappedArtifact",
    "TappedExport",
    "TappedModule",
    "TappedScript",
    "TensorBoardSink",
    "TraceError",
    "UnknownSiteError",
    "UnsupportedModelError",
    "attention_probs",
    "dist",
    "extractor",
    "features",
    "lightning_callback",
    "render",
    "sample_vector",
    "sites",
    "stats_scalars",
    "stats_table",
    "stats_vector",
    "summary",
    "open_captures",
    "tap",
    "to_dot",
    "where",
]
