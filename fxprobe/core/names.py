"""Names and one-line messages, written once for every layer: dotted module paths, the first
line of an exception as a reason to show in a table or an error, the hint for a name not found
(:func:`did_you_mean`), and the old spellings of renamed public names (kept one release: reading
one warns with a ``DeprecationWarning`` naming the new spelling and gives the new object)."""

from __future__ import annotations

import difflib
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any


def join(prefix: str, name: str) -> str:
    """``prefix.name``, or whichever of the two is not empty (``join("", "fc") == "fc"``)."""
    return f"{prefix}.{name}" if prefix and name else prefix or name


def one_line(exc: BaseException) -> str:
    """``"TypeName: first line of the message"``, or ``"TypeName"`` when it has no message."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def some(items: Sequence[str], n: int = 3) -> str:
    """The first ``n`` of ``items``, quoted, for a message (``'a', 'b', 'c' ...``)."""
    return ", ".join(repr(p) for p in items[:n]) + (" ..." if len(items) > n else "")


CLOSE_CUTOFF = 0.5
"""How alike a name must be to be suggested (``difflib``'s ratio), for every hint fxprobe gives."""


def closest(name: str, names: Iterable[str], n: int = 5) -> list[str]:
    """The (at most ``n``) ``names`` closest to ``name``, closest first: the one search behind
    every "did you mean" of fxprobe. A ``name`` that is not a string (``taps.get(None)``, which
    must answer the default) has none."""
    if not isinstance(name, str):
        return []
    return difflib.get_close_matches(name, list(dict.fromkeys(names)), n=n,
                                     cutoff=CLOSE_CUTOFF)


def likeness(a: str, b: str) -> float:
    """How alike two names are (``difflib``'s ratio, 0..1): what :func:`closest` ranks by."""
    return difflib.SequenceMatcher(None, a, b).ratio()


def did_you_mean(name: str, names: Iterable[str], n: int = 5) -> str:
    """``" Did you mean 'a', 'b'?"`` (the :func:`closest` names), or ``""``: the hint that
    follows a sentence saying that ``name`` is not found."""
    close = closest(name, names, n)
    return f" Did you mean {', '.join(map(repr, close))}?" if close else ""


def warn_renamed(old: str, new: str, stacklevel: int = 3) -> None:
    """Warn that ``old`` is now spelt ``new`` and goes in the next release."""
    warnings.warn(f"{old} is renamed {new}; the old name goes in the next release",
                  DeprecationWarning, stacklevel=stacklevel)


def moved(module: str, renamed: Mapping[str, tuple[str, Any]]) -> Callable[[str], Any]:
    """A module ``__getattr__`` that answers each old name of ``renamed``
    (``{old: (new name, object)}``) with a warning, and any other missing name as Python does."""

    def __getattr__(name: str) -> Any:
        if name in renamed:
            new, value = renamed[name]
            warn_renamed(f"{module}.{name}", f"{module}.{new}")
            return value
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__


def renamed_property(old: str, new: str) -> Any:
    """A property spelt the old way, ``old`` (``"tapped.captures"``): it warns and reads the
    attribute ``new``."""

    def read(self: Any) -> Any:
        warn_renamed(old, f"{old.rpartition('.')[0]}.{new}")
        return getattr(self, new)

    return property(read, doc=f"Deprecated spelling of ``{new}`` (one release, with a warning).")
