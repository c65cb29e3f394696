"""The exceptions fxprobe raises; each also inherits the matching builtin."""

from __future__ import annotations

from .names import moved


class FxProbeError(Exception):
    """Base class of every error fxprobe raises on purpose."""


class SelectorError(FxProbeError, LookupError):
    """A selector in ``ops=`` is malformed or matches no site."""


class SelectorTypeError(FxProbeError, TypeError):
    """A selector in ``ops=`` is of a type fxprobe does not understand."""


class TraceError(FxProbeError, RuntimeError):
    """``torch.fx`` could not trace a module and no fallback was allowed."""


class UnsupportedModelError(FxProbeError, TypeError):
    """The model is of a kind fxprobe cannot instrument (yet)."""


class SiteNotRunError(FxProbeError, KeyError):
    """A selected site did not run in the last forward, so it holds no value."""

    def __str__(self) -> str:  # KeyError would print the repr of the message
        return str(self.args[0]) if self.args else ""


class UnknownSiteError(FxProbeError, KeyError):
    """A name that is not one of the selected sites was looked up."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class RemovedError(FxProbeError, RuntimeError):
    """The tapped module was used after ``remove()``."""


class ConfigError(FxProbeError, ValueError):
    """An argument of ``fxprobe.tap`` has a value it does not accept."""


class InterventionError(FxProbeError, ValueError):
    """A callback (``fn=`` or ``grad_fn=``) returned a value that cannot replace the original."""


class TracedStateError(FxProbeError, RuntimeError):
    """A forward wrote model state while being traced; that module runs as written instead.

    ``module_path`` names the module whose container changed (relative to the traced module),
    when the write was found after the trace rather than where it happened.
    """

    module_path: str | None = None


class RenderError(FxProbeError, RuntimeError):
    """A picture could not be written (the Graphviz ``dot`` program is missing or failed)."""


class UsageError(FxProbeError, ValueError):
    """What was typed on the command line cannot be used; the message says how to fix it."""


class DynamoError(FxProbeError, RuntimeError):
    """torch dynamo ran a module without fxprobe's graphs, so nothing in it was tapped."""


class DiskError(FxProbeError, OSError):
    """Captures could not be written to, or read from, a directory (``fxprobe.Disk``)."""


__getattr__ = moved(__name__, {"CaptureError": ("DynamoError", DynamoError)})
