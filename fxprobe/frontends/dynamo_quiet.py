"""Dynamo's first compilation of a region, quiet: its warnings and graph-break logs (pages of
them for a torchvision detector) collected into one fxprobe warning that says where to look."""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

_TORCH_DIR = str(Path(torch.__file__).resolve().parent)


class _Collect(logging.Filter):
    """Drops, and keeps, dynamo's records below ERROR."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name.startswith("torch._dynamo") and record.levelno < logging.ERROR:
            self.records.append(record)
            return False
        return True


@contextlib.contextmanager
def quiet_compile(what: str, graphs: Callable[[], int]) -> Iterator[None]:
    """Run a region's first call with dynamo's warnings and log records collected; then warn
    once with how many graphs and graph breaks, and re-raise the warnings of the model's own
    code as they were. ``TORCH_LOGS`` set: the user asked for dynamo's logs, leave them be."""
    if os.environ.get("TORCH_LOGS"):
        yield
        return
    collect = _Collect()
    handlers = {h for name in ("", "torch", "torch._dynamo")
                for h in logging.getLogger(name).handlers}
    for h in handlers:
        h.addFilter(collect)
    try:
        with warnings.catch_warnings(record=True) as caught:
            yield
    finally:
        for h in handlers:
            h.removeFilter(collect)
    ours = [w for w in caught if not str(Path(w.filename).resolve()).startswith(_TORCH_DIR)]
    for w in ours:  # the model's own warnings, as they were raised
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    torch_warnings = len(caught) - len(ours)
    breaks = sum("Graph break" in r.getMessage() for r in collect.records)
    if not collect.records and not torch_warnings:
        return
    first = (collect.records[0].getMessage() if collect.records else
             str(next(w.message for w in caught if w not in ours)))
    first = first.strip().splitlines()[0][:160] if first.strip() else ""
    warnings.warn(
        f"fxprobe: torch dynamo captured {what} in {graphs()} graph(s) at its first call, "
        f"with {breaks} graph break(s) logged; {len(collect.records)} log record(s) and "
        f"{torch_warnings} warning(s) of torch were collected here (first: {first!r}). The "
        "code at a graph break runs as written, its module calls reached by hooks: "
        "tapped.dynamo_info lists graphs and breaks per module, tapped.fallbacks what fell back; "
        "set TORCH_LOGS=graph_breaks to see dynamo's own messages.",
        UserWarning, stacklevel=2)


def side_effects_logged() -> bool:
    """Whether dynamo's log of the writes a capture replays is asked for (``TORCH_LOGS`` with
    ``side_effects``, or its logger set to DEBUG): its messages are then worth their cost."""
    from torch._dynamo.side_effects import side_effects_log
    return bool(os.environ.get("TORCH_LOGS")) or side_effects_log.isEnabledFor(logging.DEBUG)
