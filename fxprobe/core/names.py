"""Names and one-line messages, written once for every layer: dotted module paths, and the
first line of an exception as a reason to show in a table or an error."""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Sequence


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
    every "did you mean" of fxprobe."""
    return difflib.get_close_matches(name, list(dict.fromkeys(names)), n=n,
                                     cutoff=CLOSE_CUTOFF)


def did_you_mean(name: str, names: Iterable[str], n: int = 5) -> str:
    """``" Did you mean 'a', 'b'?"`` (the :func:`closest` names), or ``""``: the hint that
    follows a sentence saying that ``name`` is not found."""
    close = closest(name, names, n)
    return f" Did you mean {', '.join(map(repr, close))}?" if close else ""
