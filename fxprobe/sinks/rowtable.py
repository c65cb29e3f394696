"""Rows of one site, gathered straight from the memory maps: what ``Captures.rows`` and the
datasets read.

A site's *row space*: every forward holding the site, in order, its value ``[d0, d1, ...]``
flattened over its first ``lead`` dims (``lead=2``: one row per ``[batch, pos]`` token,
``lead=1``: one per batch element). A :class:`RowTable` says where each forward's rows lie
(shard, byte offset), learned from the shards' headers without reading data. A shard's map is
seen as rows of ``row_bytes`` bytes on a *grid* starting at one residue of the byte offsets
mod ``row_bytes`` (every piece of a site in a shard usually lies on one), and a gather is one
``numpy.take(grid, rows, out=...)`` per grid the rows lie on, written straight into the
batch's one output tensor: rows of any dtype are copied from the page cache as
``memmap[rows]`` would, on the calling thread, without the GIL (``mode="clip"``: the rows are
checked before; ``"raise"`` would copy through a temporary). Not ``torch.index_select``,
whose intra-op threads stall behind any other busy process on the cores (5x slower measured
on a shared 2-core machine).

Checksums: each :data:`~fxprobe.sinks.shardfile.BLOCK` of a tensor is checked the first time a
row in it is read; the record of checked blocks is in shared memory, so ``DataLoader``
workers (forked or spawned) check each block once between them.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..core.errors import ConfigError, DiskError
from .shardfile import BLOCK, FROM_CODE, ShardReader, in_a_map


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
        rb = max(self.row_bytes, 1)
        self.grid = self.shard * rb + self.offset % rb
        """Each piece's grid: its shard and the residue of its offset (``shard * rb + r``)."""
        self.grid_row = self.offset // rb
        """The row of its grid each piece starts at."""
        self._grids: dict[int, tuple[ShardReader, np.ndarray]] = {}
        self._checking = threading.Lock()
        self._all_checked = self.checked is not None and not len(self.checked)

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getstate__(self) -> dict[str, Any]:
        # maps and locks stay in the process that made them
        return dict(self.__dict__, _grids={}, _checking=None)

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _checking=threading.Lock())

    def locate(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The piece each row lies in and its row number there."""
        piece = np.searchsorted(self.starts, idx, side="right") - 1
        return piece, idx - self.starts[piece]

    def gather(self, idx: np.ndarray, reader: Callable[[int], ShardReader],
               check: Callable[[int, str, Any], None], into: torch.Tensor | None = None
               ) -> torch.Tensor:
        """Rows ``idx`` (1-d int64, in range), in that order, as a new tensor (or written
        into ``into``: contiguous, ``[len(idx), *row_shape]`` of the site's dtype)."""
        n, rb = len(idx), self.row_bytes
        result = torch.empty((n, *self.row_shape), dtype=self.dtype) if into is None else into
        if into is not None:
            self._check_into(into, n)
            if in_a_map(into):  # any shard's, not only this gather's: caps.forward(i) views
                raise ConfigError(f"rows({self.site!r}, out=...): out is a view of captured "
                                  "memory (a shard this process maps); pass a tensor of your "
                                  "own")
        if rb == 0 or n == 0:
            return result
        piece, local = self.locate(idx)
        if self.checked is not None and not self._all_checked:
            with self._checking:  # threads of ds.loader: each block checked by one of them
                self._check(piece, local, check, reader)
        row = self.grid_row[piece] + local
        grid = self.grid[piece]
        dest = result.view(-1).view(torch.uint8).view(n, rb).numpy()
        cuts = np.flatnonzero(grid[1:] != grid[:-1]) + 1
        if not cuts.size:  # one grid (every batch of a site on one grid in one shard)
            np.take(self._grid(int(grid[0]), reader), row, 0, out=dest, mode="clip")
        elif (grid[cuts] > grid[cuts - 1]).all():  # sorted rows: each grid's rows together
            for a, b in zip([0, *cuts.tolist()], [*cuts.tolist(), n], strict=True):
                np.take(self._grid(int(grid[a]), reader), row[a:b], 0, out=dest[a:b],
                        mode="clip")
        else:  # rows of several grids in any order: gather by grid, then put in place
            order = np.argsort(grid, kind="stable")
            grouped, row = grid[order], row[order]
            bounds = [0, *(np.flatnonzero(grouped[1:] != grouped[:-1]) + 1).tolist(), n]
            tmp = np.empty_like(dest)
            for a, b in zip(bounds[:-1], bounds[1:], strict=True):
                np.take(self._grid(int(grouped[a]), reader), row[a:b], 0, out=tmp[a:b],
                        mode="clip")
            dest[order] = tmp
        return result

    def _check_into(self, out: Any, n: int) -> None:
        want = (n, *self.row_shape)
        if isinstance(out, torch.Tensor) and tuple(out.shape) == want and \
                out.dtype == self.dtype and out.device.type == "cpu" and out.is_contiguous():
            return
        got = (f"{tuple(out.shape)} {out.dtype} on {out.device}"
               f"{'' if out.is_contiguous() else ', not contiguous'}"
               if isinstance(out, torch.Tensor) else type(out).__name__)
        raise ConfigError(f"rows({self.site!r}, out=...): out must be a contiguous CPU tensor "
                          f"{want} of {self.dtype} (one row per index), not {got}")

    def _grid(self, g: int, reader: Callable[[int], ShardReader]) -> np.ndarray:
        """Grid ``g`` (see :attr:`grid`): its shard's map as ``[rows, row_bytes]`` bytes."""
        rb = self.row_bytes
        r = reader(g // rb)
        got = self._grids.get(g)
        if got is None or got[0] is not r:  # a shard reopened: its map is new
            whole = r.bytes_view()
            first = g % rb
            rows = (whole.size - first) // rb
            got = self._grids[g] = (r, whole[first:first + rows * rb].reshape(rows, rb))
            if len(self._grids) > 64:  # as Captures: each map holds a file descriptor
                # (threads of ds.loader may drop the same one, or add one, meanwhile)
                with contextlib.suppress(RuntimeError, KeyError, StopIteration):
                    del self._grids[next(iter(self._grids))]
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
            self._all_checked = bool(done.all())  # then no batch needs to look again
            return
        owner = np.searchsorted(self.block_base, need, side="right") - 1
        if need.size > 1:  # a cold cache: ask for them all at once, read ahead in order
            self._prefetch(need, owner, reader)
        for g, p in zip(need.tolist(), owner.tolist(), strict=True):
            check(int(self.shard[p]), self.keys[p], [g - int(self.block_base[p])])
            done[g] = True
        self._all_checked = bool(done.all())


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
