"""``fxprobe.open_captures``: captures written by :class:`fxprobe.Disk`, read lazily.

The format (see ``_disk.py`` for how it is written): a directory with ``index.json``, the
commit point, listing safetensors shards of whole forwards; tensors named
``"{forward}/{site}/{leaf}"``, the structure of each forward in the header's ``__metadata__``.
Tensors are returned as views of a memory map of their shard, so nothing is read until used.
The map is private and copy-on-write: editing a returned tensor in place never changes the
file, but it does change what later reads through the same :class:`Captures` (and datasets
made from it) return; ``.clone()`` a value before editing it.

What the index says of a shard is checked before its values are returned: its size, its
forward range and rank, a header that parses with tensors inside the file whose byte sizes
match their dtypes and shapes, and (``verify=True``, indexes written since the checksums were
added) the CRC-32 of its header, and of its data the first time a forward of it is read.
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
import zlib
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Unpack

import torch

from ..capture.stats.math import Stats
from ..core.errors import DiskError, UnknownSiteError
from ..core.record import InOut
from .dataset import CaptureDataset, RowOptions, Rows, resolve_names

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
    try:
        total = 0
        for shard in index["shards"]:
            if int(shard["first"]) != total or int(shard["count"]) < 1:
                raise ValueError(f"shard {shard['file']!r} lists forwards from {shard['first']}"
                                 f" where {total} was expected")
            total += int(shard["count"])
        if int(index["forwards"]) != total:
            raise ValueError(f"it counts {index['forwards']} forwards where its shards hold "
                             f"{total}")
    except (KeyError, TypeError, ValueError) as e:
        raise DiskError(f"{str(path)!r} is corrupted: {e}; it was edited or overwritten "
                        "after it was written") from e
    return index


def rank_dirs(path: Path) -> list[int]:
    """The ranks with committed captures under ``path`` (``path/rank00001/index.json``)."""
    if not path.is_dir():
        return []
    return sorted(int(d.name[4:]) for d in path.glob("rank[0-9][0-9][0-9][0-9][0-9]")
                  if (d / INDEX).exists())


class _ShardReader:
    """A committed shard, memory-mapped; tensors are views of the map (read on access).

    What the index says of the shard is checked before anything is read as data: its size,
    a header that parses, a forward range that matches, every tensor inside the file. A shard
    that fails is reported by name (``DiskError``), never read.
    """

    def __init__(self, path: Path, listed: Mapping[str, Any] | None = None,
                 verify: bool = True) -> None:
        listed = listed or {}
        self.path = path
        try:
            f = open(path, "rb")
        except OSError as e:
            raise DiskError(f"shard {str(path)!r}, listed in the index, cannot be opened: {e}. "
                            "It was moved or deleted after it was committed") from e
        with f:
            size = os.fstat(f.fileno()).st_size
            expected = listed.get("bytes")
            if expected is not None and size != expected:
                raise DiskError(f"shard {str(path)!r} is corrupted: {size} bytes where the "
                                f"index says {expected} (truncated or overwritten); its "
                                "forwards cannot be read")
            head = f.read(8)
            n = int.from_bytes(head, "little")
            try:
                if not 2 <= n <= size - 8:
                    raise ValueError(f"a header of {n} bytes in a file of {size}")
                raw = f.read(n)
                crc = listed.get("header_crc32")
                header_ok = not verify or crc is None or zlib.crc32(head + raw) == crc
                header = json.loads(raw)
                meta = json.loads(header.pop("__metadata__")["fxprobe"])
                first, count = int(meta["first"]), len(meta["layout_of"])
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                raise DiskError(f"shard {str(path)!r} is corrupted: its header does not "
                                f"parse ({e}); its forwards cannot be read") from e
            if "first" in listed and (first, count) != (listed["first"], listed["count"]):
                raise DiskError(
                    f"shard {str(path)!r} holds forwards {first}..{first + count - 1} where the "
                    f"index says {listed['first']}..{listed['first'] + listed['count'] - 1}: "
                    "it is not the file the index committed")
            if meta.get("rank") is not None and meta["rank"] != listed.get("rank"):
                raise DiskError(
                    f"shard {str(path)!r} was written by rank {meta['rank']} where the index "
                    f"lists one of rank {listed.get('rank')}: it is not the file the index "
                    "committed (moved between directories?)")
            if not header_ok:
                raise DiskError(f"shard {str(path)!r} is corrupted: its header's checksum "
                                "differs from the index's (edited, or another file); its "
                                "forwards cannot be read")
            for key, entry in header.items():
                _check_entry(path, key, entry, size - 8 - n)
            # ACCESS_COPY: a private, writable map (torch wants writable buffers); the file
            # itself is never changed.
            self.map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        self.start = 8 + n
        self.crc: int | None = listed.get("crc32") if verify else None
        """The data's CRC-32 still to check (:meth:`check_data`), or None."""
        self.first: int = first
        self.layouts = [json.loads(s) for s in meta["layouts"]]
        self.layout_of: list[int] = meta["layout_of"]
        self.entries: dict[str, Any] = header

    def check_data(self) -> None:
        """Check the data's CRC-32 against the index's (once; reads the whole shard)."""
        if self.crc is None:
            return
        with memoryview(self.map) as whole, whole[self.start:] as data:
            crc = zlib.crc32(data)
        if crc != self.crc:
            raise DiskError(f"shard {str(self.path)!r} is corrupted: its data's checksum "
                            "differs from the index's (changed on disk after it was written); "
                            "its forwards cannot be read")
        self.crc = None

    def tensor(self, key: str) -> torch.Tensor:
        e = self.entries.get(key)
        if e is None:
            raise DiskError(f"shard {str(self.path)!r} is corrupted: it lacks tensor {key!r}, "
                            "which its forward's layout lists")
        dtype = _FROM_CODE[e["dtype"]]
        begin, end = e["data_offsets"]
        shape = e["shape"]
        if end == begin:
            return torch.empty(shape, dtype=dtype)
        count = (end - begin) // dtype.itemsize
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


