"""How a forward's values reach a shard: :class:`Encoder` turns ``{site: value}`` into a
:class:`Job` on the forward's thread (copying what the caller may overwrite), and the writer
thread appends jobs to a :class:`Shard`, a ``.partial`` file that ``commit()`` makes a
safetensors file.

A shard is written as one stream: a header area of real bytes first (spaces, so that a full
disk cannot refuse the header later and lose the shard's complete forwards), then the data,
then the header over that area (JSON padded with spaces, as the format allows), ``fsync`` and an
atomic rename. The header holds a CRC-32 of every block of every tensor (computed as it is
written), and the index entry a CRC-32 of the header; a reader checks a block when it first
reads from it. Tensors are named ``"{forward}/{site}/{leaf}"``; every one starts on a 64-byte
boundary of the file (mmap-friendly), the gaps filled with named pads (safetensors allows no
holes).

A journal beside the ``.partial`` file (``shard-000007.safetensors.journal``) gets one line per
forward once its data is in the file (no ``fsync``: a killed process loses nothing the kernel
has): where its tensors are, its layout and checksums. Readers read the forwards it lists, and
the next ``Disk(mode="append")`` commits them (:meth:`Shard.resume`): a writer killed mid-run
loses only the forwards not yet written.
"""

from __future__ import annotations

import contextlib
import json
import os
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..capture.stats.math import FIELDS, Stats
from ..core.errors import ConfigError, DiskError
from ..core.record import InOut
from .catalog import FORMAT, STATS_KEY, VERSION
from .shardfile import BLOCK, DTYPES, JOURNAL, block_crcs, journal_line, read_journal

_ALIGN = 64  # every tensor starts on a 64-byte boundary of the file (mmap-friendly)


# -- encoding one forward's values ----------------------------------------------------------

@dataclass
class Job:
    """One forward's values, ready for the writer thread."""

    forward: int
    layout: dict[str, Any]
    """Site name -> JSON structure whose leaves point at tensors ("t": leaf) or stats rows."""
    tensors: list[tuple[str, torch.Tensor]]
    """(key inside the forward, CPU tensor or pinned copy still being filled)."""
    event: Any
    """A CUDA event to wait for before reading the tensors, or None."""
    nbytes: int
    signature: dict[str, str]
    """Site name -> structure with dtypes and trailing shapes: what must match to append."""
    written: bool = False
    """In the shard being written (committed with it, or lost with it)."""


