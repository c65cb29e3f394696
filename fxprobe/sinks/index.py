"""The directory a :class:`~fxprobe.Disk` writes: its lock, its ``index.json`` (the commit point:
the shards it lists are complete) and what a crashed writer left behind.

A new ``index.json`` is written after each shard's rename (temporary file + ``os.replace``); the
forwards of the shard being written are listed in its journal (:mod:`.shards`), which the next
writer (``mode="append"``) commits: a crash loses only the forwards not yet written.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Literal

from ..core.errors import DiskError
from .catalog import FORMAT, INDEX, SHARD_RE, VERSION, read_index
from .shardfile import JOURNAL, read_journal
from .shards import Shard

JOURNAL_RE = re.compile(r"^shard-(\d{6})\.safetensors" + re.escape(JOURNAL) + "$")

Mode = Literal["new", "append", "overwrite"]


class CaptureDir:
    """A capture directory, locked (``flock``) for one writer; :attr:`index` is what is
    committed.

    Raises:
        DiskError: the directory cannot be created or written, another process writes there,
            or (``mode="new"``) it already holds captures.
    """

    def __init__(self, path: Path, mode: Mode, fsync: bool, rank: int | None = None) -> None:
        self.path = path
        self.fsync = fsync
        self.rank = rank
        self.index: dict[str, Any] = {}
        """The committed ``index.json``: sites, their signatures, forwards, shards."""
        self.appending = False
        """Earlier captures are here and the next forward must be of the same model."""
        self.next_shard = 0
        self._lock_fd: int | None = None
        self._open(mode)

    def _open(self, mode: Mode) -> None:
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
            self._load(mode)
        except BaseException:
            self.unlock()
            raise

    def _load(self, mode: Mode) -> None:
        p = self.path
        index_path = p / INDEX
        shards = sorted(f for f in os.listdir(p) if SHARD_RE.match(f))
        journals = sorted(f for f in os.listdir(p) if JOURNAL_RE.match(f))
        has = index_path.exists()
        if mode == "new" and (has or shards or any(read_journal(p / j)[1] for j in journals)):
            raise DiskError(
                f"{str(p)!r} already holds captures ({INDEX}, {len(shards)} shard(s), "
                f"{len(journals)} unfinished); pass fxprobe.Disk(..., mode='append') to add to "
                "them, mode='overwrite' to replace them, or another directory"
            )
        for f in os.listdir(p):  # leftovers of a crashed writer: never committed
            if f.endswith(".tmp") or (mode == "overwrite" and (
                    SHARD_RE.match(f) or f.endswith(".partial") or JOURNAL_RE.match(f))):
                (p / f).unlink()
        if mode == "overwrite" and has:
            index_path.unlink()
            has = False
        if has:
            self.index = read_index(index_path)
        else:
            self.index = {"format": FORMAT, "version": VERSION, "sites": [],
                          "signature": {}, "forwards": 0, "shards": []}
        listed = {s["file"] for s in self.index["shards"]}
        for f in sorted(f for f in os.listdir(p) if SHARD_RE.match(f)):
            if f in listed:
                continue
            # Renamed but not yet listed when the writer stopped: its journal still says
            # which forwards it holds, so it is committed again below; without one, dropped.
            if (p / (f + JOURNAL)).exists():
                os.replace(p / f, p / (f + ".partial"))
            else:
                (p / f).unlink()
        if self.rank is not None:
            self.index["rank"] = self.rank
        numbers = [int(m.group(1)) for s in self.index["shards"]
                   if (m := SHARD_RE.match(s["file"]))]
        self.next_shard = max(numbers, default=-1) + 1
        self._recover()
        self.appending = bool(self.index["forwards"])

    def _recover(self) -> None:
        """Commit the forwards a killed writer's journal lists (those of the shard it was
        writing); remove every other leftover of it."""
        p = self.path
        for f in sorted(os.listdir(p)):
            m = JOURNAL_RE.match(f)
            if m is None:
                continue
            number = int(m.group(1))
            shard = None
            if number == self.next_shard:
                shard = Shard.resume(p, number, self.fsync, self.rank, self.committed)
            if shard is None:
                for leftover in (p / f, p / (f[:-len(JOURNAL)] + ".partial")):
                    leftover.unlink(missing_ok=True)
                continue
            self.next_shard += 1
            try:
                entry = shard.commit()
            except BaseException:
                shard.abort()
                raise
            self.add_sites(shard.signature)
            self.record(entry)
            shard.done()
        for f in os.listdir(p):  # without a journal: nothing in it was complete
            if f.endswith(".partial"):
                (p / f).unlink(missing_ok=True)

    def unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None

    @property
    def committed(self) -> int:
        """Forwards listed in the index: complete, and readable."""
        return int(self.index["forwards"])

    def check_same_model(self, signature: dict[str, str]) -> None:
        """The first forward of a run appending to earlier captures must be of the same model
        (same sites, structures, dtypes, shapes after dim 0); raise :class:`DiskError` if not,
        before anything is queued (and so for every later forward, until one matches)."""
        if not self.appending:
            return
        known = self.index["signature"]
        if set(signature) != set(known) or any(known[n] != s for n, s in signature.items()):
            raise DiskError(_mismatch(self.path, known, signature))
        self.appending = False

    def add_sites(self, signature: dict[str, str],
                  canonical: dict[str, str] | None = None) -> None:
        """Record the sites of a forward not seen before, and the canonical names of sites
        (``{"blocks.6.resid_post": "transformer.h.6.add_1"}``); listed at the next commit."""
        known: dict[str, str] = self.index["signature"]
        for name, sig in signature.items():
            if name not in known:
                known[name] = sig
                self.index["sites"].append(name)
        if canonical:
            names = self.index.setdefault("canonical", {})
            for alias, name in canonical.items():
                if name in known:
                    names.setdefault(alias, name)

    def take_shard_number(self) -> int:
        """The number of the next shard file (``shard-000007.safetensors``)."""
        number = self.next_shard
        self.next_shard += 1
        return number

    def record(self, entry: dict[str, Any]) -> None:
        """Commit a shard renamed to its final name: write the index that lists it."""
        index = self.index
        new = dict(index, shards=[*index["shards"], entry],
                   forwards=entry["first"] + entry["count"])
        write_json(self.path / INDEX, new, self.fsync)
        self.index = new


def write_json(path: Path, data: Any, fsync: bool) -> None:
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
