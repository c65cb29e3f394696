"""``fxprobe.open_captures``: captures written by :class:`fxprobe.Disk`, read lazily.

The format (see ``disk.py`` for how it is written): a directory with ``index.json``, the
commit point, listing safetensors shards of whole forwards; tensors named
``"{forward}/{site}/{leaf}"``, the structure of each forward in the header's ``__metadata__``.
Tensors are returned as views of a memory map of their shard, so nothing is read until used.
The map is private and copy-on-write: editing a returned tensor in place never changes the
file, but it does change what later reads through the same :class:`Captures` (and datasets
made from it) return; ``.clone()`` a value before editing it.

What the index says of a shard is checked before its values are returned: size, forward
range, rank, a header that parses with tensors inside the file whose byte sizes match their
dtypes and shapes, and (``verify=True``) the CRC-32 of the header and of each block of data the
first time a value or row in it is read (:mod:`.shardfile`; rows: :mod:`.rowtable`).
"""

from __future__ import annotations

import bisect
import collections
import math
import os
import threading
import warnings
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, Unpack

import numpy as np
import torch

from ..capture.stats.math import Stats
from ..core.errors import ConfigError, DiskError, UnknownSiteError
from ..core.names import did_you_mean
from ..core.record import InOut
from . import rowtable as _rows
from .catalog import (
    INDEX,
    STATS_KEY,
    _all_ranks,
    _snapshot,
    has_captures,
    rank_dirs,
)
from .dataset import CaptureDataset, RowOptions, Rows, resolve_names
from .shardfile import ShardReader


def _decode(r: ShardReader, i: int, check: bool) -> dict[str, Any]:
    """Forward ``i`` (as written) of shard ``r``: its values by site, tensors as views."""
    layout = r.layouts[r.layout_of[i - r.first]]
    skey = f"{i}/{STATS_KEY}"
    stats = r.tensor(skey, check).tolist() if skey in r.entries else []

    def dec(prefix: str, s: dict[str, Any]) -> Any:
        if "t" in s:
            return r.tensor(f"{prefix}{s['t']}", check)
        if "s" in s:
            row = stats[s["s"]]
            shape = tuple(s["shape"])
            return Stats(shape=shape, dtype=s["dtype"], numel=math.prod(shape), mean=row[0],
                         std=row[1], min=row[2], max=row[3], absmax=row[4], zero_frac=row[5],
                         nan_count=int(row[6]), inf_count=int(row[7]))
        if "inout" in s:
            a, b = s["inout"]
            return InOut(dec(prefix, a), dec(prefix, b))
        if "tuple" in s:
            return tuple(dec(prefix, x) for x in s["tuple"])
        if "list" in s:
            return [dec(prefix, x) for x in s["list"]]
        if "dict" in s:
            return {k: dec(prefix, x) for k, x in s["dict"]}
        return s["v"]

    return {name: dec(f"{i}/{name}/", s) for name, s in layout.items()}


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
        hint = did_you_mean(name, [*self._names, *self._canonical])
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


OnError = Literal["raise", "skip"]


def _ident(shard: dict[str, Any]) -> tuple[Any, ...]:
    """What tells a shard from another written under the same name (checks stay with it)."""
    return (shard["file"], shard.get("bytes"), shard.get("header_crc32"), shard.get("rank"))


class Skipped:
    """A shard ``open_captures(..., on_error="skip")`` left out, and why."""

    def __init__(self, file: str, forwards: int, reason: str) -> None:
        self.file = file
        """The shard, relative to the captures' directory."""
        self.forwards = forwards
        """How many forwards it held (left out with it)."""
        self.reason = reason

    def __repr__(self) -> str:
        return f"Skipped({self.file!r}, forwards={self.forwards}, {self.reason!r})"


