"""``fxprobe.Disk``: captures streamed to safetensors shards by a background thread (read
back by :func:`fxprobe.open_captures`, in ``_captures.py``).

A capture directory (one per rank, ``acts/rank00001/``, when torch.distributed runs with more
than one rank)::

    acts/
      index.json                          the commit point: the shards it lists are complete
      shard-000000.safetensors            whole forwards; tensors named "{forward}/{site}/{leaf}"
      shard-000001.safetensors
      shard-000002.safetensors.partial    being written; never listed, never read
      .lock                               held (flock) while a Disk writes here

Every shard is a standard safetensors file (``safetensors.torch.load_file`` opens it). It is
written as one stream: data first, from an offset that leaves room for the header, then the
header (JSON padded with spaces, as the format allows), then ``fsync``, an atomic rename and a
new ``index.json`` (temporary file + ``os.replace``). A crash therefore loses at most the shard
being written; a reader never sees a half-written shard.

The writer depends only on three calls, ``write(values, inputs)``, ``flush()`` and
``close()``; the tapped module makes them after each forward and on ``remove()``.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import json
import math
import os
import re
import threading
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from ..capture.stats.math import FIELDS, Stats
from ..core.errors import ConfigError, DiskError
from ..core.options import Sink
from ..core.record import InOut
from .captures import DTYPES, FORMAT, INDEX, SHARD_RE, STATS_KEY, VERSION, read_index

Mode = Literal["new", "append", "overwrite"]
_ALIGN = 64  # every tensor starts on a 64-byte boundary of the file (mmap-friendly)

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(what: str, value: int | str) -> int:
    """``1_000_000``, ``"256MiB"``, ``"1.5 GB"`` -> bytes (a positive int)."""
    if isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", value)
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _UNITS:
            raise ConfigError(f"{what}={value!r} is not a size; use bytes (int) or e.g. '256MiB'")
        value = int(float(m.group(1)) * _UNITS[unit])
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{what}={value!r} must be a positive number of bytes")
    return value


# -- encoding one forward's values ----------------------------------------------------------

@dataclass
class _Job:
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


class _Encoder:
    """Turns ``{site: value}`` into a :class:`_Job` on the forward's thread."""

    def __init__(self, protected: set[int], inputs: frozenset[str], copy: bool) -> None:
        self.protected = protected
        self.inputs = inputs
        self.copy = copy
        self.tensors: list[tuple[str, torch.Tensor]] = []
        self.stats: list[list[float]] = []
        self.cuda = False
        self.nbytes = 0

    def job(self, forward: int, values: Mapping[str, Any]) -> _Job:
        layout: dict[str, Any] = {}
        signature: dict[str, str] = {}
        for name, value in values.items():
            if not isinstance(name, str) or "/" in name:
                raise ConfigError(f"site name {name!r} cannot be written to disk (a '/' in it)")
            self.leaf = 0
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
        return _Job(forward, layout, self.tensors, event, self.nbytes, signature)

    def encode(self, name: str, v: Any) -> tuple[Any, Any]:
        if isinstance(v, torch.Tensor):
            return self.tensor(name, v)
        if isinstance(v, Stats):
            self.stats.append([getattr(v, f) for f in FIELDS])
            struct = {"s": len(self.stats) - 1, "shape": list(v.shape), "dtype": v.dtype}
            return struct, {"s": v.dtype, "tail": list(v.shape[1:])}
        if isinstance(v, InOut):
            (a, sa), (b, sb) = self.encode(name, v.inputs), self.encode(name, v.output)
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


# -- one shard being written ----------------------------------------------------------------

def _entry(key: str, code: str, shape: list[int], begin: int, end: int) -> str:
    return json.dumps({key: {"dtype": code, "shape": shape, "data_offsets": [begin, end]}},
                      separators=(",", ":"))[1:-1]


