"""The fast row reader: ``Captures.rows``, ``ds.loader`` and ``ds[rows]`` against NumPy
(the values as written, concatenated), checksums checked block by block, and directories
written by older fxprobe (tests/data/disk_v1, written at f3d4cd4) still read."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import fxprobe
from fxprobe.sinks import shardfile

DATA = Path(__file__).resolve().parent / "data" / "disk_v1"


def write(path: Path, forwards: int, shard_size: int | str = "256MiB",
          **kw: object) -> list[dict[str, torch.Tensor]]:
    """Forwards of two sites of different widths and dtypes, and a batch dim that varies."""
    g = torch.Generator().manual_seed(0)
    written = []
    with fxprobe.Disk(path, shard_size=shard_size, fsync=False, **kw) as d:  # type: ignore[arg-type]
        for f in range(forwards):
            b = 1 + f % 3
            v = {"h": torch.randn(b, 5, 6, generator=g),
                 "g": torch.randn(b, 5, 3, generator=g).to(torch.bfloat16)}
            d.write(v)
            written.append({k: t.clone() for k, t in v.items()})
    return written


def flat(written: list[dict[str, torch.Tensor]], name: str, lead: int) -> torch.Tensor:
    return torch.cat([w[name].flatten(0, lead - 1) for w in written])


@pytest.mark.parametrize("shard_size", [1, 2000, "256MiB"])
def test_rows_are_the_written_rows_in_the_order_asked(tmp_path: Path, shard_size: object
                                                      ) -> None:
    written = write(tmp_path, 7, shard_size)  # type: ignore[arg-type]
    caps = fxprobe.open_captures(tmp_path)
    rng = np.random.default_rng(0)
    for lead in (2, 1, 2):  # a second table, then the first again
        for name in ("h", "g"):
            ref = flat(written, name, lead)
            assert caps.row_count(name, lead) == len(ref)
            for idx in (rng.permutation(len(ref)), np.sort(rng.integers(0, len(ref), 9)),
                        np.array([3, 3, 0]), np.array([], dtype=np.int64)):
                got = caps.rows(name, idx, lead)
                assert got.dtype == ref.dtype and got.shape == (len(idx), *ref.shape[1:])
                assert torch.equal(got, ref[torch.as_tensor(idx, dtype=torch.long)])
    got = caps.rows("h", torch.tensor([1, 0]))
    got.zero_()  # a copy: the next read is unchanged
    assert torch.equal(caps.rows("h", [1, 0]), flat(written, "h", 2)[[1, 0]])
    with pytest.raises(IndexError, match="row 65 out of range.*'h' has 65"):
        caps.rows("h", [0, 65])
    with pytest.raises(IndexError, match="row -1"):
        caps.rows("h", [-1])


def test_loader_and_dataloader_read_every_row_once_per_epoch(tmp_path: Path) -> None:
    written = write(tmp_path, 6, 3000)
    ds = fxprobe.open_captures(tmp_path).dataset("h")
    ref = flat(written, "h", 2)
    key = lambda t: sorted(map(tuple, t.tolist()))  # noqa: E731
    for epoch in range(2):
        g = torch.Generator().manual_seed(epoch)
        batches = list(ds.loader(16, generator=g))
        assert [len(b) for b in batches] == [16] * 3 + [ref.shape[0] - 48]
        assert key(torch.cat(batches)) == key(ref)
        assert torch.equal(torch.cat(list(ds.loader(16, shuffle=False))), ref)
        plain = torch.cat(list(DataLoader(ds, batch_size=16, shuffle=True)))
        assert key(plain) == key(ref)
    assert len(list(ds.loader(16, drop_last=True))) == 3
    with pytest.raises(fxprobe.ConfigError, match="collate_fn"):
        ds.loader(16, collate_fn=list)
    several = fxprobe.open_captures(tmp_path).dataset(["h", "g"])
    for b in several.loader(50, shuffle=False):
        assert set(b) == {"h", "g"}
    rows = list(DataLoader(several, batch_size=7))[1]
    assert torch.equal(rows["g"], flat(written, "g", 2)[7:14])


def test_workers_read_the_same_rows(tmp_path: Path) -> None:
    written = write(tmp_path, 4, 2000)
    ds = fxprobe.open_captures(tmp_path).dataset("h", rows="samples")
    got = torch.cat(list(ds.loader(3, shuffle=False, num_workers=2)))
    assert torch.equal(got, flat(written, "h", 1))


def test_a_corrupted_block_is_named_when_a_row_in_it_is_read_and_only_then(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shardfile, "BLOCK", 64)  # small blocks: rows of 24 bytes in several
    from fxprobe.sinks import rowtable as _rows
    from fxprobe.sinks import shards as _shards

    monkeypatch.setattr(_rows, "BLOCK", 64)
    monkeypatch.setattr(_shards, "BLOCK", 64)
    written = write(tmp_path, 3)
    shard = tmp_path / "shard-000000.safetensors"
    data = bytearray(shard.read_bytes())
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    begin, end = header["1/h/0"]["data_offsets"]  # forward 1: 2 x 5 rows of 6 floats
    data[8 + n + begin + 100] ^= 0x10  # row 4 of forward 1 (bytes 96..120), block 1
    shard.write_bytes(bytes(data))
    caps = fxprobe.open_captures(tmp_path)
    ref = flat(written, "h", 2)
    before = 5  # forward 0 has 1 x 5 rows
    ok = [i for i in range(len(ref)) if not before + 2 <= i <= before + 5]  # blocks 0 and 2+
    assert torch.equal(caps.rows("h", ok), ref[ok])
    with pytest.raises(fxprobe.DiskError, match=r"shard-000000.*'1/h/0'.*checksum"):
        caps.rows("h", [before + 4])
    with pytest.raises(fxprobe.DiskError, match=r"shard-000000.*'1/h/0'.*checksum"):
        caps.forward(1)
    assert torch.equal(fxprobe.open_captures(tmp_path, verify=False).rows("h", [0]), ref[:1])


def test_a_directory_written_by_fxprobe_f3d4cd4_still_reads(tmp_path: Path) -> None:
    def values(f: int) -> dict[str, torch.Tensor]:  # what tests/data/README.md wrote
        a = (torch.arange(24, dtype=torch.float32).reshape(2, 3, 4) + 100 * f) / 7
        b = (torch.arange(12, dtype=torch.float32).reshape(2, 3, 2) - 50 * f).to(torch.bfloat16)
        return {"a": a, "b": b}

    caps = fxprobe.open_captures(DATA)
    assert caps.names == ("a", "b", "c") and len(caps) == 5
    for f in range(5):
        v = values(f)
        got = caps.forward(f)
        assert torch.equal(got["a"], v["a"]) and torch.equal(got["b"], v["b"])
        assert torch.equal(got["c"][0], v["a"][:, 0]) and torch.equal(got["c"][1]["k"], v["b"][0])
    for name in ("a", "b"):
        ref = torch.cat([values(f)[name].flatten(0, 1) for f in range(5)])
        perm = np.random.default_rng(1).permutation(len(ref))
        assert torch.equal(caps.rows(name, perm), ref[perm])
        ds = caps.dataset(name)
        assert torch.equal(torch.cat(list(ds.loader(4, shuffle=False))), ref)
    # A changed data byte in such a shard is found by its whole-shard checksum.
    copy = tmp_path / "old"
    shutil.copytree(DATA, copy)
    shard = copy / "shard-000001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0x01
    shard.write_bytes(bytes(data))
    old = fxprobe.open_captures(copy)
    assert torch.equal(old.rows("a", [0]), values(0)["a"][0, :1])
    with pytest.raises(fxprobe.DiskError, match="shard-000001.*checksum"):
        old.rows("a", np.arange(old.row_count("a")))
    # ... and appended to: the new shard has per-block checksums, the old ones keep theirs.
    with fxprobe.Disk(tmp_path / "app", fsync=False) as _:
        pass
    shutil.copytree(DATA, tmp_path / "app", dirs_exist_ok=True)
    with fxprobe.Disk(tmp_path / "app", mode="append", fsync=False) as d:
        d.write({k: v for k, v in values(5).items()} | {
            "c": (values(5)["a"][:, 0], {"k": values(5)["b"][0]})})
    both = fxprobe.open_captures(tmp_path / "app")
    ref = torch.cat([values(f)["a"].flatten(0, 1) for f in range(6)])
    assert torch.equal(both.rows("a", np.arange(len(ref))[::-1].copy()), ref.flip(0))


def test_reading_one_site_touches_that_sites_bytes_only(tmp_path: Path) -> None:
    """The checks read only the blocks of the rows read: bytes of the other site are never
    checked (a changed byte there goes unnoticed by a reader of this site)."""
    written = write(tmp_path, 4)
    shard = tmp_path / "shard-000000.safetensors"
    data = bytearray(shard.read_bytes())
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    for key, e in header.items():
        if key.endswith("/g/0"):
            data[8 + n + e["data_offsets"][0]] ^= 0x01
    shard.write_bytes(bytes(data))
    caps = fxprobe.open_captures(tmp_path)
    ref = flat(written, "h", 2)
    assert torch.equal(caps.rows("h", np.arange(len(ref))), ref)
    with pytest.raises(fxprobe.DiskError, match="'0/g/0'"):
        caps.rows("g", [0])