class Captures:
    """Captures written by :class:`Disk`, read lazily: see :func:`open_captures`."""

    def __init__(self, path: Path, rank: int | None, verify: bool = True,
                 on_error: OnError = "raise", ranks: list[int] | None = None) -> None:
        self.path = path
        self.verify = verify
        """Check checksums (each block of a value the first time it is read)."""
        self.on_error: OnError = on_error
        self.skipped: list[Skipped] = []
        """Shards left out by ``on_error="skip"`` (empty otherwise)."""
        self._rank_arg = rank
        self._ranks = ranks
        self._verified: set[tuple[Any, ...]] = set()
        self._checked: dict[tuple[Any, ...], set[tuple[str, int]]] = {}
        self._open: collections.OrderedDict[int, ShardReader] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._tables: dict[tuple[str, int], _rows.RowTable] = {}
        self._shards: list[dict[str, Any]] = []
        self.refresh()

    def refresh(self) -> int:
        """Read the index (and the journal of the shard being written) again: forwards
        committed since are seen from now on. Forwards seen before keep their numbers and
        values; datasets made earlier keep their rows (make a new one to read the new).

        Returns:
            How many forwards there are now.
        """
        if self._ranks is not None:
            self._ranks = rank_dirs(self.path) or self._ranks
        index = (_all_ranks(self.path, self._ranks) if self._ranks is not None
                 else _snapshot(self.path, self._rank_arg))
        self._index = index
        old = {s["file"]: (k, s) for k, s in enumerate(self._shards)}
        shards: list[dict[str, Any]] = []
        for shard in index["shards"]:
            was = old.get(shard["file"])
            if was is not None and was[1].get("count") == shard["count"] and \
                    "journal" not in was[1] and "journal" not in shard:
                shard = was[1]  # unchanged: its readers and checks stay
            shards.append(shard)
        self._shards = shards
        self._open.clear()
        self._tables.clear()
        if self.on_error == "skip":
            self._skip_bad()
        self._firsts: list[int] = []
        total = 0
        for shard in self._shards:
            self._firsts.append(total)
            total += int(shard["count"])
        self._len = total
        self.names: tuple[str, ...] = tuple(index["sites"])
        """Site names, in the order they were first written."""
        self.canonical: dict[str, str] = {a: n for a, n in index.get("canonical", {}).items()
                                          if n in self.names and a not in self.names}
        """Canonical name (``blocks.6.resid_post``) -> site name (none in older captures)."""
        return total

    def _skip_bad(self) -> None:
        """Check every shard whole (header, data checksums), leaving out those that fail."""
        kept, skipped = [], []
        for k, shard in enumerate(self._shards):
            if shard.get("checked"):
                kept.append(shard)
                continue
            try:
                r = self._reader(shard, k)
                r.check_data()
                if r.crcs is not None:
                    for key in r.crcs:
                        r.check_tensor(key)
                shard["checked"] = True
                kept.append(shard)
            except DiskError as e:
                skipped.append(Skipped(shard["file"], int(shard["count"]), str(e)))
        self._open.clear()
        if skipped:
            self.skipped += skipped
            lost = sum(s.forwards for s in skipped)
            warnings.warn(
                f"open_captures({str(self.path)!r}, on_error='skip') left out "
                f"{len(skipped)} shard(s) holding {lost} forward(s) (the forwards after them "
                "are numbered on without a gap; caps.skipped lists what and why): "
                + "; ".join(f"{x.file}: {x.reason}" for x in skipped[:3]), stacklevel=3)
        self._shards = kept

    def __len__(self) -> int:
        return self._len

    @property
    def appends_only(self) -> bool:
        """:meth:`refresh` only adds forwards after those seen (one directory, not several
        ranks read as one, whose later ranks' forwards move as earlier ranks add; nor with
        ``on_error="skip"``, which may leave out a shard it read before)."""
        return self._ranks is None and self.on_error == "raise"

    def _reader(self, shard: dict[str, Any], k: int) -> ShardReader:
        listed = dict(shard, first=shard.get("local_first", shard["first"]), rank=shard.get(
            "rank", self._index.get("rank")))
        journal = shard.get("journal")
        if journal is None:
            return ShardReader(self.path / shard["file"], listed, self.verify)
        path = self.path / shard["file"]
        if not path.exists():  # committed since the snapshot: the same bytes, renamed
            path = path.with_name(path.name[:-len(".partial")])
        listed.pop("bytes", None)
        return ShardReader(path, listed, self.verify, (journal[0], journal[1]))

    def _shard_at(self, k: int) -> ShardReader:
        """Shard ``k`` (position in the list), opened once and kept among the last 64; one
        thread at a time (``ds.loader(num_workers=k)`` gathers in threads)."""
        with self._lock:
            reader = self._open.get(k)
            if reader is None:
                reader = self._reader(self._shards[k], k)
                if _ident(self._shards[k]) in self._verified:
                    reader.crc = None
                reader.checked = self._checked.setdefault(_ident(self._shards[k]), set())
                self._open[k] = reader
                if len(self._open) > 64:  # bound open maps; views keep theirs alive
                    self._open.popitem(last=False)
            else:
                self._open.move_to_end(k)
            return reader

    def _check(self, k: int, key: str, blocks: Any) -> None:
        r = self._shard_at(k)
        r.check_blocks(key, blocks)
        if r.crcs is None:
            self._verified.add(_ident(self._shards[k]))

    def _shard(self, i: int) -> ShardReader:
        return self._shard_at(bisect.bisect_right(self._firsts, i) - 1)

    def _rank(self, k: int) -> int | None:
        rank = self._shards[k].get("rank", self._index.get("rank"))
        return None if rank is None else int(rank)

    def forward(self, i: int) -> CapturedForward:
        """Forward ``i``'s values (negative counts from the end), as ``keep="all"`` held them.

        Tensors are views of a private copy-on-write map of the shard: ``.clone()`` one
        before editing it in place, or later reads through these captures see the edit."""
        return self._forward(i, check_data=True)

    def _forward(self, i: int, check_data: bool) -> CapturedForward:
        """Forward ``i``; with ``check_data=False`` its data is not read (nor its checksums
        checked) to make the views: what a dataset needs to learn the shapes."""
        n = len(self)
        if isinstance(i, bool) or not isinstance(i, int) or not -n <= i < n:
            raise IndexError(f"forward {i!r} out of range: {str(self.path)!r} holds {n} "
                             "forward(s)")
        i %= n
        k = bisect.bisect_right(self._firsts, i) - 1
        reader = self._shard_at(k)
        if check_data and reader.crc is not None:
            reader.check_data()
            self._verified.add(_ident(self._shards[k]))
        values = _decode(reader, i - self._firsts[k] + reader.first, check_data)
        return CapturedForward(i, values, self.names, self.canonical)

    def rows(self, site: str, indices: Any, lead: int = 2, *, out: Any = None) -> torch.Tensor:
        """Rows of ``site`` by number in its row space, gathered from the memory maps.

        The row space of a site: every forward that holds it, in order, its value
        ``[d0, d1, ...]`` flattened over its first ``lead`` dims (``lead=2``: one row per
        ``[batch, pos]`` token; ``1``: one per batch element); :meth:`row_count` says how many.
        One ``index_select`` per shard the rows lie in (sorted indices read the page cache in
        order); each block checked against its checksum the first time a row in it is read.

        Args:
            site: a site name holding tensors.
            indices: 1-d integers (NumPy array, tensor, list), any order, repeats allowed.
            lead: the leading dims that make rows (1 or 2).
            out: a contiguous CPU tensor of the result's shape and dtype to write into.

        Returns:
            A new tensor ``[len(indices), *row_shape]`` of the site's dtype (or ``out``), in
            the order of ``indices``: not a view, editing it changes nothing else.

        Raises:
            IndexError: an index outside ``[0, row_count(site, lead))``.
            DiskError: a value that is not a tensor, rows of different shapes or dtypes, or
                a corrupted block (the shard named).
        """
        table = self._table(site, lead)
        idx = np.asarray(indices.numpy() if isinstance(indices, torch.Tensor) else indices)
        if idx.dtype.kind not in "iu" and idx.size:
            raise TypeError(f"rows({site!r}, ...) takes integer indices, not {idx.dtype}")
        idx = idx.astype(np.int64, copy=False).reshape(-1)
        n = len(table)
        if idx.size and (int(idx.min()) < 0 or int(idx.max()) >= n):
            bad = idx[(idx < 0) | (idx >= n)][0]
            raise IndexError(f"row {int(bad)} out of range: site {site!r} has {n} rows")
        return table.gather(idx, self._shard_at, self._check, out)

    def row_count(self, site: str, lead: int = 2) -> int:
        """How many rows :meth:`rows` reads from (see there)."""
        return len(self._table(site, lead))

    def _table(self, site: str, lead: int) -> _rows.RowTable:
        if lead not in (1, 2):
            raise ConfigError(f"rows(lead={lead!r}): 1 (batch elements) or 2 ([batch, pos])")
        site = self.resolve(site)
        if site not in self.names:
            CapturedForward(-1, {}, self.names, self.canonical)[site]  # raises, close matches
        table = self._tables.get((site, lead))
        if table is None:
            shards = [(k, self._firsts[k], self._shard_at(k)) for k in range(len(self._shards))]
            table = self._tables[(site, lead)] = _rows.build(site, lead, shards, self.verify)
        return table

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

    def __getstate__(self) -> dict[str, Any]:  # memory maps and locks stay in a process
        return {**self.__dict__, "_open": collections.OrderedDict(), "_lock": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _lock=threading.Lock())

    def __repr__(self) -> str:
        return (f"Captures({str(self.path)!r}, {len(self)} forwards, {len(self.names)} sites, "
                f"{len(self._shards)} shards)")