class _Shard:
    """A ``.partial`` file receiving whole forwards; ``commit()`` makes it a safetensors file."""

    def __init__(self, path: Path, number: int, first: int, header: int, fsync: bool) -> None:
        self.number = number
        self.final = path / f"shard-{number:06d}.safetensors"
        self.partial = self.final.with_name(self.final.name + ".partial")
        # 8 bytes of length + header must end on an aligned offset.
        self.header = header + (-(8 + header)) % _ALIGN
        self.fsync = fsync
        self.file = open(self.partial, "wb")  # noqa: SIM115 (closed by commit/abort)
        self.file.seek(8 + self.header)
        self.pos = 0  # bytes of data written
        self.entries: list[str] = []
        self.entries_len = 0
        self.pads = 0
        self.first = first
        self.layouts: list[str] = []
        self.layout_ids: dict[str, int] = {}
        self.layout_of: list[int] = []
        self.meta_len = 64

    def fits(self, job: _Job, layout_json: str) -> bool:
        extra = sum(len(k) + 128 + 12 * t.dim() for k, t in job.tensors)
        extra += 8 + (len(json.dumps(layout_json)) if layout_json not in self.layout_ids else 0)
        return self.entries_len + self.meta_len + extra + 2048 <= self.header

    def add(self, job: _Job, layout_json: str) -> None:
        """Write one forward; on failure the file is cut back to the forwards before it."""
        start_pos, start_entries, start_pads = self.pos, len(self.entries), self.pads
        try:
            for key, t in job.tensors:
                self._write_tensor(f"{job.forward}/{key}", t)
        except BaseException:
            with contextlib.suppress(OSError):
                self.file.truncate(8 + self.header + start_pos)
            self.pos, self.pads = start_pos, start_pads
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
        e = _entry(key, code, shape, self.pos, self.pos + n)
        self.entries.append(e)
        self.entries_len += len(e) + 1
        self.pos += n

    @property
    def forwards(self) -> int:
        return len(self.layout_of)

    def commit(self) -> dict[str, Any]:
        """Write the header, fsync, rename to the final name; return the index entry."""
        meta = json.dumps({"first": self.first, "count": self.forwards,
                           "layouts": self.layouts, "layout_of": self.layout_of},
                          separators=(",", ":"))
        md = json.dumps({"__metadata__": {"format": f"{FORMAT}/{VERSION}", "fxprobe": meta}},
                        separators=(",", ":"))
        header = ("{" + ",".join([md[1:-1], *self.entries]) + "}").encode()
        if len(header) > self.header:
            raise DiskError(f"internal: shard header of {len(header)} bytes exceeds the "
                            f"{self.header} reserved; please report this")
        header += b" " * (self.header - len(header))
        f = self.file
        f.flush()
        f.seek(0)
        f.write(len(header).to_bytes(8, "little") + header)
        f.flush()
        if self.fsync:
            os.fsync(f.fileno())
        f.close()
        os.replace(self.partial, self.final)
        return {"file": self.final.name, "first": self.first, "count": self.forwards,
                "bytes": 8 + self.header + self.pos}

    def abort(self) -> None:
        with contextlib.suppress(OSError):
            self.file.close()
        with contextlib.suppress(OSError):
            self.partial.unlink()


# -- the public writer ----------------------------------------------------------------------

_OPEN: weakref.WeakSet[Disk] = weakref.WeakSet()
_ATEXIT = False


def _close_all() -> None:
    for disk in list(_OPEN):
        with contextlib.suppress(Exception):
            disk.close()


