"""``fxprobe.Disk``: captures streamed to safetensors shards by a background thread (read
back by :func:`fxprobe.open_captures`, in :mod:`.captures`).

A capture directory (one per rank, ``acts/rank00001/``, when torch.distributed runs with more
than one rank)::

    acts/
      index.json                          the commit point: the shards it lists are complete
      shard-000000.safetensors            whole forwards; tensors named "{forward}/{site}/{leaf}"
      shard-000001.safetensors
      shard-000002.safetensors.partial    being written
      shard-000002.safetensors.journal    its complete forwards, one line each (:mod:`.shards`)
      .lock                               held (flock) while a Disk writes here

Every shard is a standard safetensors file (``safetensors.torch.load_file`` opens it), written
as one stream and renamed when complete (:mod:`.shards`); a new ``index.json`` follows each
rename (:mod:`.index`). Each forward is also listed in the journal of the shard being written
once its bytes are in the file, so a killed writer loses only the forwards not yet written
(readers read the journaled ones; ``mode="append"`` commits them).

This module is the writer: :class:`Disk`, its bounded queue and its thread. It depends only on
three calls, ``write(values, inputs)``, ``flush()`` and ``close()``; the tapped module makes
them after each forward and on ``remove()``.
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
from pathlib import Path
from typing import Any

from ..core.errors import ConfigError, DiskError
from ..core.options import Sink
from .catalog import INDEX, rank_dirs
from .index import CaptureDir, Mode
from .shards import Encoder, Job, Shard, crc_room, protected_storages

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


def _check_no_mix(root: Path, rank: int | None) -> None:
    """Refuse to write rank directories beside captures written without a rank, or the
    reverse: ``open_captures(root)`` could read only one of them."""
    ranks = rank_dirs(root)
    if rank is None and ranks:
        raise DiskError(
            f"{str(root)!r} holds captures of ranks {ranks} (in rank* directories); a Disk "
            "without a rank would write beside them and hide them from open_captures. Pass "
            "fxprobe.Disk(..., rank=...) or another directory")
    if rank is not None and (root / INDEX).exists():
        raise DiskError(
            f"{str(root)!r} holds captures written without a rank ({INDEX}); rank {rank} "
            f"would write beside them in rank{rank:05d}/, which open_captures would not read. "
            "Write to another directory (or remove those captures)")


# -- the public writer ----------------------------------------------------------------------

_OPEN: weakref.WeakSet[Disk] = weakref.WeakSet()
_ATEXIT = False


def _close_all() -> None:
    for disk in list(_OPEN):
        with contextlib.suppress(Exception):
            disk.close()


def _default_rank() -> int | None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.get_rank()
    return None


class Disk(Sink):
    """Where ``fxprobe.tap(..., to=fxprobe.Disk(path))`` streams every forward's captures.

    A background thread writes each forward's values (as ``tapped.taps`` shows them: tensors,
    or :class:`Stats` and samples with ``reduce=``) to safetensors shards of about
    ``shard_size`` bytes. The forward only hands its values over; by default (``queue=0``)
    it waits until the writer has written the previous forward, so the next forward runs
    while this one is written and a killed process (SIGKILL) loses at most the forward being
    written; ``queue=k`` lets ``k`` forwards (or ``queue_bytes`` bytes) wait unwritten.
    Values on a GPU are copied to pinned host memory without blocking; CPU values
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
        queue: forwards that may wait for the writer before a forward waits; 0 (the
            default): none, the forward waits until the previous one is written.
        queue_bytes: with ``queue >= 1``, bytes that may wait (a bigger single forward still
            goes through alone).
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
                 shard_size: int | str = "256MiB", queue: int = 0,
                 queue_bytes: int | str = "1GiB", rank: int | None = None, copy: bool = False,
                 fsync: bool = True) -> None:
        if mode not in ("new", "append", "overwrite"):
            raise ConfigError(f"Disk(mode={mode!r}) is not accepted; use 'new', 'append' or "
                              "'overwrite'")
        if isinstance(queue, bool) or not isinstance(queue, int) or queue < 0:
            raise ConfigError(f"Disk(queue={queue!r}) must be an int >= 0 (forwards that may "
                              "wait unwritten; 0: none)")
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
        _check_no_mix(root, self.rank)
        self._mode = mode
        self._dir = CaptureDir(self.path, mode, self.fsync, self.rank)
        self._released = False
        self._next_forward = self._dir.committed
        self._cond = threading.Condition()
        self._jobs: collections.deque[Job | str] = collections.deque()
        self._queued_bytes = 0
        self._unwritten = 0
        """Forwards handed over and not yet in their shard (journaled), or failed."""
        self._busy = False
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._lost = 0
        self._closed = False
        self._shard: Shard | None = None
        self._module: Any = None
        self._canonical_known: set[str] = set()
        self._canonical: dict[str, str] = {}
        """Canonical name -> site name, of the sites written so far (listed in the index)."""
        global _ATEXIT
        if not _ATEXIT:
            atexit.register(_close_all)
            _ATEXIT = True
        _OPEN.add(self)

    # -- the forward's side -----------------------------------------------------------------
    def attach(self, module: Any) -> None:
        """Let the writer copy ``module``'s parameters, buffers and inputs before handing them
        over (called by ``fxprobe.tap``; optional for other producers)."""
        self._module = weakref.ref(module)

    def check_options(self, keep: int | None) -> None:
        """Refuse what makes no sense with ``to=fxprobe.Disk(...)`` (see :class:`Sink`)."""
        if self._closed:
            raise ConfigError(f"to={self!r} is closed; pass a new fxprobe.Disk (mode='append' "
                              "to add to the same captures)")
        if keep is None:
            raise ConfigError(
                "keep='all' holds every forward in memory, which to=fxprobe.Disk(...) exists "
                "to avoid; drop keep= (tapped.taps still shows the last forward) and read the "
                "forwards back with fxprobe.open_captures(path)"
            )

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
        if self._released:  # given back before anything was written: take the directory again
            with self._cond:
                if self._released:
                    self._dir = CaptureDir(self.path, self._mode, self.fsync, self.rank)
                    self._next_forward = self._dir.committed
                    self._released = False
        module = self._module() if self._module is not None else None
        protected, input_sites = protected_storages(inputs, module)
        # a TappedModule's options are public; a TappedArtifact's its own
        options = getattr(module, "options", None) or getattr(module, "_options", None)
        captures_inputs = getattr(options, "capture", "output") == "input"
        job = Encoder(protected, input_sites, self.copy, captures_inputs).job(-1, values)
        self._dir.check_same_model(job.signature)
        if module is not None and not self._canonical_known.issuperset(values):
            self._learn_canonical(module, values)
        with self._cond:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name=f"fxprobe.Disk({self.path})")
                self._thread.start()
            while self.queue and self._error is None and self._jobs and (
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
            self._unwritten += 1
            self._cond.notify_all()
            # queue=0: return once every forward before this one is written (this one queued
            # first, so that the writer goes on to it without waiting for this thread)
            while self.queue == 0 and self._error is None and self._unwritten > 1:
                self._cond.wait()
            if self._error is not None and not job.written:  # the writer failed meanwhile:
                self._lost -= 1  # this forward is not written; the caller is told so here
                self._raise_if_failed()

    def _learn_canonical(self, module: Any, values: Mapping[str, Any]) -> None:
        """Record the canonical names (``blocks.6.resid_post``) of sites not seen before, so
        that a reader finds them by either name; the writer thread lists them in the index."""
        found = {c: s.name for s in getattr(module, "sites", ()) if s.name in values
                 for c in getattr(s, "canonical", ())}
        with self._cond:
            self._canonical.update(found)
        self._canonical_known.update(values)

    def release(self) -> None:
        """Unlock the directory if nothing was handed over yet (the tapped module's selection
        failed at its first forward), so that a corrected ``fxprobe.tap`` with a new Disk can
        write there; a later :meth:`write` of this one takes it again."""
        with self._cond:
            if self._closed or self._released or self._thread is not None:
                return
            self._dir.unlock()
            self._released = True

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
            self._dir.unlock()
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
        committed = self._dir.committed
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
                    assert isinstance(item, Job)
                    self._write_job(item)
            except BaseException as e:  # noqa: BLE001 (reported to the producer)
                self._fail(e, item)
            finally:
                with self._cond:
                    if isinstance(item, Job):
                        self._queued_bytes -= item.nbytes
                        if not item.written:  # failed or dropped (counted as lost)
                            self._unwritten -= 1
                    self._busy = False
                    self._cond.notify_all()

    def _fail(self, e: BaseException, item: Any) -> None:
        # A forward that failed half-way was cut back out of its shard: lost.
        lost = 1 if isinstance(item, Job) and not item.written else 0
        with contextlib.suppress(BaseException):  # the first error is the one to report
            self._commit()  # keep the complete forwards of the shard (counts what it loses)
        with self._cond:
            self._lost += lost + sum(isinstance(j, Job) for j in self._jobs)
            self._error = e

    def _write_job(self, job: Job) -> None:
        if job.event is not None:
            job.event.synchronize()
        with self._cond:
            canonical = dict(self._canonical)
        self._dir.add_sites(job.signature, canonical)
        layout_json = json.dumps(job.layout, separators=(",", ":"))
        shard = self._shard
        if shard is not None and not shard.fits(job, layout_json):
            self._commit()
            shard = None
        if shard is None:
            shard = self._shard = self._new_shard(job, layout_json)
        shard.add(job, layout_json)
        with self._cond:  # journaled: a forward waiting for it (queue=0) may go on
            job.written = True
            self._unwritten -= 1
            self._cond.notify_all()
        if shard.pos >= self.shard_size:
            self._commit()

    def _new_shard(self, job: Job, layout_json: str) -> Shard:
        per_job = sum(len(k) + 128 + 12 * t.dim() + crc_room(k, t.numel() * t.element_size())
                      for k, t in job.tensors) + 32
        jobs = max(1, math.ceil(self.shard_size / max(job.nbytes, 1)))
        header = per_job * jobs * 5 // 4 + len(layout_json) * 2 + 8192
        header = min(max(header, 64 * 1024), 64 * 2**20)
        return Shard(self.path, self._dir.take_shard_number(), job.forward, header, self.fsync,
                     self.rank)

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
            self._dir.record(entry)
        except BaseException:  # renamed but not listed: not committed, so not kept
            self._lost += shard.forwards
            with contextlib.suppress(OSError):
                shard.final.unlink()
            shard.done()
            raise
        shard.done()
