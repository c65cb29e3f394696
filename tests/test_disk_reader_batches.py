"""Every batch of ``ds.loader`` (no threads, one, two) is bitwise the NumPy rows a seeded
epoch draws, across epochs, shards and the several row grids one shard holds; ``Captures.rows``
writes into a given tensor; a resumed sampler reads the same rows."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from test_disk_reader import flat, write
from torch.utils.data import DataLoader

import fxprobe
from fxprobe.sinks.sampler import Batches


def epoch(n: int, batch: int, seed: int) -> list[np.ndarray]:
    """The row numbers of each batch of a seeded shuffled epoch (what ``ds.loader`` draws)."""
    return list(Batches(n, batch, generator=torch.Generator().manual_seed(seed)))


@pytest.mark.parametrize("shard_size", [2000, "256MiB"])
def test_each_batch_is_the_numpy_rows_of_the_epoch(tmp_path: Path, shard_size: object) -> None:
    # "h" (24-byte rows) and "g" (6-byte rows) alternate in each shard, so the pieces of "h"
    # start at offsets of several residues mod 24: rows on several grids of one shard.
    written = write(tmp_path, 9, shard_size)  # type: ignore[arg-type]
    caps = fxprobe.open_captures(tmp_path)
    ref = {n: flat(written, n, 2).view(torch.int16 if n == "g" else torch.int32).numpy()
           for n in ("h", "g")}  # bit patterns: NaN-free, exact equality of bytes
    ds = caps.dataset("h")
    both = caps.dataset(["h", "g"])
    for workers in (0, 1, 2, 0):  # threads, then no threads again on the same dataset
        for seed in (0, 1):  # two epochs of other permutations
            order = epoch(len(ds), 16, seed)
            got = list(ds.loader(16, generator=torch.Generator().manual_seed(seed),
                                 num_workers=workers))
            assert len(got) == len(order)
            for idx, b in zip(order, got, strict=True):
                assert b.dtype == torch.float32 and b.is_contiguous()
                assert np.array_equal(b.view(torch.int32).numpy(), ref["h"][idx])
            for idx, b in zip(order, both.loader(16, generator=torch.Generator()
                                                  .manual_seed(seed), num_workers=workers),
                              strict=True):
                assert np.array_equal(b["g"].view(torch.int16).numpy(), ref["g"][idx])
                assert np.array_equal(b["h"].view(torch.int32).numpy(), ref["h"][idx])


def test_threads_hand_out_new_tensors_and_scale_them_as_without_threads(
        tmp_path: Path) -> None:
    written = write(tmp_path, 6, 3000)
    ref = flat(written, "h", 2)
    ds = fxprobe.open_captures(tmp_path).dataset("h", normalize=2.5)
    for workers in (1, 2):
        held = list(ds.loader(7, shuffle=False, num_workers=workers))  # all held at once
        assert len({b.data_ptr() for b in held}) == len(held)  # no buffer handed out twice
        assert torch.equal(torch.cat(held), ref * 2.5)
        alone = list(ds.loader(7, generator=torch.Generator().manual_seed(3)))
        threads = ds.loader(7, generator=torch.Generator().manual_seed(3), num_workers=workers)
        assert all(torch.equal(a, b) for a, b in zip(alone, threads, strict=True))
    torch.testing.assert_close(ds.denormalize(ds[[4, 1]]), ref[[4, 1]])


def test_a_loop_left_early_then_the_next_epoch_reads_every_row(tmp_path: Path) -> None:
    written = write(tmp_path, 6, 2000)
    ref = flat(written, "h", 2)
    ds = fxprobe.open_captures(tmp_path).dataset("h")
    loader = ds.loader(5, generator=torch.Generator().manual_seed(0), num_workers=2,
                       prefetch_factor=3)
    for i, _ in enumerate(loader):
        if i == 1:
            break
    again = list(loader)  # the generator goes on: the next permutation, all of it
    assert len(again) == len(loader)
    key = sorted(map(tuple, torch.cat(again).tolist()))
    assert key == sorted(map(tuple, ref.tolist()))


def test_rows_write_into_a_given_tensor_or_say_what_it_must_be(tmp_path: Path) -> None:
    written = write(tmp_path, 5, 2000)
    caps = fxprobe.open_captures(tmp_path)
    ref = flat(written, "g", 2)
    idx = np.random.default_rng(0).permutation(len(ref))[:11]  # several shards, any order
    out = torch.full((11, 3), 7.0, dtype=torch.bfloat16)
    assert caps.rows("g", idx, out=out) is out
    assert torch.equal(out, ref[idx])
    assert torch.equal(caps.rows("g", idx[:3], out=torch.empty(3, 3, dtype=torch.bfloat16)),
                       ref[idx[:3]])  # a second call, another size
    for bad, why in ((torch.empty(11, 3), "float32"), (torch.empty(10, 3, dtype=torch.bfloat16),
                                                       r"\(10, 3\)"),
                     (torch.empty(3, 11, dtype=torch.bfloat16).t(), "not contiguous"),
                     (np.empty((11, 3)), "ndarray")):
        with pytest.raises(fxprobe.ConfigError, match=rf"rows\('g', out=.*\(11, 3\).*{why}"):
            caps.rows("g", idx, out=bad)


def test_a_corrupted_block_is_raised_by_the_threaded_loader(tmp_path: Path) -> None:
    write(tmp_path, 3)
    shard = tmp_path / "shard-000000.safetensors"
    data = bytearray(shard.read_bytes())
    n = int.from_bytes(data[:8], "little")
    begin, _ = json.loads(data[8:8 + n])["1/h/0"]["data_offsets"]
    data[8 + n + begin + 4] ^= 0x10
    shard.write_bytes(bytes(data))
    ds = fxprobe.open_captures(tmp_path).dataset("h")
    with pytest.raises(fxprobe.DiskError, match=r"shard-000000.*'1/h/0'.*checksum"):
        list(ds.loader(4, num_workers=2))


def test_a_resumed_sampler_reads_the_numpy_rows_of_the_rest_of_the_epoch(
        tmp_path: Path) -> None:
    written = write(tmp_path, 8, 2000)
    ref = flat(written, "h", 2).view(torch.int32).numpy()
    ds = fxprobe.open_captures(tmp_path).dataset("h")
    sampler = fxprobe.RowSampler(ds, 6, seed=5)
    it = iter(DataLoader(ds, batch_size=None, sampler=sampler))
    seen = [next(it) for _ in range(2)]
    state = sampler.state_dict()
    resumed = fxprobe.RowSampler(ds, 6, seed=5)
    resumed.load_state_dict(state)
    rest = list(DataLoader(ds, batch_size=None, sampler=resumed))
    order = fxprobe.RowSampler(ds, 6, seed=5).order().numpy()
    got = torch.cat([*seen, *rest]).view(torch.int32).numpy()
    assert np.array_equal(got, ref[order])  # the epoch's rows, in the sampler's order


def test_one_site_over_several_shards_reads_each_shards_rows_at_once(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(1)
    values = [torch.randn(2, 4, 6, generator=g) for _ in range(7)]
    with fxprobe.Disk(tmp_path, shard_size=500, fsync=False) as d:
        for v in values:
            d.write({"h": v})
    caps = fxprobe.open_captures(tmp_path)
    table = caps._table("h", 2)
    assert len(set(table.shard.tolist())) > 2 and (np.diff(table.grid) >= 0).all()
    ref = torch.cat([v.flatten(0, 1) for v in values]).view(torch.int32).numpy()
    ds = caps.dataset("h")
    for workers in (0, 2):
        for idx, b in zip(epoch(len(ds), 9, 4), ds.loader(
                9, generator=torch.Generator().manual_seed(4), num_workers=workers),
                strict=True):
            assert np.array_equal(b.view(torch.int32).numpy(), ref[idx])


def test_reused_batch_tensors_are_never_written_while_anything_holds_them(
        tmp_path: Path) -> None:
    written = write(tmp_path, 9, 2000)
    ref = flat(written, "h", 2).view(torch.int32).numpy()
    ds = fxprobe.open_captures(tmp_path).dataset("h")
    loader = ds.loader(4, generator=torch.Generator().manual_seed(2), num_workers=2,
                       prefetch_factor=1)
    kept: list[tuple[object, np.ndarray]] = []
    ptrs = set()
    draws = Batches(len(ds), 4, generator=torch.Generator().manual_seed(2))  # the same epochs
    for _ in range(2):  # two epochs through the same loader (its buffers kept)
        for i, (idx, b) in enumerate(zip(draws, loader, strict=True)):
            assert np.array_equal(b.view(torch.int32).numpy(), ref[idx])
            ptrs.add(b.untyped_storage().data_ptr())
            if i % 4 == 0:  # what a consumer may keep of a batch: a slice, an array, a view
                kept += [(b[1:3], ref[idx][1:3]), (b.numpy()[:1], ref[idx][:1]),
                         (b.view(-1)[5:9], ref[idx].reshape(-1)[5:9])]
            del b
    assert len(ptrs) < 2 * len(loader)  # buffers were reused ...
    for held, want in kept:  # ... but none that something still held
        got = held.view(np.int32) if isinstance(held, np.ndarray) else \
            held.view(torch.int32).numpy()  # type: ignore[attr-defined]
        assert np.array_equal(got, want)


def test_rows_refuse_to_write_into_the_captures_own_memory(tmp_path: Path) -> None:
    written = write(tmp_path, 3)
    caps = fxprobe.open_captures(tmp_path)
    view = caps.forward(1)["h"].flatten(0, 1)[:2]  # a view of the shard's map
    with pytest.raises(fxprobe.ConfigError, match="view of captured memory"):
        caps.rows("h", [0, 1], out=view)
    assert torch.equal(caps.forward(1)["h"], written[1]["h"])  # untouched


def test_threads_check_each_block_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from fxprobe.sinks import rowtable, shardfile, shards

    for module in (shardfile, rowtable, shards):
        monkeypatch.setattr(module, "BLOCK", 64)  # many blocks: each batch needs most
    written = write(tmp_path, 6)
    checked: list[tuple[str, int]] = []
    real = shardfile.ShardReader.check_blocks

    def counting(self: shardfile.ShardReader, key: str, blocks: list[int]) -> None:
        checked.extend((key, b) for b in blocks)
        real(self, key, blocks)

    monkeypatch.setattr(shardfile.ShardReader, "check_blocks", counting)
    ds = fxprobe.open_captures(tmp_path).dataset("h")
    got = torch.cat(list(ds.loader(5, shuffle=False, num_workers=2, prefetch_factor=4)))
    assert torch.equal(got, flat(written, "h", 2))
    assert checked and len(checked) == len(set(checked))  # none twice
