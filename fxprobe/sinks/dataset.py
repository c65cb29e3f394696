"""``Captures.dataset``: captured values as a map-style ``torch.utils.data.Dataset``.

Rows are slices of memory-mapped values, so a dataset larger than memory can be shuffled
row by row. ``rows="samples"`` makes one row per batch element (dim 0), ``rows="tokens"`` one
per position of the first two dims (``[batch, pos, ...]`` -> ``batch * pos`` rows), optionally
only where a recorded mask is non-zero (the padding of a batch left out).

The dataset holds the index of the committed shards it was made from (no open file), so it
pickles into ``DataLoader`` workers, where each opens its own maps at the first row it reads.
``__getitems__`` (which ``DataLoader`` calls with a whole batch of indices) reads the rows of
one forward with one gather instead of one Python call per row.
"""

from __future__ import annotations

import bisect
import collections
from collections.abc import Mapping, Sequence
from typing import Any, Literal, Protocol

import torch
from torch.utils.data import Dataset

from ..core.errors import ConfigError, DiskError

Rows = Literal["tokens", "samples"]


class Source(Protocol):
    """What a dataset reads: forwards by number (``Captures`` is one)."""

    def __len__(self) -> int: ...

    def forward(self, i: int) -> Mapping[str, Any]: ...


class CaptureDataset(Dataset[Any]):
    """Rows of captured values: see :meth:`Captures.dataset`."""

    def __init__(self, caps: Source, names: str | Sequence[str], rows: Rows = "tokens",
                 mask: str | None = None) -> None:
        if rows not in ("tokens", "samples"):
            raise ConfigError(f"dataset(rows={rows!r}): expected 'tokens' (one row per "
                              "[batch, pos] position) or 'samples' (one row per batch element)")
        single = isinstance(names, str)
        wanted = (names,) if isinstance(names, str) else tuple(names)
        if not wanted or not all(isinstance(n, str) for n in wanted):
            raise ConfigError(f"dataset(names={names!r}): give a site name or a list of them")
        if mask is not None and rows != "tokens":
            raise ConfigError("dataset(mask=...) leaves out [batch, pos] positions: it needs "
                              "rows='tokens'")
        self.names = wanted
        self.rows: Rows = rows
        self.mask = mask
        self._single = single
        self._caps = caps
        self._forwards: list[int] = []
        self._starts: list[int] = []
        self._kept: list[torch.Tensor | None] = []
        self.row_shapes: dict[str, tuple[int, ...]] = {}
        """Each name's shape of one row."""
        total = 0
        for f in range(len(caps)):
            values = caps.forward(f)
            present = [n for n in wanted if n in values]
            if not present:
                continue
            if len(present) != len(wanted):
                raise DiskError(f"forward {f} holds {present} but not "
                                f"{[n for n in wanted if n not in values]}: rows of several "
                                "sites need every one of them in every forward")
            count = self._rows_of(f, {n: values[n] for n in wanted})
            kept = None
            if mask is not None:
                kept = self._masked(f, values, count)
                count = int(kept.numel())
            self._forwards.append(f)
            self._starts.append(total)
            self._kept.append(kept)
            total += count
        self._len = total
        self._cache: collections.OrderedDict[int, dict[str, torch.Tensor]] = \
            collections.OrderedDict()

    def _rows_of(self, f: int, values: dict[str, Any]) -> int:
        lead = 2 if self.rows == "tokens" else 1
        count = None
        for n, v in values.items():
            if not isinstance(v, torch.Tensor):
                raise DiskError(f"site {n!r} holds {type(v).__name__} values in forward {f}; "
                                "a dataset reads tensors (reference capture)")
            if v.dim() < lead:
                raise DiskError(f"site {n!r} has shape {tuple(v.shape)} in forward {f}: "
                                f"rows={self.rows!r} needs at least {lead} dims "
                                f"({'[batch, pos, ...]' if lead == 2 else '[batch, ...]'})")
            here = int(torch.Size(v.shape[:lead]).numel())
            if count is not None and here != count:
                raise DiskError(
                    f"forward {f}: the sites' leading dims differ "
                    f"({ {k: tuple(t.shape[:lead]) for k, t in values.items()} }); rows of "
                    "several sites need the same batch (and positions)")
            count = here
            shape = tuple(v.shape[lead:])
            if self.row_shapes.setdefault(n, shape) != shape:
                raise DiskError(f"site {n!r}: rows of shape {shape} in forward {f} but "
                                f"{self.row_shapes[n]} before; a dataset's rows have one shape")
        assert count is not None
        return count

    def _masked(self, f: int, values: Any, count: int) -> torch.Tensor:
        m = values[self.mask]
        if not isinstance(m, torch.Tensor) or m.dim() != 2 or m.numel() != count:
            raise DiskError(f"mask {self.mask!r} in forward {f} has shape "
                            f"{tuple(getattr(m, 'shape', ()))}, expected [batch, pos] "
                            f"matching the sites' {count} positions")
        return m.reshape(-1).nonzero().reshape(-1)

    def __len__(self) -> int:
        return self._len

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_cache"] = collections.OrderedDict()  # maps stay in the process that made them
        return state

    def _locate(self, i: int) -> tuple[int, int]:
        if isinstance(i, bool) or not -self._len <= i < self._len:
            raise IndexError(f"row {i!r} out of range: the dataset has {self._len} rows")
        i = int(i) % self._len
        k = bisect.bisect_right(self._starts, i) - 1
        return k, i - self._starts[k]

    def _flat(self, k: int) -> dict[str, torch.Tensor]:
        """Forward k's values with their leading dims flattened: views of the maps."""
        got = self._cache.get(k)
        if got is None:
            values = self._caps.forward(self._forwards[k])
            lead = 2 if self.rows == "tokens" else 1
            got = {n: values[n].flatten(0, lead - 1) if lead == 2 else values[n]
                   for n in self.names}
            self._cache[k] = got
            if len(self._cache) > 16:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(k)
        return got

    def _pack(self, values: dict[str, torch.Tensor]) -> Any:
        return values[self.names[0]] if self._single else values

    def __getitem__(self, i: int) -> Any:
        k, r = self._locate(i)
        kept = self._kept[k]
        row = int(kept[r]) if kept is not None else r
        return self._pack({n: t[row].clone() for n, t in self._flat(k).items()})

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        """Many rows at once (``DataLoader`` passes a batch): one gather per forward."""
        where = [self._locate(i) for i in indices]
        by_forward: dict[int, list[int]] = {}
        for pos, (k, _) in enumerate(where):
            by_forward.setdefault(k, []).append(pos)
        out: dict[str, list[torch.Tensor | None]] = {n: [None] * len(where) for n in self.names}
        for k, positions in by_forward.items():
            local = torch.tensor([where[p][1] for p in positions], dtype=torch.long)
            kept = self._kept[k]
            if kept is not None:
                local = kept[local]
            for n, t in self._flat(k).items():
                rows = t.index_select(0, local)
                for p, row in zip(positions, rows.unbind(0), strict=True):
                    out[n][p] = row
        return [self._pack({n: _filled(out[n][p]) for n in self.names})
                for p in range(len(where))]

    def __repr__(self) -> str:
        what = self.names[0] if self._single else list(self.names)
        masked = f", mask={self.mask!r}" if self.mask else ""
        return f"CaptureDataset({what!r}, rows={self.rows!r}{masked}, {self._len} rows)"


def _filled(row: torch.Tensor | None) -> torch.Tensor:
    if row is None:  # every position was filled by its forward's gather
        raise RuntimeError("internal: a dataset row was not read; please report this")
    return row
