"""One shard as a reader sees it: a committed safetensors file (its header says what is where)
or the ``.partial`` file a writer is still appending to (its journal says which forwards are
complete), memory-mapped; and its checksums, checked block by block as blocks are read.

Checksums: shards written since per-block checksums were added hold, in their header's
``__metadata__`` (and in each journal line), a CRC-32 of every :data:`BLOCK` bytes of every
tensor; a reader checks a block the first time it reads from it, so reading one site checks
that site's bytes only. Older shards have one CRC-32 of all their data in the index, checked
(the whole shard) the first time a forward of it is read.
"""

from __future__ import annotations

import ctypes
import json
import math
import mmap
import os
import threading
import weakref
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..core.errors import DiskError

BLOCK = 1 << 20
"""Bytes of a tensor per CRC-32 (the last block of a tensor may be shorter)."""

JOURNAL = ".journal"
"""Suffix of the journal beside a ``.partial`` shard: one line per complete forward."""

DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}
for _name, _code in (("uint16", "U16"), ("uint32", "U32"), ("uint64", "U64"),
                     ("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2")):
    if hasattr(torch, _name):
        DTYPES[getattr(torch, _name)] = _code
FROM_CODE = {code: dtype for dtype, code in DTYPES.items()}


def block_crcs(data: Any) -> list[int]:
    """CRC-32 of each :data:`BLOCK` bytes of ``data`` (bytes, or a 1-d uint8 array)."""
    with memoryview(data) as mv:
        return [zlib.crc32(mv[i:i + BLOCK]) for i in range(0, len(mv), BLOCK)]


def journal_line(record: dict[str, Any]) -> bytes:
    """One journal line: JSON, a tab, its CRC-32 (a torn or changed line is not trusted)."""
    text = json.dumps(record, separators=(",", ":"))
    return f"{text}\t{zlib.crc32(text.encode()):08x}\n".encode()


def read_journal(path: Path) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    """The journal's head record and its forward records, up to the first torn line."""
    try:
        raw = path.read_bytes()
    except OSError:
        return None, []
    records: list[dict[str, Any]] = []
    for line in raw.split(b"\n")[:-1]:  # the last piece has no newline: unfinished
        text, _, crc = line.rpartition(b"\t")
        try:
            if int(crc, 16) != zlib.crc32(text):
                break
            records.append(json.loads(text))
        except ValueError:
            break
    if not records or "start" not in records[0]:
        return None, []
    return records[0], records[1:]


_MAPS: list[tuple[weakref.ref[mmap.mmap], int, int]] = []  # (map, first address, end)
_MAPS_LOCK = threading.Lock()


def _register(m: mmap.mmap) -> None:
    """Note where shard map ``m`` lies in this process's memory (see :func:`in_a_map`)."""
    window = ctypes.c_char.from_buffer(m)  # an export of the map, released right below
    lo = ctypes.addressof(window)
    del window
    with _MAPS_LOCK:
        _MAPS[:] = [e for e in _MAPS if _open(e[0])]
        _MAPS.append((weakref.ref(m), lo, lo + len(m)))


def _open(ref: weakref.ref[mmap.mmap]) -> bool:
    m = ref()
    return m is not None and not m.closed


def in_a_map(t: torch.Tensor) -> bool:
    """Whether ``t``'s bytes lie (partly) in a shard map open in this process: the private
    copy every read of that shard, by any ``Captures``, sees (a ``caps.forward(i)`` tensor is a
    view of one), so writing into it would change what those reads return."""
    lo = t.data_ptr()
    hi = lo + t.numel() * t.element_size()
    with _MAPS_LOCK:
        return any(lo < end and start < hi and _open(ref) for ref, start, end in _MAPS)


