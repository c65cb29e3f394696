"""Review of ``ds.loader``'s batch buffers, shared by the loaders of one dataset (threads and
none): sequences of loaders read interleaved, with batches held, sliced, ``.numpy()``'d,
written into and dropped, against the rows written (``test_disk_reader.write``/``flat``). A
buffer is written again only once nothing holds a batch made from it; normalized rows are
scaled once per read; a batch outlives its loader and its dataset.
"""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from test_disk_reader import flat, write

import fxprobe


@pytest.mark.parametrize("workers", [(0, 0), (0, 2), (2, 1)])
def test_interleaved_loaders_of_one_dataset_never_write_a_batch_still_held(
        tmp_path: Path, workers: tuple[int, int]) -> None:
    written = write(tmp_path, 6, 3000)
    ds = fxprobe.open_captures(tmp_path).dataset("h")
    ref = flat(written, "h", 2)
    held: list[tuple[Any, torch.Tensor, torch.Tensor]] = []  # (what was kept, its value, ref)
    for epoch in range(3):
        for size_b in (4, 3):  # the same batch size, then another
            a = ds.loader(4, shuffle=False, num_workers=workers[0])
            b = ds.loader(size_b, shuffle=False, num_workers=workers[1], drop_last=epoch == 1)
            for i, (x, y) in enumerate(zip(a, b, strict=False)):
                assert torch.equal(x, ref[4 * i:4 * i + 4])
                assert torch.equal(y, ref[size_b * i:size_b * i + size_b])
                if i % 3 == 0:
                    held.append((x[1:3], x[1:3].clone(), ref[4 * i + 1:4 * i + 3]))
                elif i % 3 == 1:
                    arr = y.numpy()
                    held.append((arr, torch.from_numpy(arr.copy()),
                                 ref[size_b * i:size_b * i + size_b]))
                else:
                    x.mul_(-7.0)  # written into by the consumer, then dropped
                    y.zero_()
    for kept, value, want in held:
        got = torch.from_numpy(kept) if isinstance(kept, np.ndarray) else kept
        assert torch.equal(got, value) and torch.equal(got, want)
    pairs = [(k, w) for k, _, w in held if isinstance(k, torch.Tensor)]
    assert torch.equal(torch.stack([k for k, _ in pairs]), torch.stack([w for _, w in pairs]))


@pytest.mark.parametrize("workers", [0, 2])
def test_normalized_several_sites_and_stacked_rows_are_scaled_once_per_read(
        tmp_path: Path, workers: int) -> None:
    written = write(tmp_path, 5, 3000)
    caps = fxprobe.open_captures(tmp_path)
    h = flat(written, "h", 2)
    g = flat(written, "g", 2)
    ds = caps.dataset(["h", "g"], normalize={"h": 2.0, "g": 0.5}, positions=slice(1, None))
    want_h = h.reshape(-1, 5, 6)[:, 1:].reshape(-1, 6) * 2.0
    want_g = g.reshape(-1, 5, 3)[:, 1:].reshape(-1, 3) * 0.5
    for _ in range(3):  # buffers reused each epoch: scaled once
        got = list(ds.loader(4, shuffle=False, num_workers=workers))
        assert torch.equal(torch.cat([b["h"] for b in got]), want_h)
        assert torch.equal(torch.cat([b["g"] for b in got]), want_g)
    gen = torch.Generator().manual_seed(2)
    two = [{"a": torch.randn(2, 3, 4, generator=gen), "b": torch.randn(2, 3, 4, generator=gen)}
           for _ in range(3)]
    with fxprobe.Disk(tmp_path / "two", fsync=False) as d:
        for v in two:
            d.write(v)
    stacked = fxprobe.open_captures(tmp_path / "two").dataset(["a", "b"], layout="stack",
                                                               normalize={"a": 3.0, "b": 0.25})
    want = torch.stack([flat(two, "a", 2) * 3.0, flat(two, "b", 2) * 0.25], dim=1)
    for _ in range(3):
        got = torch.cat(list(stacked.loader(5, shuffle=False, num_workers=workers)))
        assert torch.equal(got, want)


def test_a_batch_outlives_its_loader_and_its_dataset(tmp_path: Path, young_gc: None) -> None:
    written = write(tmp_path, 4, 3000)
    ref = flat(written, "h", 2)
    ds = fxprobe.open_captures(tmp_path).dataset("h")
    first = next(iter(ds.loader(5, shuffle=False)))
    threaded = next(iter(ds.loader(5, shuffle=False, num_workers=2)))
    del ds
    gc.collect()
    other = fxprobe.open_captures(tmp_path).dataset("h")  # new buffers, maybe the same memory
    for _ in range(2):
        for b in other.loader(5, shuffle=False, num_workers=1):
            b.fill_(-1.0)
    assert torch.equal(first, ref[:5]) and torch.equal(threaded, ref[:5])


