"""``fxprobe.open_captures``: captures written by :class:`fxprobe.Disk`, read lazily.

The format (see ``_disk.py`` for how it is written): a directory with ``index.json``, the
commit point, listing safetensors shards of whole forwards; tensors named
``"{forward}/{site}/{leaf}"``, the structure of each forward in the header's ``__metadata__``.
Tensors are returned as views of a memory map of their shard, so nothing is read until used.
"""

from __future__ import annotations

import bisect
import collections
import difflib
import json
import math
import mmap
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from ..capture.stats.math import Stats
from ..core.errors import DiskError, UnknownSiteError
from ..core.record import InOut
from .dataset import CaptureDataset, Rows

INDEX = "index.json"
FORMAT = "fxprobe-captures"
VERSION = 1
SHARD_RE = re.compile(r"^shard-(\d{6})\.safetensors$")
STATS_KEY = "__stats__"

DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}
for _name, _code in (("uint16", "U16"), ("uint32", "U32"), ("uint64", "U64"),
                     ("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2")):
    if hasattr(torch, _name):
        DTYPES[getattr(torch, _name)] = _code
_FROM_CODE = {code: dtype for dtype, code in DTYPES.items()}


def read_index(path: Path) -> dict[str, Any]:
    try:
        with open(path) as f:
            index = json.load(f)
    except (OSError, ValueError) as e:
        raise DiskError(f"cannot read {str(path)!r}: {e}") from e
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise DiskError(f"{str(path)!r} is not an fxprobe capture index")
    if index.get("version", 0) > VERSION:
        raise DiskError(f"{str(path)!r} was written by a newer fxprobe (format version "
                        f"{index['version']}); upgrade fxprobe to read it")
    return index


class _ShardReader:
    """A committed shard, memory-mapped; tensors are views of the map (read on access)."""

    def __init__(self, path: Path) -> None:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
            # ACCESS_COPY: a private, writable map (torch wants writable buffers); the file
            # itself is never changed.
            self.map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        self.start = 8 + n
        meta = json.loads(header.pop("__metadata__")["fxprobe"])
        self.first: int = meta["first"]
        self.layouts = [json.loads(s) for s in meta["layouts"]]
        self.layout_of: list[int] = meta["layout_of"]
        self.entries: dict[str, Any] = header

    def tensor(self, key: str) -> torch.Tensor:
        e = self.entries[key]
        dtype = _FROM_CODE[e["dtype"]]
        begin, end = e["data_offsets"]
        shape = e["shape"]
        if end == begin:
            return torch.empty(shape, dtype=dtype)
        count = (end - begin) // torch.empty((), dtype=dtype).element_size()
        flat = torch.frombuffer(self.map, dtype=dtype, count=count, offset=self.start + begin)
        return flat.view(shape)

    def forward(self, i: int) -> dict[str, Any]:
        layout = self.layouts[self.layout_of[i - self.first]]
        stats = self.tensor(f"{i}/{STATS_KEY}").tolist() if f"{i}/{STATS_KEY}" in \
            self.entries else []
        return {name: self._decode(f"{i}/{name}/", s, stats) for name, s in layout.items()}

    def _decode(self, prefix: str, s: dict[str, Any], stats: list[list[float]]) -> Any:
        if "t" in s:
            return self.tensor(f"{prefix}{s['t']}")
        if "s" in s:
            row = stats[s["s"]]
            shape = tuple(s["shape"])
            return Stats(shape=shape, dtype=s["dtype"], numel=math.prod(shape), mean=row[0],
                         std=row[1], min=row[2], max=row[3], absmax=row[4], zero_frac=row[5],
                         nan_count=int(row[6]), inf_count=int(row[7]))
        if "inout" in s:
            a, b = s["inout"]
            return InOut(self._decode(prefix, a, stats), self._decode(prefix, b, stats))
        if "tuple" in s:
            return tuple(self._decode(prefix, x, stats) for x in s["tuple"])
        if "list" in s:
            return [self._decode(prefix, x, stats) for x in s["list"]]
        if "dict" in s:
            return {k: self._decode(prefix, x, stats) for k, x in s["dict"]}
        return s["v"]


