"""Rows of one site, gathered straight from the memory maps: what ``Captures.rows`` and the
datasets read.

A site's *row space*: every forward holding the site, in order, its value ``[d0, d1, ...]``
flattened over its first ``lead`` dims (``lead=2``: one row per ``[batch, pos]`` token,
``lead=1``: one per batch element). A :class:`RowTable` says where each forward's rows lie
(shard, byte offset), learned from the shards' headers without reading data. A gather is one
NumPy fancy index per shard over a window of the shard's map in which row ``j`` starts at
byte ``j`` (``as_strided``), so rows of any dtype and offset are copied straight from the page
cache into the batch, as ``memmap[rows]`` would.

Checksums: each :data:`~fxprobe.sinks.shardfile.BLOCK` of a tensor is checked the first time a
row in it is read; the record of checked blocks is in shared memory, so ``DataLoader``
workers (forked or spawned) check each block once between them.
"""

from __future__ import annotations

import contextlib
import math
import mmap
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..core.errors import DiskError
from .shardfile import BLOCK, FROM_CODE, ShardReader


@dataclass
class Piece:
    """One forward's value of the site, as its shard's header places it."""

    forward: int
    shard: int
    key: str
    offset: int
    """Byte offset of the value in its shard's map."""
    rows: int
    nbytes: int