def _check_entry(path: Path, key: str, entry: Any, data_size: int) -> None:
    """A header's tensor entry: a known dtype, a shape whose byte size is the data's, inside
    the file."""
    try:
        begin, end = entry["data_offsets"]
        shape = [int(d) for d in entry["shape"]]
        dtype = _FROM_CODE[entry["dtype"]]
        ok = all(d >= 0 for d in shape)
    except (KeyError, TypeError, ValueError):
        raise DiskError(f"shard {str(path)!r} is corrupted: tensor {key!r} has an unknown "
                        f"dtype or a malformed entry ({entry!r}); its forwards cannot be "
                        "read") from None
    if not 0 <= begin <= end <= data_size:
        raise DiskError(f"shard {str(path)!r} is corrupted: tensor {key!r} lies outside the "
                        "file; its forwards cannot be read")
    nbytes = math.prod(shape) * dtype.itemsize
    if not ok or end - begin != nbytes:
        raise DiskError(f"shard {str(path)!r} is corrupted: tensor {key!r} of shape {shape} "
                        f"and dtype {entry['dtype']} needs {nbytes} bytes where the file has "
                        f"{end - begin}; its forwards cannot be read")


class CapturedForward(Mapping[str, Any]):
    """The values one forward wrote, by site name (tensors are memory-mapped views)."""

    def __init__(self, index: int, values: dict[str, Any], names: tuple[str, ...],
                 canonical: Mapping[str, str] | None = None) -> None:
        self.index = index
        self._values = values
        self._names = names
        self._canonical = canonical or {}

    def __getitem__(self, name: str) -> Any:
        try:
            return self._values[self._canonical.get(name, name)]
        except KeyError:
            pass
        name = self._canonical.get(name, name)
        if name in self._names:
            raise UnknownSiteError(f"site {name!r} did not run in forward {self.index}")
        close = difflib.get_close_matches(name, [*self._names, *self._canonical], n=5,
                                          cutoff=0.5)
        hint = f" Did you mean {', '.join(map(repr, close))}?" if close else ""
        more = " and caps.canonical" if self._canonical else \
            " (these captures store no canonical names: read them by the model's own names)"
        raise UnknownSiteError(f"{name!r} is not a captured site.{hint} caps.names{more} "
                               "list them.")

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        return f"CapturedForward({self.index}, {list(self._values)})"