class CapturedForward(Mapping[str, Any]):
    """The values one forward wrote, by site name (tensors are memory-mapped views)."""

    def __init__(self, index: int, values: dict[str, Any], names: tuple[str, ...]) -> None:
        self.index = index
        self._values = values
        self._names = names

    def __getitem__(self, name: str) -> Any:
        try:
            return self._values[name]
        except KeyError:
            pass
        if name in self._names:
            raise UnknownSiteError(f"site {name!r} did not run in forward {self.index}")
        close = difflib.get_close_matches(name, self._names, n=5, cutoff=0.5)
        hint = f" Did you mean {', '.join(map(repr, close))}?" if close else ""
        raise UnknownSiteError(f"{name!r} is not a captured site.{hint} caps.names lists them.")

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        return f"CapturedForward({self.index}, {list(self._values)})"


class Captures:
    """Captures written by :class:`Disk`, read lazily: see :func:`open_captures`."""

    def __init__(self, path: Path, index: dict[str, Any]) -> None:
        self.path = path
        self._index = index
        self.names: tuple[str, ...] = tuple(index["sites"])
        """Site names, in the order they were first written."""
        self._shards: list[dict[str, Any]] = index["shards"]
        self._firsts = [s["first"] for s in self._shards]
        self._open: collections.OrderedDict[int, _ShardReader] = collections.OrderedDict()

    def __len__(self) -> int:
        return int(self._index["forwards"])

    def _shard(self, i: int) -> _ShardReader:
        k = bisect.bisect_right(self._firsts, i) - 1
        reader = self._open.get(k)
        if reader is None:
            reader = _ShardReader(self.path / self._shards[k]["file"])
            self._open[k] = reader
            if len(self._open) > 64:  # bound open maps; views keep theirs alive
                self._open.popitem(last=False)
        else:
            self._open.move_to_end(k)
        return reader

    def forward(self, i: int) -> CapturedForward:
        """Forward ``i``'s values (negative counts from the end), as ``keep="all"`` held them."""
        n = len(self)
        if isinstance(i, bool) or not isinstance(i, int) or not -n <= i < n:
            raise IndexError(f"forward {i!r} out of range: {str(self.path)!r} holds {n} "
                             "forward(s)")
        i %= n
        shard = self._shards[bisect.bisect_right(self._firsts, i) - 1]
        local = i - shard["first"] + shard.get("local_first", shard["first"])
        return CapturedForward(i, self._shard(i).forward(local), self.names)

    def rank_of(self, i: int) -> int | None:
        """The rank that wrote forward ``i`` (None where no rank was recorded)."""
        self.forward(i)  # checks i
        rank = self._shards[bisect.bisect_right(self._firsts, i % len(self)) - 1].get("rank")
        return None if rank is None else int(rank)

    def forwards(self) -> Iterator[CapturedForward]:
        """Every forward in order, one at a time (what is not held can be unmapped)."""
        for i in range(len(self)):
            yield self.forward(i)

    def __iter__(self) -> Iterator[CapturedForward]:
        return self.forwards()

    def __getitem__(self, name: str) -> torch.Tensor:
        """Every forward's tensor of site ``name`` concatenated along dim 0 (in memory)."""
        if name not in self.names:
            CapturedForward(-1, {}, self.names)[name]  # raises with close matches
        parts = []
        for f in self.forwards():
            if name not in f:
                continue
            v = f[name]
            if not isinstance(v, torch.Tensor):
                raise DiskError(
                    f"site {name!r} holds {type(v).__name__} values, which do not concatenate; "
                    f"read them one by one: [f[{name!r}] for f in caps]"
                )
            parts.append(v.reshape(1) if v.dim() == 0 else v)
        if not parts:
            raise DiskError(f"site {name!r} has no value in any forward")
        return torch.cat(parts)

    def __contains__(self, name: object) -> bool:
        return name in self.names

    def dataset(self, names: str | Sequence[str], rows: Rows = "tokens",
                mask: str | None = None) -> CaptureDataset:
        """The captured values as a map-style ``torch.utils.data.Dataset`` of rows.

        Args:
            names: a site name (rows are tensors) or several (rows are dicts by name); every
                forward that holds one of them must hold all, with the same leading dims.
            rows: ``"tokens"``: one row per ``[batch, pos]`` position of values shaped
                ``[batch, pos, ...]``; ``"samples"``: one row per batch element (dim 0).
            mask: a captured site holding a ``[batch, pos]`` mask (for example the
                ``attention_mask`` input of a transformer, tapped with the rest): only
                positions where it is non-zero become rows (``rows="tokens"`` only).

        Returns:
            A :class:`~fxprobe.sinks.dataset.CaptureDataset`: memory-mapped, picklable into
            ``DataLoader`` workers (each opens its own maps), over the committed shards only.

        Example:
            >>> ds = fxprobe.open_captures("acts/").dataset("blocks.3.resid_post")
            >>> loader = DataLoader(ds, batch_size=4096, shuffle=True, num_workers=2)
        """
        for n in ([names] if isinstance(names, str) else list(names)) + \
                ([mask] if mask is not None else []):
            if isinstance(n, str) and n not in self.names:
                CapturedForward(-1, {}, self.names)[n]  # raises with close matches
        return CaptureDataset(self, names, rows, mask)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_open"] = collections.OrderedDict()  # memory maps do not cross processes
        return state

    def __repr__(self) -> str:
        return (f"Captures({str(self.path)!r}, {len(self)} forwards, {len(self.names)} sites, "
                f"{len(self._shards)} shards)")