def open_captures(path: str | os.PathLike[str], rank: int | None = None,
                  verify: bool = True, on_error: OnError = "raise") -> Captures:
    """Open captures written by ``fxprobe.Disk``; nothing is read until a value is used.

    Tensors are memory-mapped views of the shards, so a dataset larger than memory can be
    iterated forward by forward. What is seen: the shards ``index.json`` lists, and the
    forwards that the journal of the shard being written lists (each complete once its line
    is there), as of this call; ``caps.refresh()`` looks again.

    Args:
        path: the directory given to ``fxprobe.Disk``.
        rank: one rank's captures, when several ranks wrote under ``path``; by default all
            of them, one after the other (rank 0's forwards first; ``caps.rank_of(i)`` says
            which rank wrote forward ``i``).
        verify: check CRC-32 checksums: a shard's header when it is opened, each block of
            a value the first time it is read (so reading one site reads and checks that
            site's bytes only; shards written before per-block checksums: the whole shard the
            first time a forward of it is read); ``False`` skips them (sizes, forward ranges,
            ranks and the header's dtypes and shapes are checked always). Indexes written
            before the checksums were added are read unchecked.
        on_error: ``"raise"`` (the default): a shard that is missing or corrupted raises
            ``DiskError`` naming it when a value of it is read. ``"skip"``: every shard is
            checked whole now (its header, and every byte of its data against its checksums:
            one read of the directory), and those that fail are left out with a warning;
            ``caps.skipped`` lists them, the forwards after them are numbered on.

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
    if on_error not in ("raise", "skip"):
        raise ConfigError(f"open_captures(on_error={on_error!r}): 'raise' or 'skip'")
    p = Path(path)
    ranks = rank_dirs(p)
    if ranks and has_captures(p):
        raise DiskError(f"{str(p)!r} holds captures written without a rank ({INDEX}) and "
                        f"captures of ranks {ranks} (rank* directories); move one of them to "
                        "another directory")
    if rank is not None:
        if has_captures(p / f"rank{rank:05d}"):
            return Captures(p / f"rank{rank:05d}", rank, verify, on_error)
        raise DiskError(f"{str(p)!r} holds no captures of rank {rank}; ranks there: "
                        f"{ranks or 'none'}")
    if not has_captures(p):
        if ranks:
            return Captures(p, None, verify, on_error, ranks)
        raise DiskError(
            f"{str(p)!r} holds no captures ({INDEX} missing): nothing was committed there yet "
            "(a Disk commits on flush(), close() and each full shard)"
            if p.is_dir() else f"{str(p)!r} holds no captures: it does not exist",
        )
    return Captures(p, None, verify, on_error)
