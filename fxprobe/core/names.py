"""Names and one-line messages, written once for every layer: dotted module paths, and the
first line of an exception as a reason to show in a table or an error."""

from __future__ import annotations

from collections.abc import Sequence


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