class Encoder:
    """Turns ``{site: value}`` into a :class:`Job` on the forward's thread."""

    def __init__(self, protected: set[int], inputs: frozenset[str], copy: bool,
                 captures_inputs: bool = False) -> None:
        self.protected = protected
        self.inputs = inputs
        self.copy = copy
        self.tensors: list[tuple[str, torch.Tensor]] = []
        self.stats: list[list[float]] = []
        self.cuda = False
        self.nbytes = 0
        self.captures_inputs = captures_inputs
        """capture="input": every value is a site's inputs."""
        self.in_inputs = False

    def job(self, forward: int, values: Mapping[str, Any]) -> Job:
        layout: dict[str, Any] = {}
        signature: dict[str, str] = {}
        for name, value in values.items():
            if not isinstance(name, str) or "/" in name:
                raise ConfigError(f"site name {name!r} cannot be written to disk (a '/' in it)")
            self.leaf = 0
            self.in_inputs = self.captures_inputs
            self.force_copy = self.copy or name in self.inputs
            struct, sig = self.encode(name, value)
            layout[name] = struct
            signature[name] = json.dumps(sig, separators=(",", ":"))
        if self.stats:
            rows = torch.tensor(self.stats, dtype=torch.float64)
            self.tensors.append((STATS_KEY, rows))
            self.nbytes += rows.nbytes
        event = None
        if self.cuda:
            event = torch.cuda.Event()
            event.record()
        return Job(forward, layout, self.tensors, event, self.nbytes, signature)

    def encode(self, name: str, v: Any) -> tuple[Any, Any]:
        if isinstance(v, torch.Tensor):
            return self.tensor(name, v)
        if isinstance(v, Stats):
            self.stats.append([getattr(v, f) for f in FIELDS])
            struct = {"s": len(self.stats) - 1, "shape": list(v.shape), "dtype": v.dtype}
            return struct, {"s": v.dtype, "tail": list(v.shape[1:])}
        if isinstance(v, InOut):
            self.in_inputs = True
            try:
                a, sa = self.encode(name, v.inputs)
            finally:
                self.in_inputs = self.captures_inputs
            b, sb = self.encode(name, v.output)
            return {"inout": [a, b]}, {"inout": [sa, sb]}
        if isinstance(v, (tuple, list)) and type(v) in (tuple, list):
            kind = type(v).__name__
            parts = [self.encode(name, x) for x in v]
            return {kind: [p[0] for p in parts]}, {kind: [p[1] for p in parts]}
        if type(v) is dict and all(isinstance(k, str) for k in v):
            items = [(k, self.encode(name, x)) for k, x in v.items()]
            return ({"dict": [[k, e[0]] for k, e in items]},
                    {"dict": [[k, e[1]] for k, e in items]})
        if v is None or isinstance(v, (bool, int, float, str)):
            return {"v": v}, {"v": type(v).__name__}
        if self.in_inputs:
            raise ConfigError(
                f"site {name!r} has a {type(v).__name__} ({v!r:.60}) among its inputs, which "
                "fxprobe.Disk cannot write (it writes tensors, numbers, strings, None and "
                "tuples/lists/dicts of them); with capture='input' or 'both', select sites "
                "whose inputs are those (ops=...), or capture='output'")
        raise ConfigError(
            f"site {name!r} captured a {type(v).__name__}, which fxprobe.Disk cannot write; "
            "it writes tensors, fxprobe.Stats, and tuples/lists/dicts of them (a reduce= "
            "function must return those)"
        )

    def tensor(self, name: str, t: torch.Tensor) -> tuple[Any, Any]:
        if t.dtype not in DTYPES:
            raise ConfigError(
                f"site {name!r} captured a {t.dtype} tensor, which safetensors cannot hold; "
                f"pass reduce= a function that converts it (e.g. torch.view_as_real)"
            )
        if t.layout != torch.strided:
            raise ConfigError(
                f"site {name!r} captured a {t.layout} tensor, which fxprobe.Disk cannot write; "
                "pass reduce= a function that converts it (e.g. lambda t: t.to_dense())"
            )
        t = t.detach()
        if t.device.type != "cpu":
            dst = torch.empty(t.shape, dtype=t.dtype, device="cpu",
                              pin_memory=t.device.type == "cuda")
            t = dst.copy_(t, non_blocking=True)
            self.cuda = self.cuda or torch.cuda.is_available()
        elif self.force_copy or (t.numel() and t.untyped_storage().data_ptr() in self.protected):
            # A parameter, buffer or input: the optimizer or the caller may overwrite it while
            # the writer thread still reads it.
            t = t.clone()
        j = self.leaf
        self.leaf += 1
        self.tensors.append((f"{name}/{j}", t))
        self.nbytes += t.numel() * t.element_size()
        return {"t": j}, {"t": DTYPES[t.dtype], "tail": list(t.shape[1:])}


def protected_storages(args: Any, module: Any) -> tuple[set[int], frozenset[str]]:
    """The storages a forward's values must not share when handed to the writer thread, and
    the names of the model's input sites (always copied).

    Storages the caller or an optimizer step may write after the forward: the forward's
    arguments ``args`` (tensors at any depth) and ``module``'s parameters and buffers (None:
    no module). A value in one of them (``x.view(-1)``, ``x.contiguous()``,
    ``nn.Identity()(x)``, ``weight.t()``) is copied."""
    tensors: list[torch.Tensor] = []
    tensors_in(args, tensors)
    if module is not None:
        tensors += [*module.parameters(), *module.buffers()]
    ptrs = {storage(t) for t in tensors if t.numel()} - {0}
    if module is None:
        return ptrs, frozenset()
    inputs = frozenset(s.name for s in module.sites if s.kind == "placeholder")
    return ptrs, inputs


def tensors_in(value: Any, out: list[torch.Tensor]) -> None:
    """Append every tensor in ``value`` (nested tuples, lists and mappings) to ``out``."""
    if isinstance(value, torch.Tensor):
        out.append(value)
    elif isinstance(value, (tuple, list)):
        for v in value:
            tensors_in(v, out)
    elif isinstance(value, Mapping):
        for v in value.values():
            tensors_in(v, out)


def storage(t: torch.Tensor) -> int:
    """The address of ``t``'s storage; 0 for tensors without one (sparse, nested, wrapper
    subclasses), which hold no memory that a captured strided value could share."""
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return 0


# -- one shard being written ----------------------------------------------------------------

