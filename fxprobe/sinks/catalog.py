"""What a capture directory lists: its ``index.json`` (the shards committed), the rank
directories under it, and the forwards the journal of the shard being written lists, as one
index (a *snapshot*) that :class:`~fxprobe.sinks.captures.Captures` reads."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from ..core.errors import DiskError
from . import shardfile
from .shardfile import JOURNAL, read_journal

INDEX = "index.json"
FORMAT = "fxprobe-captures"
VERSION = 1
SHARD_RE = re.compile(r"^shard-(\d{6})\.safetensors$")
STATS_KEY = "__stats__"




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
                  if has_captures(d))


def has_captures(path: Path) -> bool:
    """An index, or the journal of a first shard still being written (or left by a killed
    writer)."""
    return (path / INDEX).exists() or (path / f"shard-000000.safetensors{JOURNAL}").exists()


def _snapshot(path: Path, rank: int | None = None) -> dict[str, Any]:
    """The index of ``path`` and, after its shards, the forwards that the journal of the
    shard being written lists (``"journal"`` in its entry; read through the ``.partial``)."""
    index: dict[str, Any] = read_index(path / INDEX) if (path / INDEX).exists() else {
        "format": FORMAT, "version": VERSION, "sites": [], "forwards": 0, "shards": []}
    if rank is not None:
        index["rank"] = rank
    numbers = [int(m.group(1)) for s in index["shards"] if (m := SHARD_RE.match(s["file"]))]
    name = f"shard-{max(numbers, default=-1) + 1:06d}.safetensors"
    head, records = read_journal(path / (name + JOURNAL))
    if head is None or not records or head.get("first") != index["forwards"] or \
            head.get("block") != shardfile.BLOCK:
        return index
    if not (path / (name + ".partial")).exists() and not (path / name).exists():
        return index
    sites = list(index["sites"])
    for r in records:
        try:
            names = json.loads(r["layout"])
        except (KeyError, TypeError, ValueError):
            break
        sites += [n for n in names if n not in sites]
    index = dict(index, sites=sites, forwards=index["forwards"] + len(records),
                 shards=[*index["shards"], {"file": name + ".partial", "first": head["first"],
                                            "count": len(records),
                                            "journal": (head, records)}])
    return index


def _all_ranks(path: Path, ranks: list[int]) -> dict[str, Any]:
    """One index over every rank's committed shards under ``path``.

    Each rank commits its own ``index.json`` (no lock is shared between processes, which a
    network filesystem might not honour); this reads them all and lays their forwards end to
    end, recording each shard's rank and the forward numbering within it.
    """
    merged: dict[str, Any] = {"format": FORMAT, "version": VERSION, "sites": [],
                              "forwards": 0, "shards": []}
    for rank in ranks:
        index = _snapshot(path / f"rank{rank:05d}", rank)
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
