"""The exceptions fxprobe raises; each also inherits the matching builtin."""

from __future__ import annotations


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


class CaptureError(FxProbeError, RuntimeError):
    """torch dynamo ran a module without fxprobe's graphs, so nothing in it was tapped."""
