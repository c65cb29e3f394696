"""What open_captures reads after things went wrong: a writer killed mid-harvest, a shard
truncated or overwritten after its commit. Values are checked against what the killed writer
was given (a seeded generator reproduces it here)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import zlib
from pathlib import Path
from typing import IO, NamedTuple

import pytest
import torch
from safetensors.torch import load_file

import fxprobe

ROOT = Path(__file__).resolve().parent.parent

HARVEST = textwrap.dedent("""
    import json, os, sys, torch
    from torch import nn
    import fxprobe
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
    g = torch.Generator().manual_seed(1)
    mode = sys.argv[2]
    index = os.path.join(sys.argv[1], "index.json")
    told = False
    with torch.no_grad(), fxprobe.tap(model, ops="1", to=fxprobe.Disk(
            sys.argv[1], shard_size=4000, mode=mode)) as tapped:
        for i in range(int(sys.argv[3])):
            tapped(torch.randn(4, 8, generator=g))
            if not told and mode == "new" and os.path.exists(index):
                try:
                    with open(index) as f:
                        shards = len(json.load(f)["shards"])
                except (OSError, ValueError):  # read while it was replaced
                    shards = 0
                if shards >= 3:  # tell the parent, and go on writing until it kills us
                    print("3 shards", flush=True)
                    told = True
""")


def expected_values(n: int) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU())
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        return [model(torch.randn(4, 8, generator=g)) for _ in range(n)]


class Harvest(NamedTuple):
    proc: subprocess.Popen[str]
    err: IO[str]
    """Its stderr (a file: a pipe nobody reads could fill and stop it)."""

    def stderr(self) -> str:
        self.err.seek(0)
        return self.err.read()[-2000:]


def run(path: Path, mode: str, forwards: int) -> Harvest:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    err = tempfile.TemporaryFile("w+")
    return Harvest(subprocess.Popen([sys.executable, "-c", HARVEST, str(path), mode,
                                     str(forwards)], env=env, stdout=subprocess.PIPE,
                                    stderr=err, text=True), err)


def test_a_writer_killed_mid_harvest_loses_at_most_the_shard_in_flight(tmp_path: Path) -> None:
    path = tmp_path / "acts"
    harvest = run(path, "new", 10**7)
    proc = harvest.proc
    try:
        # No deadline: the harvest says when 3 shards are committed (or ends, and says why).
        said = proc.stdout.readline() if proc.stdout else ""
        if said != "3 shards\n":
            proc.wait()
            pytest.fail(f"the harvest ended before 3 shards (exit {proc.returncode}): "
                        f"{harvest.stderr()}")
        proc.send_signal(signal.SIGKILL)  # mid-harvest: it goes on writing until killed
    finally:
        proc.kill()
        proc.wait()
    index = path / "index.json"
    caps = fxprobe.open_captures(path)
    n = len(caps)
    listed = json.loads(index.read_text())
    # The index's shards, and the forwards the journal of the unfinished one lists.
    assert n >= listed["forwards"] == sum(s["count"] for s in listed["shards"]) > 0
    ref = expected_values(n + 50)
    for i in range(n):  # every committed forward reads back exactly
        assert torch.equal(caps.forward(i)["1"], ref[i]), i
    ds = caps.dataset("1", rows="samples")
    assert torch.equal(torch.stack([ds[i] for i in range(len(ds))]), torch.cat(ref[:n]))
    # resuming removes what the kill left behind and continues the numbering
    resumed = run(path, "append", 5)
    assert resumed.proc.wait() == 0, resumed.stderr()
    assert not list(path.glob("*.partial"))
    caps = fxprobe.open_captures(path)
    assert len(caps) == n + 5
    for i in range(n):
        assert torch.equal(caps.forward(i)["1"], ref[i]), i
    again = expected_values(5)  # the resumed run starts its generator over
    for i in range(5):
        assert torch.equal(caps.forward(n + i)["1"], again[i]), i


def committed(tmp_path: Path, forwards: int = 40) -> list[str]:
    harvest = run(tmp_path, "new", forwards)
    assert harvest.proc.wait() == 0, harvest.stderr()
    return [s["file"] for s in json.loads((tmp_path / "index.json").read_text())["shards"]]


@pytest.fixture(scope="module")
def harvested(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One committed harvest for the damage tests: each damages a copy of its own (the
    harvest is the same every time; starting its process is what took the time)."""
    path = tmp_path_factory.mktemp("harvested")
    committed(path)
    return path


