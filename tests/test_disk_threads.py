"""``ds.loader(num_workers=k)``: threads of this process gather the next batches from the
memory maps (no batch crosses a process boundary); the batches are those of one thread, in the
sampler's order, and every row of an epoch comes once."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import pytest
import torch
from test_disk_reader import flat, write

import fxprobe


def test_threads_give_the_batches_one_reader_gives_in_order(tmp_path: Path) -> None:
    written = write(tmp_path, 6, 3000)  # several shards: threads open and check them together
    ds = fxprobe.open_captures(tmp_path).dataset("h")
    ref = flat(written, "h", 2)
    for epoch in range(2):
        alone = list(ds.loader(5, generator=torch.Generator().manual_seed(epoch)))
        threads = ds.loader(5, generator=torch.Generator().manual_seed(epoch), num_workers=3,
                            prefetch_factor=1)
        assert len(threads) == len(alone)
        got = list(threads)
        assert len(got) == len(alone)
        assert all(torch.equal(a, b) for a, b in zip(got, alone, strict=True))
        key = sorted(map(tuple, torch.cat(got).tolist()))
        assert key == sorted(map(tuple, ref.tolist()))  # every row once
    in_order = torch.cat(list(ds.loader(4, shuffle=False, num_workers=2)))
    assert torch.equal(in_order, ref)
    assert not multiprocessing.active_children()  # threads, no worker processes


def test_threads_read_several_sites_and_stop_early(tmp_path: Path) -> None:
    written = write(tmp_path, 4, 2000)
    several = fxprobe.open_captures(tmp_path).dataset(["h", "g"])
    batches = iter(several.loader(7, shuffle=False, num_workers=2))
    first = next(batches)
    assert torch.equal(first["g"], flat(written, "g", 2)[:7])
    assert torch.equal(first["h"], flat(written, "h", 2)[:7])
    del batches  # a loop left early: the pool finishes the batches it started


def test_thread_options_are_checked(tmp_path: Path) -> None:
    write(tmp_path, 2, 2000)
    ds = fxprobe.open_captures(tmp_path).dataset("h")
    with pytest.raises(fxprobe.ConfigError, match="worker_init_fn"):
        ds.loader(4, num_workers=2, worker_init_fn=print)
    with pytest.raises(fxprobe.ConfigError, match="num_workers=-1"):
        ds.loader(4, num_workers=-1)