class Captures:
    """Captures written by :class:`Disk`, read lazily: see :func:`open_captures`."""

    def __init__(self, path: Path, index: dict[str, Any], verify: bool = True) -> None:
        self.path = path
        self._index = index
        self.verify = verify
        """Check each shard's checksums (its data's the first time a forward of it is read)."""
        self._verified: set[int] = set()
        self.names: tuple[str, ...] = tuple(index["sites"])
        """Site names, in the order they were first written."""
        self.canonical: dict[str, str] = {a: n for a, n in index.get("canonical", {}).items()
                                          if n in self.names and a not in self.names}
        """Canonical name (``blocks.6.resid_post``) -> site name (none in older captures)."""
        self._shards: list[dict[str, Any]] = index["shards"]
        self._firsts = [s["first"] for s in self._shards]
        self._open: collections.OrderedDict[int, _ShardReader] = collections.OrderedDict()

    def __len__(self) -> int:
        return int(self._index["forwards"])

    def _shard(self, i: int) -> _ShardReader:
        k = bisect.bisect_right(self._firsts, i) - 1
        reader = self._open.get(k)
        if reader is None:
            shard = self._shards[k]
            reader = _ShardReader(self.path / shard["file"],
                                  dict(shard, first=shard.get("local_first", shard["first"]),
                                       rank=self._rank(k)), self.verify)
            if k in self._verified:
                reader.crc = None
            self._open[k] = reader
            if len(self._open) > 64:  # bound open maps; views keep theirs alive
                self._open.popitem(last=False)
        else:
            self._open.move_to_end(k)
        return reader

    def _rank(self, k: int) -> int | None:
        rank = self._shards[k].get("rank", self._index.get("rank"))
        return None if rank is None else int(rank)

    def forward(self, i: int) -> CapturedForward:
        """Forward ``i``'s values (negative counts from the end), as ``keep="all"`` held them.

        Tensors are views of a private copy-on-write map of the shard: ``.clone()`` one
        before editing it in place, or later reads through these captures see the edit."""
        return self._forward(i, check_data=True)

    def _forward(self, i: int, check_data: bool) -> CapturedForward:
        """Forward ``i``; with ``check_data=False`` its shard's data is not read (nor its
        checksum checked) to make the views: what a dataset needs to learn the shapes."""
        n = len(self)
        if isinstance(i, bool) or not isinstance(i, int) or not -n <= i < n:
            raise IndexError(f"forward {i!r} out of range: {str(self.path)!r} holds {n} "
                             "forward(s)")
        i %= n
        shard = self._shards[bisect.bisect_right(self._firsts, i) - 1]
        local = i - shard["first"] + shard.get("local_first", shard["first"])
        reader = self._shard(i)
        if check_data and reader.crc is not None:
            reader.check_data()
            self._verified.add(bisect.bisect_right(self._firsts, i) - 1)
        return CapturedForward(i, reader.forward(local), self.names, self.canonical)

    def rank_of(self, i: int) -> int | None:
        """The rank that wrote forward ``i`` (None where no rank was recorded)."""
        n = len(self)
        if isinstance(i, bool) or not isinstance(i, int) or not -n <= i < n:
            raise IndexError(f"forward {i!r} out of range: {str(self.path)!r} holds {n} "
                             "forward(s)")
        return self._rank(bisect.bisect_right(self._firsts, i % n) - 1)

    def forwards(self) -> Iterator[CapturedForward]:
        """Every forward in order, one at a time (what is not held can be unmapped)."""
        for i in range(len(self)):
            yield self.forward(i)

    def __iter__(self) -> Iterator[CapturedForward]:
        return self.forwards()

    def __getitem__(self, name: str) -> torch.Tensor:
        """Every forward's tensor of site ``name`` concatenated along dim 0 (in memory)."""
        name = self.resolve(name)
        if name not in self.names:
            CapturedForward(-1, {}, self.names)[name]  # raises with close matches
        parts: list[torch.Tensor] = []
        for f in self.forwards():
            if name not in f:
                continue
            v = f[name]
            if not isinstance(v, torch.Tensor):
                raise DiskError(
                    f"site {name!r} holds {type(v).__name__} values, which do not concatenate; "
                    f"read them one by one: [f[{name!r}] for f in caps]"
                )
            v = v.reshape(1) if v.dim() == 0 else v
            if parts and (v.shape[1:] != parts[0].shape[1:] or v.dtype != parts[0].dtype):
                raise DiskError(
                    f"site {name!r} holds {v.dtype} values of shape {tuple(v.shape)} in forward "
                    f"{f.index} but {parts[0].dtype} of shape {tuple(parts[0].shape)} before: "
                    "they concatenate along dim 0 only with the same dtype and trailing "
                    f"dims; read them one by one: [f[{name!r}] for f in caps]")
            parts.append(v)
        if not parts:
            raise DiskError(f"site {name!r} has no value in any forward")
        return torch.cat(parts)

    def __contains__(self, name: object) -> bool:
        return name in self.names or name in self.canonical

    def resolve(self, name: str) -> str:
        """The site ``name`` is stored as: itself, or the site of that canonical name."""
        return name if name in self.names else self.canonical.get(name, name)

    def dataset(self, names: str | Sequence[str], rows: Rows = "tokens",
                mask: str | None = None, **options: Unpack[RowOptions]) -> CaptureDataset:
        """The captured values as a map-style ``torch.utils.data.Dataset`` of rows.

        Args:
            names: a site name (rows are tensors) or several (rows are dicts by name); every
                forward that holds one of them must hold all, with the same leading dims.
            rows: ``"tokens"``: one row per ``[batch, pos]`` position of values shaped
                ``[batch, pos, ...]``; ``"samples"``: one row per batch element (dim 0).
            mask: a captured site holding a ``[batch, pos]`` mask (for example the
                ``attention_mask`` input of a transformer, tapped with the rest): only
                positions where it is non-zero become rows (``rows="tokens"`` only).
            **options: ``positions=``, ``exclude_token_ids=``, ``tokens=``, ``normalize=``,
                ``layout=`` (:class:`~fxprobe.sinks.dataset.RowOptions`); names may be
                canonical.

        Returns:
            A :class:`~fxprobe.sinks.dataset.CaptureDataset`: memory-mapped, picklable into
            ``DataLoader`` workers (each opens its own maps), over the committed shards only.

        Example:
            >>> ds = fxprobe.open_captures("acts/").dataset("blocks.3.resid_post")
            >>> loader = DataLoader(ds, batch_size=4096, shuffle=True, num_workers=2)
        """
        keys, (names, mask) = names, resolve_names(self.resolve, names, mask, options)
        for n in ([names] if isinstance(names, str) else list(names)) + \
                ([mask] if mask is not None else []):
            if isinstance(n, str) and n not in self.names:
                CapturedForward(-1, {}, self.names, self.canonical)[n]  # raises, close matches
        return CaptureDataset(self, names, rows, mask, keys=keys, **options)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_open"] = collections.OrderedDict()  # memory maps do not cross processes
        return state

    def __repr__(self) -> str:
        return (f"Captures({str(self.path)!r}, {len(self)} forwards, {len(self.names)} sites, "
                f"{len(self._shards)} shards)")