def test_two_datasets_of_one_directory_and_forwards_appended_between_epochs(
        tmp_path: Path) -> None:
    written = write(tmp_path, 3, 3000)
    caps = fxprobe.open_captures(tmp_path)
    old = caps.dataset("h")
    twin = fxprobe.open_captures(tmp_path).dataset("h")
    g = torch.Generator().manual_seed(1)
    more = [{"h": torch.randn(2, 5, 6, generator=g),
             "g": torch.randn(2, 5, 3, generator=g).to(torch.bfloat16)} for _ in range(2)]
    with fxprobe.Disk(tmp_path, mode="append", fsync=False) as d:
        for v in more:
            d.write(v)
    caps.refresh()
    new = caps.dataset("h")
    ref_old, ref_new = flat(written, "h", 2), flat(written + more, "h", 2)
    for _ in range(2):
        held = list(zip(old.loader(4, shuffle=False), twin.loader(4, shuffle=False),
                        new.loader(4, shuffle=False, num_workers=2), strict=False))
        got = [torch.cat([x.clone() for x in d.loader(4, shuffle=False, num_workers=w)])
               for d, w in ((old, 0), (twin, 2), (new, 0))]
        assert torch.equal(got[0], ref_old) and torch.equal(got[1], ref_old)
        assert torch.equal(got[2], ref_new)
        for i, (x, y, z) in enumerate(held):  # held while the later loaders read
            assert torch.equal(x, ref_old[4 * i:4 * i + 4]) and torch.equal(x, y)
            assert torch.equal(z, ref_new[4 * i:4 * i + 4])


def test_a_dataloader_with_worker_processes_over_a_dataset_with_buffers(
        tmp_path: Path) -> None:
    from torch.utils.data import BatchSampler, DataLoader, SequentialSampler

    written = write(tmp_path, 4, 3000)
    ref = flat(written, "h", 2)
    ds = fxprobe.open_captures(tmp_path).dataset("h")
    kept = [b for b in ds.loader(4, shuffle=False)]  # buffers in the map, batches held
    sampler = BatchSampler(SequentialSampler(range(len(ds))), 4, drop_last=False)
    got = torch.cat(list(DataLoader(ds, batch_size=None, sampler=sampler, num_workers=2)))
    assert torch.equal(got, ref) and torch.equal(torch.cat(kept), ref)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_interleavings_of_loaders_with_batches_held_dropped_and_written(
        tmp_path: Path, seed: int) -> None:
    written = write(tmp_path, 6, 3000)
    ref = flat(written, "h", 2)
    ds = fxprobe.open_captures(tmp_path).dataset("h")
    rng = np.random.default_rng(seed)
    held: list[tuple[torch.Tensor, torch.Tensor]] = []
    live: list[Any] = []  # open iterators: (iterator, batch size, batches taken)
    for _ in range(300):
        if len(live) < 3 and rng.random() < 0.3:
            size, workers = int(rng.choice([3, 4, 7])), int(rng.choice([0, 1, 2]))
            live.append([iter(ds.loader(size, shuffle=False, num_workers=workers)), size, 0])
        if not live:
            continue
        slot = live[int(rng.integers(len(live)))]
        batch = next(slot[0], None)
        if batch is None:
            live.remove(slot)
            continue
        size, i = slot[1], slot[2]
        slot[2] += 1
        assert torch.equal(batch, ref[size * i:size * (i + 1)])
        what = rng.random()
        if what < 0.3:
            held.append((batch, ref[size * i:size * (i + 1)]))
        elif what < 0.5:
            batch.fill_(float("nan"))
        if held and rng.random() < 0.2:
            held.pop(int(rng.integers(len(held))))
    assert held
    for batch, want in held:
        assert torch.equal(batch, want)


@pytest.mark.parametrize("workers", [0, 2])
def test_pin_memory_reads_the_rows_with_or_without_an_accelerator(tmp_path: Path,
                                                                  workers: int) -> None:
    written = write(tmp_path, 3, 3000)
    ds = fxprobe.open_captures(tmp_path).dataset("h")
    if torch.accelerator.is_available():
        got = list(ds.loader(4, shuffle=False, num_workers=workers, pin_memory=True))
        assert all(b.is_pinned() for b in got)
    else:  # DataLoader's way: a warning, batches not pinned (threads raised before)
        with pytest.warns(UserWarning, match="pin"):
            got = list(ds.loader(4, shuffle=False, num_workers=workers, pin_memory=True))
    assert torch.equal(torch.cat(got), flat(written, "h", 2))