@pytest.mark.parametrize("damage", ["truncated", "header", "swapped", "missing"])
def test_a_corrupted_shard_is_reported_by_name_and_never_read(tmp_path: Path, damage: str,
                                                              harvested: Path) -> None:
    shutil.copytree(harvested, tmp_path, dirs_exist_ok=True)
    shards = [s["file"] for s in json.loads((tmp_path / "index.json").read_text())["shards"]]
    assert len(shards) >= 2
    bad = tmp_path / shards[1]
    data = bad.read_bytes()
    if damage == "truncated":
        bad.write_bytes(data[: len(data) // 2])
    elif damage == "header":
        bad.write_bytes(data[:8] + b"#" * 40 + data[48:])
    elif damage == "swapped":  # another committed shard under this name: other forwards
        bad.write_bytes((tmp_path / shards[0]).read_bytes())
    else:
        bad.unlink()
    caps = fxprobe.open_captures(tmp_path)
    ref = expected_values(len(caps))
    assert torch.equal(caps.forward(0)["1"], ref[0])  # the intact shard still reads
    first_bad = json.loads((tmp_path / "index.json").read_text())["shards"][1]["first"]
    with pytest.raises(fxprobe.DiskError, match=shards[1].replace(".", r"\.")):
        caps.forward(first_bad)
    with pytest.raises(fxprobe.DiskError, match=shards[1].replace(".", r"\.")):
        caps.dataset("1", rows="samples")


class Times1(torch.nn.Module):
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h * 1


def two_ranks(path: Path) -> None:
    """Ranks 0 and 1, 4 forwards each, ``h == mul == 100 * rank + forward`` (2 per shard)."""
    for rank in (0, 1):
        with fxprobe.tap(Times1(), to=fxprobe.Disk(path, rank=rank, shard_size=200)) as tapped:
            for f in range(4):
                tapped(torch.full((2, 4), float(100 * rank + f)))


def edit_header(shard: Path, old: str, new: str) -> None:
    """Replace ``old`` by ``new`` in the shard's JSON header, keeping its length."""
    data = shard.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = data[8:8 + n].decode()
    assert old in header, (old, header[:300])
    header = header.replace(old, new, 1)
    shard.write_bytes(data[:8] + header.ljust(n).encode() + data[8 + n:])


def first_values(path: Path, verify: bool = True) -> list[float]:
    caps = fxprobe.open_captures(path, verify=verify)
    return [caps.forward(i)["mul"][0, 0].item() for i in range(len(caps))]


def test_checksums_in_the_index_are_those_of_the_shards_bytes(tmp_path: Path) -> None:
    two_ranks(tmp_path)
    assert first_values(tmp_path) == [0, 1, 2, 3, 100, 101, 102, 103]
    for rank in (0, 1):
        d = tmp_path / f"rank{rank:05d}"
        index = json.loads((d / "index.json").read_text())
        assert index["rank"] == rank
        for entry in index["shards"]:
            data = (d / entry["file"]).read_bytes()
            n = int.from_bytes(data[:8], "little")
            assert entry["header_crc32"] == zlib.crc32(data[:8 + n])
            header = json.loads(data[8:8 + n])
            crcs = json.loads(header["__metadata__"]["fxprobe"])["crcs"]
            for key, crc in crcs.items():  # one CRC-32 per block (here one) of each tensor
                begin, end = header[key]["data_offsets"]
                assert crc == [zlib.crc32(data[8 + n + begin:8 + n + end])]
            # Still a standard safetensors file: its own reader gives the written values.
            loaded = load_file(d / entry["file"])
            for f in range(entry["first"], entry["first"] + entry["count"]):
                assert torch.equal(loaded[f"{f}/mul/0"], torch.full((2, 4), 100.0 * rank + f))


@pytest.mark.parametrize("verify", [True, False])
def test_shards_swapped_between_ranks_are_refused(tmp_path: Path, verify: bool) -> None:
    two_ranks(tmp_path)
    a = tmp_path / "rank00000" / "shard-000000.safetensors"
    b = tmp_path / "rank00001" / "shard-000000.safetensors"
    data_a, data_b = a.read_bytes(), b.read_bytes()
    a.write_bytes(data_b)
    b.write_bytes(data_a)
    caps = fxprobe.open_captures(tmp_path, verify=verify)
    assert caps.forward(2)["mul"][0, 0].item() == 2  # the untouched shard still reads
    for i, name in ((0, "rank00000"), (4, "rank00001")):
        with pytest.raises(fxprobe.DiskError, match=f"{name}/shard-000000.*written by rank"):
            caps.forward(i)


@pytest.mark.parametrize("damage", [
    "data byte", "dtype F32->I32", "shape [2,4]->[4,2]", "shape [2,4]->[2,3]", "dtype F32->XX",
    "key renamed"])
def test_changed_bytes_or_headers_are_reported_by_name(tmp_path: Path, damage: str) -> None:
    two_ranks(tmp_path)
    shard = tmp_path / "rank00000" / "shard-000000.safetensors"
    if damage == "data byte":
        data = bytearray(shard.read_bytes())
        data[-20] ^= 0x40  # inside 1/mul/0 (the last tensor)
        shard.write_bytes(bytes(data))
    elif damage.startswith("dtype"):
        code = damage.split("->")[1]
        edit_header(shard, '"1/mul/0":{"dtype":"F32"', f'"1/mul/0":{{"dtype":"{code}"')
    elif damage.startswith("shape"):
        new = damage.split("->")[1]
        edit_header(shard, '"1/mul/0":{"dtype":"F32","shape":[2,4]',
                    f'"1/mul/0":{{"dtype":"F32","shape":{new}')
    else:
        edit_header(shard, '"1/mul/0"', '"1/mul/X"')
    with pytest.raises(fxprobe.DiskError, match="rank00000/shard-000000.*corrupted"):
        first_values(tmp_path)
    # Unverified: what does not need the checksums is still refused, never misread.
    if damage in ("shape [2,4]->[2,3]", "dtype F32->XX", "key renamed"):
        with pytest.raises(fxprobe.DiskError, match="rank00000/shard-000000.*corrupted"):
            first_values(tmp_path, verify=False)


def test_indexes_without_checksums_still_read(tmp_path: Path) -> None:
    two_ranks(tmp_path)
    for rank in (0, 1):  # as a version without checksums wrote them
        p = tmp_path / f"rank{rank:05d}" / "index.json"
        index = json.loads(p.read_text())
        for entry in index["shards"]:
            entry.pop("crc32", None)  # shards since per-block checksums have none
            del entry["header_crc32"]
        del index["rank"]
        p.write_text(json.dumps(index))
    assert first_values(tmp_path) == [0, 1, 2, 3, 100, 101, 102, 103]


def test_an_index_counting_more_forwards_than_its_shards_is_refused(tmp_path: Path) -> None:
    two_ranks(tmp_path)
    p = tmp_path / "rank00000" / "index.json"
    p.write_text(json.dumps(dict(json.loads(p.read_text()), forwards=7)))
    with pytest.raises(fxprobe.DiskError, match="rank00000/index.json.*7 forwards.*hold 4"):
        fxprobe.open_captures(tmp_path)


def test_one_rank_knows_its_rank_and_mixed_directories_are_refused(tmp_path: Path) -> None:
    two_ranks(tmp_path)
    one = fxprobe.open_captures(tmp_path, rank=1)
    assert [one.rank_of(i) for i in range(len(one))] == [1] * 4
    assert fxprobe.open_captures(tmp_path / "rank00001").rank_of(-1) == 1
    with pytest.raises(fxprobe.DiskError, match=r"captures of ranks \[0, 1\].*rank="):
        fxprobe.Disk(tmp_path)
    plain = tmp_path / "plain"
    with fxprobe.tap(Times1(), to=fxprobe.Disk(plain)) as tapped:
        tapped(torch.ones(2, 4))
    with pytest.raises(fxprobe.DiskError, match="without a rank"):
        fxprobe.Disk(plain, rank=0)
    # Both kinds in one directory (copied there by hand): neither hides the other.
    (tmp_path / "index.json").write_bytes((plain / "index.json").read_bytes())
    with pytest.raises(fxprobe.DiskError, match=r"without a rank.*ranks \[0, 1\]"):
        fxprobe.open_captures(tmp_path)


def test_concatenating_values_of_different_trailing_dims_is_refused(tmp_path: Path) -> None:
    with fxprobe.tap(Times1(), to=fxprobe.Disk(tmp_path)) as tapped:
        tapped(torch.ones(2, 3))
        tapped(torch.ones(2, 5))
    caps = fxprobe.open_captures(tmp_path)
    with pytest.raises(fxprobe.DiskError, match=r"'mul'.*shape \(2, 5\) in forward 1.*"
                                                r"\(2, 3\) before"):
        caps["mul"]
    assert [tuple(f["mul"].shape) for f in caps] == [(2, 3), (2, 5)]