def _entry(key: str, code: str, shape: list[int], begin: int, end: int) -> str:
    return json.dumps({key: {"dtype": code, "shape": shape, "data_offsets": [begin, end]}},
                      separators=(",", ":"))[1:-1]


def crc_room(key: str, nbytes: int) -> int:
    """Header bytes the checksums of one tensor take (JSON inside JSON: quotes escaped)."""
    return 2 * len(key) + 16 + 11 * -(-nbytes // BLOCK)


class Shard:
    """A ``.partial`` file receiving whole forwards, and its journal; ``commit()`` makes it a
    safetensors file."""

    def __init__(self, path: Path, number: int, first: int, header: int, fsync: bool,
                 rank: int | None = None, *, resume: bool = False) -> None:
        self.number = number
        self.final = path / f"shard-{number:06d}.safetensors"
        self.partial = self.final.with_name(self.final.name + ".partial")
        self.journal = self.final.with_name(self.final.name + JOURNAL)
        # 8 bytes of length + header must end on an aligned offset.
        self.header = header + (-(8 + header)) % _ALIGN
        self.fsync = fsync
        self.rank = rank
        self.pos = 0  # bytes of data written
        self.entries: list[str] = []
        self.entries_len = 0
        self.crcs: dict[str, list[int]] = {}
        self.pads = 0
        self.first = first
        self.layouts: list[str] = []
        self.layout_ids: dict[str, int] = {}
        self.layout_of: list[int] = []
        self.meta_len = 128
        self.signature: dict[str, str] = {}
        """The sites of the forwards :meth:`resume` found, with their signatures."""
        self._log = -1
        # "r+b" to resume (keep the bytes), "wb" to start; closed by commit/abort.
        self.file: Any = open(self.partial, "r+b" if resume else "wb")  # noqa: SIM115
        if resume:
            return
        try:
            # Real bytes, not a hole: writing the header over them at commit needs no new
            # space, so the complete forwards of a shard survive a full disk.
            self.file.write(b"\0" * 8 + b" " * self.header)
            self.file.flush()
            self._log = os.open(self.journal, os.O_WRONLY | os.O_CREAT | os.O_TRUNC
                                | os.O_APPEND, 0o644)
            os.write(self._log, journal_line({"start": 8 + self.header, "first": first,
                                              "rank": rank, "block": BLOCK}))
        except BaseException:
            self.abort()
            raise

    @classmethod
    def resume(cls, path: Path, number: int, fsync: bool, rank: int | None,
               first: int) -> Shard | None:
        """The shard a killed writer left, holding the forwards its journal lists (the rest
        cut off), ready to :meth:`commit`; None (and its files removed) when the journal
        lists none, or is not one that continues the committed forwards at ``first``."""
        final = path / f"shard-{number:06d}.safetensors"
        journal = final.with_name(final.name + JOURNAL)
        head, records = read_journal(journal)
        partial = final.with_name(final.name + ".partial")
        ok = (head is not None and records and head.get("first") == first
              and head.get("rank") == rank and head.get("block") == BLOCK
              and partial.exists()
              and partial.stat().st_size >= int(head["start"]) + int(records[-1]["end"]))
        if not ok:
            for f in (journal, partial):
                f.unlink(missing_ok=True)
            return None
        assert head is not None
        self = cls(path, number, first, int(head["start"]) - 8, fsync, rank, resume=True)
        try:
            for r in records:
                self.entries += _split_entries(r["entries"])
                self.crcs.update(r["crcs"])
                self._add_layout(r["layout"])
                for name, sig in r["signature"].items():
                    self.signature.setdefault(name, sig)
            self.entries_len = sum(len(e) + 1 for e in self.entries)
            self.pads = sum(e.startswith('"__pad__/') for e in self.entries)
            self.pos = int(records[-1]["end"])
            self.file.truncate(8 + self.header + self.pos)
        except BaseException:
            self.abort()
            raise
        return self

    def fits(self, job: Job, layout_json: str) -> bool:
        extra = sum(len(k) + 128 + 12 * t.dim() + crc_room(k, t.numel() * t.element_size())
                    for k, t in job.tensors)
        extra += 8 + (len(json.dumps(layout_json)) if layout_json not in self.layout_ids else 0)
        return self.entries_len + self.meta_len + extra + 2048 <= self.header

    def add(self, job: Job, layout_json: str) -> None:
        """Write one forward, then its journal line; on failure the file is cut back to the
        forwards before it."""
        start_pos, start_entries, start_pads = self.pos, len(self.entries), self.pads
        keys: list[str] = []
        try:
            for key, t in job.tensors:
                keys.append(f"{job.forward}/{key}")
                self._write_tensor(keys[-1], t)
            self.file.flush()  # into the kernel before the journal says it is there
            os.write(self._log, journal_line({
                "forward": job.forward, "layout": layout_json,
                "entries": ",".join(self.entries[start_entries:]),
                "crcs": {k: self.crcs[k] for k in keys}, "end": self.pos,
                "signature": job.signature}))
        except BaseException:
            with contextlib.suppress(OSError):
                self.file.truncate(8 + self.header + start_pos)
                self.file.seek(8 + self.header + start_pos)
            self.pos, self.pads = start_pos, start_pads
            for k in keys:
                self.crcs.pop(k, None)
            del self.entries[start_entries:]
            self.entries_len = sum(len(e) + 1 for e in self.entries)
            raise
        self._add_layout(layout_json)
        for k in keys:
            self.meta_len += crc_room(k, 0) + 11 * len(self.crcs[k])

    def _add_layout(self, layout_json: str) -> None:
        if layout_json not in self.layout_ids:
            self.layout_ids[layout_json] = len(self.layouts)
            self.layouts.append(layout_json)
            self.meta_len += len(json.dumps(layout_json)) + 1
        self.layout_of.append(self.layout_ids[layout_json])
        self.meta_len += len(str(self.layout_ids[layout_json])) + 1

    def _write_tensor(self, key: str, t: torch.Tensor) -> None:
        gap = (-self.pos) % _ALIGN
        if gap:  # safetensors allows no holes: fill with a named pad
            self._append(f"__pad__/{self.pads}", "U8", [gap], bytes(gap))
            self.pads += 1
        t = t.contiguous()
        data = t.reshape(-1).view(torch.uint8).numpy() if t.numel() else b""
        self._append(key, DTYPES[t.dtype], list(t.shape), data)
        self.crcs[key] = block_crcs(data)  # releases the GIL for large buffers

    def _append(self, key: str, code: str, shape: list[int], data: Any) -> None:
        n = len(data) if isinstance(data, bytes) else data.nbytes
        if n:
            self.file.write(data)
        e = _entry(key, code, shape, self.pos, self.pos + n)
        self.entries.append(e)
        self.entries_len += len(e) + 1
        self.pos += n

    @property
    def forwards(self) -> int:
        return len(self.layout_of)

    def commit(self) -> dict[str, Any]:
        """Write the header, fsync, rename to the final name; return the index entry (the
        journal stays until :meth:`done`, once the index lists the shard)."""
        meta = json.dumps({"first": self.first, "count": self.forwards, "rank": self.rank,
                           "layouts": self.layouts, "layout_of": self.layout_of,
                           "block": BLOCK, "crcs": self.crcs},
                          separators=(",", ":"))
        md = json.dumps({"__metadata__": {"format": f"{FORMAT}/{VERSION}", "fxprobe": meta}},
                        separators=(",", ":"))
        header = ("{" + ",".join([md[1:-1], *self.entries]) + "}").encode()
        if len(header) > self.header:
            raise DiskError(f"internal: shard header of {len(header)} bytes exceeds the "
                            f"{self.header} reserved; please report this")
        header += b" " * (self.header - len(header))
        header = len(header).to_bytes(8, "little") + header
        f = self.file
        f.flush()
        f.seek(0)
        f.write(header)
        f.flush()
        if self.fsync:
            os.fsync(f.fileno())
        f.close()
        self._close_log()
        os.replace(self.partial, self.final)
        return {"file": self.final.name, "first": self.first, "count": self.forwards,
                "bytes": 8 + self.header + self.pos, "header_crc32": zlib.crc32(header)}

    def done(self) -> None:
        """The index lists the shard: its journal is no longer needed."""
        self._close_log()
        with contextlib.suppress(OSError):
            self.journal.unlink()

    def _close_log(self) -> None:
        if self._log >= 0:
            with contextlib.suppress(OSError):
                os.close(self._log)
            self._log = -1

    def abort(self) -> None:
        with contextlib.suppress(OSError):
            self.file.close()
        self._close_log()
        for f in (self.partial, self.journal):
            with contextlib.suppress(OSError):
                f.unlink()


def _split_entries(joined: str) -> list[str]:
    """The header entries (``"key":{...}``) a journal line joined with commas."""
    return [json.dumps(k) + ":" + json.dumps(v, separators=(",", ":"))
            for k, v in json.loads("{" + joined + "}").items()] if joined else []