class ShardReader:
    """A shard, memory-mapped; tensors are views of the map (read on access).

    What the index (or journal) says of the shard is checked before anything is read as data:
    its size, a header that parses, a forward range that matches, every tensor inside the
    file. A shard that fails is reported by name (``DiskError``), never read.
    """

    def __init__(self, path: Path, listed: Mapping[str, Any] | None = None,
                 verify: bool = True, journal: tuple[dict[str, Any],
                                                     list[dict[str, Any]]] | None = None
                 ) -> None:
        listed = listed or {}
        self.path = path
        self.live = journal is not None
        """A ``.partial`` shard read through its journal (a writer may still add to it)."""
        try:
            f = open(path, "rb")
        except OSError as e:
            raise DiskError(f"shard {str(path)!r}, listed in the index, cannot be opened: {e}. "
                            "It was moved or deleted after it was committed") from e
        with f:
            size = os.fstat(f.fileno()).st_size
            if journal is not None:
                meta, header, start = _from_journal(path, *journal)
                if start + meta["end"] > size:
                    raise DiskError(f"shard {str(path)!r} is shorter than its journal says")
                header_ok = True
            else:
                meta, header, start, header_ok = _from_header(path, f, size, listed, verify)
            first, count = int(meta["first"]), len(meta["layout_of"])
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
                _check_entry(path, key, entry, size - start)
            # ACCESS_COPY: a private, writable map (torch wants writable buffers); the file
            # itself is never changed.
            self.map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
            _register(self.map)
        self.start = start
        self.crc: int | None = listed.get("crc32") if verify else None
        """The data's CRC-32 still to check (:meth:`check_data`, older shards), or None."""
        crcs = meta.get("crcs") if verify else None
        self.crcs: dict[str, list[int]] | None = crcs
        """Per tensor, the CRC-32 of each BLOCK bytes (None: no per-block checksums)."""
        self.checked: set[tuple[str, int]] = set()
        """Blocks (tensor, number) whose checksum matched in this process."""
        self.first: int = first
        self.layouts = [json.loads(s) if isinstance(s, str) else s for s in meta["layouts"]]
        self.layout_of: list[int] = meta["layout_of"]
        self.entries: dict[str, Any] = header

    def __len__(self) -> int:
        return len(self.layout_of)

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

    def check_blocks(self, key: str, blocks: Any) -> None:
        """Check blocks ``blocks`` (numbers) of tensor ``key`` not yet checked here."""
        if self.crcs is None:
            self.check_data()
            return
        want = self.crcs.get(key)
        if want is None:
            raise DiskError(f"shard {str(self.path)!r} is corrupted: tensor {key!r} has no "
                            "checksums in its header; its forwards cannot be read")
        begin, end = self.entries[key]["data_offsets"]
        for j in blocks:
            j = int(j)
            if (key, j) in self.checked:
                continue
            lo = self.start + begin + j * BLOCK
            hi = min(lo + BLOCK, self.start + end)
            with memoryview(self.map) as whole, whole[lo:hi] as part:
                crc = zlib.crc32(part)
            if j >= len(want) or crc != want[j]:
                raise DiskError(
                    f"shard {str(self.path)!r} is corrupted: bytes {lo}..{hi} (tensor {key!r}) "
                    "differ from their checksum (changed on disk after they were written); "
                    "its forwards cannot be read")
            self.checked.add((key, j))

    def check_tensor(self, key: str) -> None:
        """Check every block of tensor ``key`` (once per process)."""
        e = self.entries.get(key)
        if e is None:
            return
        begin, end = e["data_offsets"]
        self.check_blocks(key, range(math.ceil((end - begin) / BLOCK)))

    def entry(self, key: str) -> dict[str, Any]:
        e = self.entries.get(key)
        if e is None:
            raise DiskError(f"shard {str(self.path)!r} is corrupted: it lacks tensor {key!r}, "
                            "which its forward's layout lists")
        return e  # type: ignore[no-any-return]

    def tensor(self, key: str, check: bool = False) -> torch.Tensor:
        e = self.entry(key)
        if check:
            self.check_tensor(key)
        dtype = FROM_CODE[e["dtype"]]
        begin, end = e["data_offsets"]
        shape = e["shape"]
        if end == begin:
            return torch.empty(shape, dtype=dtype)
        count = (end - begin) // dtype.itemsize
        flat = torch.frombuffer(self.map, dtype=dtype, count=count, offset=self.start + begin)
        return flat.view(shape)

    def bytes_view(self) -> np.ndarray:
        """The whole map as a 1-d uint8 array (no copy)."""
        return np.frombuffer(self.map, dtype=np.uint8)


def _from_header(path: Path, f: Any, size: int, listed: Mapping[str, Any], verify: bool
                 ) -> tuple[dict[str, Any], dict[str, Any], int, bool]:
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
        int(meta["first"]), len(meta["layout_of"])
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise DiskError(f"shard {str(path)!r} is corrupted: its header does not "
                        f"parse ({e}); its forwards cannot be read") from e
    return meta, header, 8 + n, header_ok


def _from_journal(path: Path, head: dict[str, Any], records: list[dict[str, Any]]
                  ) -> tuple[dict[str, Any], dict[str, Any], int]:
    """The meta and header a shard's journal describes (what commit would write)."""
    entries: dict[str, Any] = {}
    crcs: dict[str, list[int]] = {}
    layouts: list[str] = []
    layout_of: list[int] = []
    ids: dict[str, int] = {}
    try:
        for r in records:
            entries.update(json.loads("{" + r["entries"] + "}"))
            crcs.update(r["crcs"])
            if r["layout"] not in ids:
                ids[r["layout"]] = len(layouts)
                layouts.append(r["layout"])
            layout_of.append(ids[r["layout"]])
        end = records[-1]["end"] if records else 0
        meta = {"first": int(head["first"]), "rank": head.get("rank"), "layouts": layouts,
                "layout_of": layout_of, "crcs": crcs, "end": int(end)}
        return meta, entries, int(head["start"])
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise DiskError(f"the journal of shard {str(path)!r} does not parse ({e})") from e


def _check_entry(path: Path, key: str, entry: Any, data_size: int) -> None:
    """A header's tensor entry: a known dtype, a shape whose byte size is the data's, inside
    the file."""
    try:
        begin, end = entry["data_offsets"]
        shape = [int(d) for d in entry["shape"]]
        dtype = FROM_CODE[entry["dtype"]]
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
