"""``RowSampler`` across training ranks: every rank gets the same number of batches each
epoch (else DDP waits forever in an all-reduce of the rank with one batch more), padded with
the epoch's first rows or, with ``drop_last``, cut, as ``DistributedSampler`` does."""

from __future__ import annotations

import collections
from pathlib import Path

import pytest
import torch
from test_disk_reader import flat, write
from torch.utils.data import DataLoader, DistributedSampler

import fxprobe


def ranks(rows: int, batch: int, world: int, drop_last: bool, epoch: int = 0
          ) -> list[list[list[int]]]:
    """Each simulated rank's batches of one epoch."""
    out = []
    for r in range(world):
        s = fxprobe.RowSampler(rows, batch, seed=7, drop_last=drop_last, rank=r,
                               world_size=world)
        s.set_epoch(epoch)
        got = list(s)
        assert len(got) == len(s)
        out.append(got)
    return out


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("rows", [1, 2, 5, 10, 11, 64])
def test_every_rank_gets_as_many_batches_and_together_every_row(world: int, rows: int) -> None:
    for batch in (1, 3, 4):
        for epoch in (0, 1):
            per_rank = ranks(rows, batch, world, drop_last=False, epoch=epoch)
            assert len({len(b) for b in per_rank}) == 1  # as many batches on every rank
            seen = collections.Counter(i for b in per_rank for part in b for i in part)
            assert set(seen) == set(range(rows))  # every row, in every epoch
            total = -(-rows // world) * world
            assert sum(seen.values()) == total  # padded, no more
            assert max(seen.values()) == -(-total // rows)  # padded evenly (rows < world)
            # drop_last: full batches only, as many on every rank, no row twice
            cut = ranks(rows, batch, world, drop_last=True, epoch=epoch)
            assert len({len(b) for b in cut}) == 1
            assert all(len(part) == batch for b in cut for part in b)
            rows_cut = [i for b in cut for part in b for i in part]
            assert len(rows_cut) == len(set(rows_cut))


def test_the_split_is_distributed_samplers() -> None:
    """The same rows per rank as ``DistributedSampler`` over the same permutation, in batches."""
    for rows, world, drop_last in ((10, 3, False), (10, 3, True), (7, 2, False), (2, 3, False)):
        for r in range(world):
            ours = fxprobe.RowSampler(rows, 100, seed=5, drop_last=drop_last, rank=r,
                                      world_size=world)
            theirs = DistributedSampler(range(rows), num_replicas=world, rank=r, shuffle=True,
                                        seed=5, drop_last=drop_last)
            assert ours.order().tolist() == list(theirs)


def test_ranks_read_equal_batches_of_a_dataset_and_resume(tmp_path: Path) -> None:
    written = write(tmp_path, 4, 2000)
    ref = flat(written, "h", 2)
    ds = fxprobe.open_captures(tmp_path).dataset("h")
    assert len(ds) == 35  # 12 + 12 + 11 rows: 2 + 2 + 1 batches of 11 without padding
    loaders = [DataLoader(ds, batch_size=None, sampler=fxprobe.RowSampler(
        ds, 11, seed=1, rank=r, world_size=3)) for r in range(3)]
    got = [list(loader) for loader in loaders]
    assert [len(g) for g in got] == [2, 2, 2]
    for r, batches in enumerate(got):
        order = fxprobe.RowSampler(ds, 11, seed=1, rank=r, world_size=3).order()
        assert torch.equal(torch.cat(batches), ref[order])
    # a rank resumed mid-epoch gives the rest of its batches, as many as the others
    s = fxprobe.RowSampler(ds, 4, seed=1, rank=2, world_size=3)
    it = iter(s)
    first = [next(it), next(it)]
    resumed = fxprobe.RowSampler(ds, 4, seed=1, rank=2, world_size=3)
    resumed.load_state_dict(s.state_dict())
    assert first + list(resumed) == list(fxprobe.RowSampler(ds, 4, seed=1, rank=2,
                                                            world_size=3))
