"""fxprobe: tap any PyTorch model at op level, with hooks where tracing fails.

Example:
    >>> import torch, torch.nn as nn, fxprobe
    >>> model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Flatten())
    >>> tapped = fxprobe.tap(model, ops=nn.ReLU)
    >>> out = tapped(torch.randn(2, 4))
    >>> tapped.taps["1"].shape
    torch.Size([2, 8])
"""

import sys as _sys

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
from .core.names import warn_renamed as _warn_renamed
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
from .runtime.stream import ActivationStream
from .runtime.tapped import TappedModule
from .runtime.views import render, summary, to_dot
from .sinks.captures import Captures, open_captures
from .sinks.disk import Disk
from .sinks.loggers import CallbackSink, TensorBoardSink, lightning_callback, stats_scalars
from .sinks.sampler import RowSampler
from .sinks.statslog import StatsLogger

__all__ = [
    # Entry points: tap a model, list its sites, build an extractor or a feature module
    "extractor",
    "features",
    "sites",
    "tap",
    # What they return
    "Features",
    "SiteNames",
    "TappedArtifact",
    "TappedExport",
    "TappedModule",
    "TappedScript",
    # Naming sites: the one Site record and the selectors of ops=
    "Selector",
    "Site",
    "attention_probs",
    "where",
    # Values read after a forward
    "Grads",
    "InOut",
    "Taps",
    # What tracing found
    "DynamoInfo",
    "Fallback",
    # Statistics of values
    "Sample",
    "Stats",
    "StatsBatch",
    "sample_vector",
    "stats_table",
    "stats_vector",
    # Statistics in a training loop
    "CallbackSink",
    "StatsLogger",
    "TensorBoardSink",
    "lightning_callback",
    "stats_scalars",
    # Values on disk: the writer and its reader
    "Captures",
    "Disk",
    "open_captures",
    # Activations for training: a live mixing buffer, a resumable sampler of rows
    "ActivationStream",
    "RowSampler",
    # Pictures and tables
    "Table",
    "render",
    "summary",
    "to_dot",
    # Across torch.distributed ranks
    "dist",
    # Errors
    "ConfigError",
    "DiskError",
    "DynamoError",
    "FxProbeError",
    "InterventionError",
    "RemovedError",
    "RenderError",
    "SelectorError",
    "SelectorTypeError",
    "SiteNotRunError",
    "TraceError",
    "UnknownSiteError",
    "UnsupportedModelError",
]

_RENAMED = {"CaptureError": ("DynamoError", DynamoError),
            "CaptureInfo": ("DynamoInfo", DynamoInfo)}
"""Old spellings, kept one release with a DeprecationWarning (docs/api.md, "One word per idea")."""

# The layer packages and modules that the imports above bound as attributes of the package are
# not part of its surface: they stay importable by their path (``fxprobe.core.site``), as Python
# guarantees for a package's modules, but ``dir(fxprobe)`` and the namespace hold the public
# names only.
_PRIVATE = ("api", "capture", "cli", "core", "frontends", "present", "runtime", "sinks")
for _name in _PRIVATE:
    globals().pop(_name, None)
del _name


def __getattr__(name: str) -> object:
    if name in _RENAMED:
        new, value = _RENAMED[name]
        _warn_renamed(f"fxprobe.{name}", f"fxprobe.{new}")
        return value
    if name in _PRIVATE and f"{__name__}.{name}" in _sys.modules:  # imported by its path
        return _sys.modules[f"{__name__}.{name}"]
    raise AttributeError(f"module 'fxprobe' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
