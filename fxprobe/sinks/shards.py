"""How a forward's values reach a shard: :class:`Encoder` turns ``{site: value}`` into a
:class:`Job` on the forward's thread (copying what the caller may overwrite), and the writer
thread appends jobs to a :class:`Shard`, a ``.partial`` file that ``commit()`` makes a
safetensors file.

A shard is written as one stream: a header area of real bytes first (spaces, so that a full
disk cannot refuse the header later and lose the shard's complete forwards), then the data,
then the header over that area (JSON padded with spaces, as the format allows), ``fsync`` and an
atomic rename. The index entry of a shard holds a CRC-32 of its data (computed as it is
written) and of its header, which the reader checks before it trusts the shard. Tensors are
named ``"{forward}/{site}/{leaf}"``; every one starts on a 64-byte boundary of the file
(mmap-friendly), the gaps filled with named pads (safetensors allows no holes).
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
from .captures import DTYPES, FORMAT, STATS_KEY, VERSION

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


class Shard:
    """A ``.partial`` file receiving whole forwards; ``commit()`` makes it a safetensors file."""

    def __init__(self, path: Path, number: int, first: int, header: int, fsync: bool,
                 rank: int | None = None) -> None:
        self.number = number
        self.final = path / f"shard-{number:06d}.safetensors"
        self.partial = self.final.with_name(self.final.name + ".partial")
        # 8 bytes of length + header must end on an aligned offset.
        self.header = header + (-(8 + header)) % _ALIGN
        self.fsync = fsync
        self.rank = rank
        self.file = open(self.partial, "wb")  # noqa: SIM115 (closed by commit/abort)
        try:
            # Real bytes, not a hole: writing the header over them at commit needs no new
            # space, so the complete forwards of a shard survive a full disk.
            self.file.write(b"\0" * 8 + b" " * self.header)
        except BaseException:
            self.abort()
            raise
        self.pos = 0  # bytes of data written
        self.crc = 0  # CRC-32 of the data written
        self.entries: list[str] = []
        self.entries_len = 0
        self.pads = 0
        self.first = first
        self.layouts: list[str] = []
        self.layout_ids: dict[str, int] = {}
        self.layout_of: list[int] = []
        self.meta_len = 96

    def fits(self, job: Job, layout_json: str) -> bool:
        extra = sum(len(k) + 128 + 12 * t.dim() for k, t in job.tensors)
        extra += 8 + (len(json.dumps(layout_json)) if layout_json not in self.layout_ids else 0)
        return self.entries_len + self.meta_len + extra + 2048 <= self.header

    def add(self, job: Job, layout_json: str) -> None:
        """Write one forward; on failure the file is cut back to the forwards before it."""
        start_pos, start_entries, start_pads = self.pos, len(self.entries), self.pads
        start_crc = self.crc
        try:
            for key, t in job.tensors:
                self._write_tensor(f"{job.forward}/{key}", t)
        except BaseException:
            with contextlib.suppress(OSError):
                self.file.truncate(8 + self.header + start_pos)
            self.pos, self.pads, self.crc = start_pos, start_pads, start_crc
            del self.entries[start_entries:]
            self.entries_len = sum(len(e) + 1 for e in self.entries)
            raise
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

    def _append(self, key: str, code: str, shape: list[int], data: Any) -> None:
        n = len(data) if isinstance(data, bytes) else data.nbytes
        if n:
            self.file.write(data)
            self.crc = zlib.crc32(data, self.crc)  # releases the GIL for large buffers
        e = _entry(key, code, shape, self.pos, self.pos + n)
        self.entries.append(e)
        self.entries_len += len(e) + 1
        self.pos += n

    @property
    def forwards(self) -> int:
        return len(self.layout_of)

    def commit(self) -> dict[str, Any]:
        """Write the header, fsync, rename to the final name; return the index entry."""
        meta = json.dumps({"first": self.first, "count": self.forwards, "rank": self.rank,
                           "layouts": self.layouts, "layout_of": self.layout_of},
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
        os.replace(self.partial, self.final)
        return {"file": self.final.name, "first": self.first, "count": self.forwards,
                "bytes": 8 + self.header + self.pos, "crc32": self.crc,
                "header_crc32": zlib.crc32(header)}

    def abort(self) -> None:
        with contextlib.suppress(OSError):
            self.file.close()
        with contextlib.suppress(OSError):
            self.partial.unlink()