class RowTable:
    """Where every row of one site lies (see the module docstring)."""

    def __init__(self, site: str, lead: int, pieces: list[Piece], row_shape: tuple[int, ...],
                 dtype: torch.dtype, verify: bool) -> None:
        self.site = site
        self.lead = lead
        self.row_shape = row_shape
        self.dtype = dtype
        self.row_bytes = math.prod(row_shape) * dtype.itemsize
        self.keys = [p.key for p in pieces]
        self.forward = np.array([p.forward for p in pieces], dtype=np.int64)
        self.shard = np.array([p.shard for p in pieces], dtype=np.int64)
        self.offset = np.array([p.offset for p in pieces], dtype=np.int64)
        self.nbytes = [p.nbytes for p in pieces]
        self.starts = np.zeros(len(pieces) + 1, dtype=np.int64)
        np.cumsum([p.rows for p in pieces], out=self.starts[1:])
        blocks = [max(1, -(-p.nbytes // BLOCK)) for p in pieces]
        self.block_base = np.zeros(len(pieces) + 1, dtype=np.int64)
        np.cumsum(blocks, out=self.block_base[1:])
        # Shared memory: what one DataLoader worker checked, the others need not.
        self.checked = torch.zeros(int(self.block_base[-1]) if verify else 0,
                                   dtype=torch.bool).share_memory_() if verify else None
        self._windows: dict[int, tuple[ShardReader, np.ndarray]] = {}

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getstate__(self) -> dict[str, Any]:
        return dict(self.__dict__, _windows={})  # maps stay in the process that made them

    def locate(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The piece each row lies in and its row number there."""
        piece = np.searchsorted(self.starts, idx, side="right") - 1
        return piece, idx - self.starts[piece]

    def gather(self, idx: np.ndarray, reader: Callable[[int], ShardReader],
               check: Callable[[int, str, Any], None]) -> torch.Tensor:
        """Rows ``idx`` (1-d int64, in range), in that order, as a new tensor."""
        n, rb = len(idx), self.row_bytes
        if rb == 0 or n == 0:
            return torch.empty((n, *self.row_shape), dtype=self.dtype)
        piece, local = self.locate(idx)
        if self.checked is not None:
            self._check(piece, local, check, reader)
        off = self.offset[piece] + local * rb
        shard = self.shard[piece]
        first = int(shard[0])
        if (shard == first).all():
            out = self._window(first, reader)[off]
        else:
            out = np.empty((n, rb), dtype=np.uint8)
            order = np.argsort(shard, kind="stable")
            cuts = np.flatnonzero(np.diff(shard[order])) + 1
            for part in np.split(order, cuts):
                out[part] = self._window(int(shard[part[0]]), reader)[off[part]]
        return torch.from_numpy(out).view(self.dtype).view(n, *self.row_shape)

    def _window(self, k: int, reader: Callable[[int], ShardReader]) -> np.ndarray:
        r = reader(k)
        got = self._windows.get(k)
        if got is None or got[0] is not r:  # a shard reopened: its map is new
            whole = r.bytes_view()
            win = np.lib.stride_tricks.as_strided(
                whole, shape=(whole.size - self.row_bytes + 1, self.row_bytes),
                strides=(1, 1), writeable=False)
            got = self._windows[k] = (r, win)
            if len(self._windows) > 64:  # as Captures: each map holds a file descriptor
                del self._windows[next(iter(self._windows))]
        return got[1]

    def _prefetch(self, need: np.ndarray, owner: np.ndarray,
                  reader: Callable[[int], ShardReader]) -> None:
        """``madvise(WILLNEED)`` the blocks about to be checked: the kernel reads them ahead,
        in file order, instead of one page fault at a time."""
        page = mmap.PAGESIZE
        for g, p in zip(need.tolist(), owner.tolist(), strict=True):
            r = reader(int(self.shard[p]))
            j = g - int(self.block_base[p])
            lo = int(self.offset[p]) + j * BLOCK
            hi = min(lo + BLOCK, int(self.offset[p]) + self.nbytes[p])
            start = lo - lo % page
            if hi > start and hasattr(r.map, "madvise"):
                with contextlib.suppress(OSError, ValueError):
                    r.map.madvise(mmap.MADV_WILLNEED, start, hi - start)

    def _check(self, piece: np.ndarray, local: np.ndarray,
               check: Callable[[int, str, Any], None],
               reader: Callable[[int], ShardReader]) -> None:
        """Check the blocks the rows lie in that no process reading this table checked."""
        assert self.checked is not None
        done = self.checked.numpy()
        rb = self.row_bytes
        lo = local * rb // BLOCK
        hi = (local * rb + max(rb, 1) - 1) // BLOCK
        if rb > BLOCK:  # a row spans several blocks: every one of them
            span = hi - lo + 1
            ids = np.repeat(self.block_base[piece] + lo, span) + (
                np.arange(int(span.sum())) - np.repeat(np.cumsum(span) - span, span))
        else:
            ids = np.concatenate([self.block_base[piece] + lo, self.block_base[piece] + hi])
        need = np.unique(ids[~done[ids]])
        if not need.size:
            return
        owner = np.searchsorted(self.block_base, need, side="right") - 1
        if need.size > 1:  # a cold cache: ask for them all at once, read ahead in order
            self._prefetch(need, owner, reader)
        for g, p in zip(need.tolist(), owner.tolist(), strict=True):
            check(int(self.shard[p]), self.keys[p], [g - int(self.block_base[p])])
            done[g] = True


def build(site: str, lead: int, shards: list[tuple[int, int, ShardReader]],
          verify: bool) -> RowTable:
    """The row table of ``site`` over ``shards``: (shard number, its first forward, reader)."""
    pieces: list[Piece] = []
    row_shape: tuple[int, ...] | None = None
    dtype: torch.dtype | None = None
    for k, first, r in shards:
        for local in range(len(r)):
            layout = r.layouts[r.layout_of[local]]
            s = layout.get(site)
            if s is None:
                continue
            f = first + local
            if "t" not in s:
                raise DiskError(f"site {site!r} holds structured values in forward {f} "
                                "(tuples, dicts, stats); rows are read from tensors")
            key = f"{local + r.first}/{site}/{s['t']}"
            e = r.entry(key)
            shape = tuple(int(d) for d in e["shape"])
            code = FROM_CODE[e["dtype"]]
            if len(shape) < lead:
                raise DiskError(f"site {site!r} has shape {shape} in forward {f}: rows over "
                                f"{lead} leading dims need at least {lead} dims")
            tail = shape[lead:]
            if row_shape is None:
                row_shape, dtype = tail, code
            elif (tail, code) != (row_shape, dtype):
                raise DiskError(f"site {site!r}: {code} rows of shape {tail} in forward {f} but "
                                f"{dtype} rows of shape {row_shape} before; rows have one shape "
                                "and dtype")
            begin, end = e["data_offsets"]
            pieces.append(Piece(f, k, key, r.start + begin, math.prod(shape[:lead]),
                                end - begin))
    if row_shape is None or dtype is None:
        raise DiskError(f"site {site!r} has no value in any forward")
    return RowTable(site, lead, pieces, row_shape, dtype, verify)