def open_captures(path: str | os.PathLike[str], rank: int | None = None) -> Captures:
    """Open captures written by ``fxprobe.Disk``; nothing is read until a value is used.

    Tensors are memory-mapped views of the shards, so a dataset larger than memory can be
    iterated forward by forward. Only what ``index.json`` lists is seen: shards still being
    written are not.

    Args:
        path: the directory given to ``fxprobe.Disk``.
        rank: one rank's captures, when several ranks wrote under ``path``; by default all
            of them, one after the other (rank 0's forwards first; ``caps.rank_of(i)`` says
            which rank wrote forward ``i``).

    Returns:
        A :class:`Captures`: ``caps.names``, ``len(caps)`` (forwards), ``caps.forward(i)[name]``
        and ``caps[name]`` (every forward's value concatenated along dim 0).

    Raises:
        DiskError: no captures there, or no captures of ``rank``.

    Example:
        >>> caps = fxprobe.open_captures("acts/")
        >>> caps.forward(0)["layer1.0.relu"].shape, caps["fc"].shape
    """
    p = Path(path)
    ranks = sorted(int(d.name[4:]) for d in p.glob("rank[0-9][0-9][0-9][0-9][0-9]")
                   if (d / INDEX).exists()) if p.is_dir() else []
    if rank is not None:
        if (p / f"rank{rank:05d}" / INDEX).exists():
            p = p / f"rank{rank:05d}"
        else:
            raise DiskError(f"{str(p)!r} holds no captures of rank {rank}; ranks there: "
                            f"{ranks or 'none'}")
    elif not (p / INDEX).exists():
        if ranks:
            return Captures(p, _all_ranks(p, ranks))
        raise DiskError(
            f"{str(p)!r} holds no captures ({INDEX} missing): nothing was committed there yet "
            "(a Disk commits on flush(), close() and each full shard)"
            if p.is_dir() else f"{str(p)!r} holds no captures: it does not exist",
        )
    return Captures(p, read_index(p / INDEX))



def _all_ranks(path: Path, ranks: list[int]) -> dict[str, Any]:
    """One index over every rank's committed shards under ``path``.

    Each rank commits its own ``index.json`` (no lock is shared between processes, which a
    network filesystem might not honour); this reads them all and lays their forwards end to
    end, recording each shard's rank and the forward numbering within it.
    """
    merged: dict[str, Any] = {"format": FORMAT, "version": VERSION, "sites": [],
                              "forwards": 0, "shards": []}
    for rank in ranks:
        index = read_index(path / f"rank{rank:05d}" / INDEX)
        for site in index["sites"]:
            if site not in merged["sites"]:
                merged["sites"].append(site)
        for shard in index["shards"]:
            merged["shards"].append(dict(
                shard, file=f"rank{rank:05d}/{shard['file']}", rank=rank,
                first=merged["forwards"] + shard["first"], local_first=shard["first"]))
        merged["forwards"] += index["forwards"]
    return merged
