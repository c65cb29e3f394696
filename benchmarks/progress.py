"""A progress line on stderr (no tqdm): redrawn in place on a terminal, one line per step else."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    """``[#####.....] 3/12  resnet50 b1 inference  round 2/5  1m20s``."""

    def __init__(self, total: int, *, enabled: bool = True, stream: TextIO | None = None,
                 width: int = 24) -> None:
        self.total = max(1, total)
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self.width = width
        self.start = time.monotonic()
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._last = ""
        self._label = ""

    def update(self, done: float, label: str, detail: str = "") -> None:
        """Show ``done`` steps of ``total`` finished (fractions allowed) while doing ``label``."""
        if not self.enabled:
            return
        frac = min(1.0, max(0.0, done / self.total))
        filled = int(round(frac * self.width))
        elapsed = time.monotonic() - self.start
        m, s = divmod(int(elapsed), 60)
        step = min(int(done) + 1, self.total)
        text = (f"[{'#' * filled}{'.' * (self.width - filled)}] {step}/{self.total}  "
                f"{label}{'  ' + detail if detail else ''}  {m}m{s:02d}s")
        if self.tty:
            pad = max(0, len(self._last) - len(text))
            self.stream.write("\r" + text + " " * pad)
            self.stream.flush()
        elif label != self._label:  # a log file gets a line per step, not one per round
            self.stream.write(text + "\n")
            self.stream.flush()
        self._label = label
        self._last = text

    def message(self, text: str) -> None:
        """A line of its own (a skipped part, a failure), above the progress line."""
        if not self.enabled:
            return
        if self.tty and self._last:
            self.stream.write("\r" + " " * len(self._last) + "\r")
        self.stream.write(text + "\n")
        self.stream.flush()
        if self.tty and self._last:
            self.stream.write(self._last)
            self.stream.flush()

    def close(self) -> None:
        if self.enabled and self.tty and self._last:
            self.stream.write("\n")
            self.stream.flush()