def _write_json(path: Path, data: Any, fsync: bool) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(data, f, separators=(",", ":"))
        f.flush()
        if fsync:
            os.fsync(f.fileno())
    os.replace(tmp, path)
    if fsync and hasattr(os, "O_DIRECTORY"):
        fd = os.open(path.parent, os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _default_rank() -> int | None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.get_rank()
    return None


class Disk(Sink):
    """Where ``fxprobe.tap(..., to=fxprobe.Disk(path))`` streams every forward's captures.

    A background thread writes each forward's values (as ``tapped.taps`` shows them: tensors,
    or :class:`Stats` and samples with ``reduce=``) to safetensors shards of about
    ``shard_size`` bytes. The forward only hands its values over: it waits for the disk only
    when ``queue`` forwards or ``queue_bytes`` bytes are already waiting, so memory stays
    bounded. Values on a GPU are copied to pinned host memory without blocking; CPU values
    are handed over as they are, except parameters, buffers and the model's inputs (copied,
    since they may change before they are written) or everything with ``copy=True``.

    Args:
        path: the directory; created if needed. Under torch.distributed with more than one
            rank each rank writes to ``path/rank00000``, ``path/rank00001``, ...
        mode: ``"new"`` (the default) refuses a directory that already holds captures;
            ``"append"`` adds forwards to captures of the same sites (names, dtypes and
            shapes after dim 0 must match); ``"overwrite"`` deletes them first.
        shard_size: bytes per shard (``int`` or e.g. ``"256MiB"``); a shard holds whole
            forwards, so one larger forward makes one larger shard.
        queue: forwards that may wait for the writer before a forward waits.
        queue_bytes: bytes that may wait (a bigger single forward still goes through alone).
        rank: the rank whose subdirectory to use; by default torch.distributed's rank when it
            runs with more than one rank, else no subdirectory.
        copy: copy every CPU value before handing it over (if your code changes a model's
            output in place after the forward, say).
        fsync: ``fsync`` each shard and the index, so a power loss loses at most the
            unfinished shard.

    Raises:
        DiskError: the directory cannot be created or written, another process writes there,
            or (``mode="new"``) it already holds captures.

    Example:
        >>> with fxprobe.tap(model, ops=nn.ReLU, to=fxprobe.Disk("acts/")) as tapped:
        ...     for x in batches:
        ...         tapped(x)
        >>> caps = fxprobe.open_captures("acts/")
    """

    def __init__(self, path: str | os.PathLike[str], *, mode: Mode = "new",
                 shard_size: int | str = "256MiB", queue: int = 4,
                 queue_bytes: int | str = "1GiB", rank: int | None = None, copy: bool = False,
                 fsync: bool = True) -> None:
        if mode not in ("new", "append", "overwrite"):
            raise ConfigError(f"Disk(mode={mode!r}) is not accepted; use 'new', 'append' or "
                              "'overwrite'")
        if isinstance(queue, bool) or not isinstance(queue, int) or queue < 1:
            raise ConfigError(f"Disk(queue={queue!r}) must be a positive int (forwards)")
        if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int)
                                 or rank < 0):
            raise ConfigError(f"Disk(rank={rank!r}) must be a rank >= 0, or None")
        self.shard_size = parse_size("shard_size", shard_size)
        self.queue = queue
        self.queue_bytes = parse_size("queue_bytes", queue_bytes)
        self.copy = bool(copy)
        self.fsync = bool(fsync)
        self.rank = rank if rank is not None else _default_rank()
        root = Path(path)
        self.path = root / f"rank{self.rank:05d}" if self.rank is not None else root
        self._lock_fd: int | None = None
        self._open_dir(mode)
        self._cond = threading.Condition()
        self._jobs: collections.deque[_Job | str] = collections.deque()
        self._queued_bytes = 0
        self._busy = False
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._lost = 0
        self._closed = False
        self._shard: _Shard | None = None
        self._module: Any = None
        global _ATEXIT
        if not _ATEXIT:
            atexit.register(_close_all)
            _ATEXIT = True
        _OPEN.add(self)

    # -- opening the directory --------------------------------------------------------------
    def _open_dir(self, mode: Mode) -> None:
        p = self.path
        try:
            p.mkdir(parents=True, exist_ok=True)
            fd = os.open(p / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise DiskError(
                f"cannot write captures to {str(p)!r}: {e.strerror or e} ({type(e).__name__}); "
                "pass fxprobe.Disk a directory you can create and write to"
            ) from e
        try:
            import fcntl

            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except ImportError:  # not POSIX: no lock
            pass
        except OSError as e:
            os.close(fd)
            raise DiskError(
                f"{str(p)!r} is being written by another fxprobe.Disk (its .lock is held); "
                "close that one first, or write to another directory"
            ) from e
        self._lock_fd = fd
        try:
            self._load_index(mode)
        except BaseException:
            self._unlock()
            raise

    def _load_index(self, mode: Mode) -> None:
        p = self.path
        index_path = p / INDEX
        shards = sorted(f for f in os.listdir(p) if SHARD_RE.match(f))
        has = index_path.exists()
        if mode == "new" and (has or shards):
            raise DiskError(
                f"{str(p)!r} already holds captures ({INDEX} and {len(shards)} shard(s)); "
                "pass fxprobe.Disk(..., mode='append') to add to them, mode='overwrite' to "
                "replace them, or another directory"
            )
        for f in os.listdir(p):  # leftovers of a crashed writer: never committed
            if f.endswith((".partial", ".tmp")) or (mode == "overwrite" and SHARD_RE.match(f)):
                (p / f).unlink()
        if mode == "overwrite" and has:
            index_path.unlink()
            has = False
        if has:
            self._index = read_index(index_path)
            # Shards a crash left behind after the rename but before the index: not committed.
            listed = {s["file"] for s in self._index["shards"]}
            for f in shards:
                if f not in listed:
                    (p / f).unlink()
        else:
            self._index = {"format": FORMAT, "version": VERSION, "sites": [],
                           "signature": {}, "forwards": 0, "shards": []}
        self._appending = bool(self._index["forwards"])
        self._next_forward = self._index["forwards"]
        numbers = [int(m.group(1)) for s in self._index["shards"]
                   if (m := SHARD_RE.match(s["file"]))]
        self._next_shard = max(numbers, default=-1) + 1

    def _unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None

    # -- the forward's side -----------------------------------------------------------------
    def attach(self, module: Any) -> None:
        """Let the writer copy ``module``'s parameters, buffers and inputs before handing them
        over (called by ``fxprobe.tap``; optional for other producers)."""
        self._module = weakref.ref(module)

    def check_options(self, keep: int | None) -> None:
        """Refuse what makes no sense with ``to=fxprobe.Disk(...)`` (see :class:`Sink`)."""
        check_disk_options(self, keep)

    def _protected(self, args: Any) -> tuple[set[int], frozenset[str]]:
        # Storages the caller or an optimizer step may write after the forward: a value in
        # one of them (x.view(-1), x.contiguous(), nn.Identity()(x), weight.t()) is copied.
        tensors: list[torch.Tensor] = []
        _tensors_in(args, tensors)
        module = self._module() if self._module is not None else None
        if module is not None:
            tensors += [*module.parameters(), *module.buffers()]
        ptrs = {_storage(t) for t in tensors if t.numel()} - {0}
        if module is None:
            return ptrs, frozenset()
        inputs = frozenset(s.name for s in module.sites if s.kind == "placeholder")
        return ptrs, inputs

    def write(self, values: Mapping[str, Any], inputs: Any = ()) -> None:
        """Queue one forward's ``{site name: value}``; wait only while the queue is full.

        Args:
            values: the forward's captured values.
            inputs: the forward's arguments (tensors, in tuples, lists and dicts at any depth):
                a value sharing storage with one of them is copied before this returns, since
                the caller may reuse it for the next batch before the value is written.

        Raises:
            DiskError: the writer failed earlier (disk full ...), or this Disk is closed.
            ConfigError: a value that cannot be written (neither tensors nor Stats).
        """
        self._raise_if_failed()
        if self._closed:
            raise DiskError(f"this fxprobe.Disk ({str(self.path)!r}) is closed; create a new "
                            "one (mode='append' to add to the same captures)")
        protected, input_sites = self._protected(inputs)
        job = _Encoder(protected, input_sites, self.copy).job(-1, values)
        if self._appending:
            # The first forward of a run appending to earlier captures must be of the same
            # model (same sites, structures, dtypes, shapes after dim 0): refused here, before
            # anything is queued (and so is every later forward).
            known = self._index["signature"]
            if set(job.signature) != set(known) or any(
                    known[n] != s for n, s in job.signature.items()):
                raise DiskError(_mismatch(self.path, known, job.signature))
            self._appending = False
        with self._cond:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name=f"fxprobe.Disk({self.path})")
                self._thread.start()
            while self._error is None and self._jobs and (
                    len(self._jobs) >= self.queue
                    or self._queued_bytes + job.nbytes > self.queue_bytes):
                self._cond.wait()
            self._raise_if_failed()
            # Numbered here, in queue order, so that the numbers of several threads' forwards
            # follow the order they are written in, without gaps.
            job.forward = self._next_forward
            self._next_forward += 1
            self._jobs.append(job)
            self._queued_bytes += job.nbytes
            self._cond.notify_all()

    def flush(self) -> None:
        """Wait until everything queued is written and committed (visible to readers).

        Ends the shard being written, so calling it after every forward makes small shards.
        """
        self._raise_if_failed()
        if self._thread is None or self._closed:
            return
        with self._cond:
            self._jobs.append("flush")
            self._cond.notify_all()
            while self._error is None and (self._jobs or self._busy):
                self._cond.wait()
        self._raise_if_failed()

    def close(self) -> None:
        """Flush, stop the writer thread and release the directory; idempotent."""
        if self._closed:
            self._raise_if_failed()
            return
        try:
            self.flush()
        finally:
            self._closed = True
            with self._cond:
                self._jobs.append("stop")
                self._cond.notify_all()
            if self._thread is not None and self._thread is not threading.current_thread():
                self._thread.join()
            self._unlock()
            _OPEN.discard(self)

    def __enter__(self) -> Disk:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def forwards(self) -> int:
        """Forwards handed over so far, including those of earlier runs (``mode="append"``)."""
        return self._next_forward

    def __repr__(self) -> str:
        state = "closed" if self._closed else "failed" if self._error else "open"
        return f"Disk({str(self.path)!r}, {state}, forwards={self._next_forward})"

    def _raise_if_failed(self) -> None:
        e = self._error
        if e is None:
            return
        committed = self._index["forwards"]
        raise DiskError(
            f"writing captures to {str(self.path)!r} failed: {e}. The {committed} forwards "
            f"listed in {INDEX} are intact and readable with fxprobe.open_captures; the "
            f"{self._lost} forward(s) after them were lost. Free space (or fix the cause) and "
            "continue with fxprobe.Disk(..., mode='append')"
        ) from e

    # -- the writer thread ------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._jobs:
                    self._cond.wait()
                item = self._jobs.popleft()
                self._busy = True
                self._cond.notify_all()  # room in the queue
            try:
                if item == "stop":
                    return
                if self._error is not None:
                    pass  # dropped: _fail counted what was queued when it failed
                elif item == "flush":
                    self._commit()
                else:
                    assert isinstance(item, _Job)
                    self._write_job(item)
            except BaseException as e:  # noqa: BLE001 (reported to the producer)
                self._fail(e, item)
            finally:
                with self._cond:
                    if isinstance(item, _Job):
                        self._queued_bytes -= item.nbytes
                    self._busy = False
                    self._cond.notify_all()

    def _fail(self, e: BaseException, item: Any) -> None:
        # A forward that failed half-way was cut back out of its shard: lost.
        lost = 1 if isinstance(item, _Job) and not item.written else 0
        with contextlib.suppress(BaseException):  # the first error is the one to report
            self._commit()  # keep the complete forwards of the shard (counts what it loses)
        with self._cond:
            self._lost += lost + sum(isinstance(j, _Job) for j in self._jobs)
            self._error = e

    def _write_job(self, job: _Job) -> None:
        if job.event is not None:
            job.event.synchronize()
        self._add_sites(job)
        layout_json = json.dumps(job.layout, separators=(",", ":"))
        shard = self._shard
        if shard is not None and not shard.fits(job, layout_json):
            self._commit()
            shard = None
        if shard is None:
            shard = self._shard = self._new_shard(job, layout_json)
        shard.add(job, layout_json)
        job.written = True
        if shard.pos >= self.shard_size:
            self._commit()

    def _new_shard(self, job: _Job, layout_json: str) -> _Shard:
        per_job = sum(len(k) + 128 + 12 * t.dim() for k, t in job.tensors) + 32
        jobs = max(1, math.ceil(self.shard_size / max(job.nbytes, 1)))
        header = per_job * jobs * 5 // 4 + len(layout_json) * 2 + 8192
        header = min(max(header, 64 * 1024), 64 * 2**20)
        shard = _Shard(self.path, self._next_shard, job.forward, header, self.fsync)
        self._next_shard += 1
        return shard

    def _add_sites(self, job: _Job) -> None:
        index = self._index
        known: dict[str, str] = index["signature"]
        for name, sig in job.signature.items():
            if name not in known:
                known[name] = sig
                index["sites"].append(name)

    def _commit(self) -> None:
        shard, self._shard = self._shard, None
        if shard is None:
            return
        if not shard.forwards:
            shard.abort()
            return
        try:
            entry = shard.commit()
        except BaseException:
            self._lost += shard.forwards
            shard.abort()
            raise
        try:
            self._record(entry)
        except BaseException:  # renamed but not listed: not committed, so not kept
            self._lost += shard.forwards
            with contextlib.suppress(OSError):
                shard.final.unlink()
            raise

    def _record(self, entry: dict[str, Any]) -> None:
        index = self._index
        new = dict(index, shards=[*index["shards"], entry],
                   forwards=entry["first"] + entry["count"])
        _write_json(self.path / INDEX, new, self.fsync)
        self._index = new