def open_captures(path: str | os.PathLike[str], rank: int | None = None,
                  verify: bool = True) -> Captures:
    """Open captures written by ``fxprobe.Disk``; nothing is read until a value is used.

    Tensors are memory-mapped views of the shards, so a dataset larger than memory can be
    iterated forward by forward. Only what ``index.json`` lists is seen: shards still being
    written are not.

    Args:
        path: the directory given to ``fxprobe.Disk``.
        rank: one rank's captures, when several ranks wrote under ``path``; by default all
            of them, one after the other (rank 0's forwards first; ``caps.rank_of(i)`` says
            which rank wrote forward ``i``).
        verify: check each shard's CRC-32 checksums against the index (its header when it is
            opened, its data the first time a forward of it is read, which reads the whole
            shard once per process); ``False`` skips them (sizes, forward ranges, ranks and
            the header's dtypes and shapes are checked always). Indexes written before the
            checksums were added are read unchecked.

    Returns:
        A :class:`Captures`: ``caps.names``, ``len(caps)`` (forwards), ``caps.forward(i)[name]``
        and ``caps[name]`` (every forward's value concatenated along dim 0).

    Raises:
        DiskError: no captures there, or no captures of ``rank``, or captures both with and
            without ranks; when a value is read: a shard that is missing, corrupted or not
            the one the index committed (named in the message).

    Example:
        >>> caps = fxprobe.open_captures("acts/")
        >>> caps.forward(0)["layer1.0.relu"].shape, caps["fc"].shape
    """
    p = Path(path)
    ranks = rank_dirs(p)
    if ranks and (p / INDEX).exists():
        raise DiskError(f"{str(p)!r} holds captures written without a rank ({INDEX}) and "
                        f"captures of ranks {ranks} (rank* directories); move one of them to "
                        "another directory")
    if rank is not None:
        if (p / f"rank{rank:05d}" / INDEX).exists():
            p = p / f"rank{rank:05d}"
            return Captures(p, dict(read_index(p / INDEX), rank=rank), verify)
        raise DiskError(f"{str(p)!r} holds no captures of rank {rank}; ranks there: "
                        f"{ranks or 'none'}")
    if not (p / INDEX).exists():
        if ranks:
            return Captures(p, _all_ranks(p, ranks), verify)
        raise DiskError(
            f"{str(p)!r} holds no captures ({INDEX} missing): nothing was committed there yet "
            "(a Disk commits on flush(), close() and each full shard)"
            if p.is_dir() else f"{str(p)!r} holds no captures: it does not exist",
        )
    return Captures(p, read_index(p / INDEX), verify)


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
        for alias, site in index.get("canonical", {}).items():
            merged.setdefault("canonical", {}).setdefault(alias, site)
        for shard in index["shards"]:
            merged["shards"].append(dict(
                shard, file=f"rank{rank:05d}/{shard['file']}", rank=rank,
                first=merged["forwards"] + shard["first"], local_first=shard["first"]))
        merged["forwards"] += index["forwards"]
    return merged
