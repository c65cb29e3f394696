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
from ._api import sites, tap
from ._artifact import TappedArtifact, TappedScript
from ._captures import Captures, open_captures
from ._disk import Disk
from ._dynamo import CaptureInfo, attention_probs
from ._errors import (
    CaptureError,
    ConfigError,
    DiskError,
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
from ._export import TappedExport
from ._extract import extractor
from ._features import Features, features
from ._program import SiteNames
from ._record import Grads, InOut, Taps
from ._select import Selector, where
from ._sinks import CallbackSink, TensorBoardSink, lightning_callback, stats_scalars
from ._site import Site
from ._stats import Stats, StatsBatch, StatsLogger, sample_vector, stats_table, stats_vector
from ._summary import Table, summary
from ._tap import TappedModule
from ._trace import Fallback
from ._viz import render, to_dot

__all__ = [
    "CallbackSink",
    "CaptureError",
    "CaptureInfo",
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