def _tensors_in(value: Any, out: list[torch.Tensor]) -> None:
    """Append every tensor in ``value`` (nested tuples, lists and mappings) to ``out``."""
    if isinstance(value, torch.Tensor):
        out.append(value)
    elif isinstance(value, (tuple, list)):
        for v in value:
            _tensors_in(v, out)
    elif isinstance(value, Mapping):
        for v in value.values():
            _tensors_in(v, out)


def _storage(t: torch.Tensor) -> int:
    """The address of ``t``'s storage; 0 for tensors without one (sparse, nested, wrapper
    subclasses), which hold no memory that a captured strided value could share."""
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return 0


def _mismatch(path: Path, known: dict[str, str], new: dict[str, str]) -> str:
    missing = [n for n in known if n not in new]
    extra = [n for n in new if n not in known]
    differ = [n for n in new if n in known and known[n] != new[n]]
    parts = []
    if extra:
        parts.append(f"sites not in them: {', '.join(extra[:5])}")
    if missing:
        parts.append(f"their sites this model lacks: {', '.join(missing[:5])}")
    if differ:
        n = differ[0]
        parts.append(f"site {n!r} differs (there {known[n]}, here {new[n]})")
    return (f"{str(path)!r} holds captures of another model ({'; '.join(parts)}); nothing was "
            "written. Write to another directory, or pass fxprobe.Disk(..., mode='overwrite') "
            "to replace them")


def check_disk_options(disk: Disk, keep: int | None) -> None:
    """Refuse what makes no sense with ``to=fxprobe.Disk(...)``."""
    if disk._closed:
        raise ConfigError(f"to={disk!r} is closed; pass a new fxprobe.Disk (mode='append' to "
                          "add to the same captures)")
    if keep is None:
        raise ConfigError(
            "keep='all' holds every forward in memory, which to=fxprobe.Disk(...) exists to "
            "avoid; drop keep= (tapped.taps still shows the last forward) and read the "
            "forwards back with fxprobe.open_captures(path)"
        )
