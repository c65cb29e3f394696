"""The loaders of one dataset (``ds.loader``, with threads or without) share their batch
buffers (a loader made anew each epoch reuses the last one's pages): a buffer is written again
only once nothing holds a batch made from it, whichever loader made it, and the buffers go
with the dataset."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import pytest
import torch
from test_disk_reader import flat, write

import fxprobe
from fxprobe.sinks import sampler


@pytest.mark.parametrize("workers", [0, 2])
def test_batches_kept_from_one_loader_survive_the_next_loaders(tmp_path: Path, workers: int
                                                               ) -> None:
    written = write(tmp_path, 6, 3000)
    ds = fxprobe.open_captures(tmp_path).dataset("h")
    ref = flat(written, "h", 2)
    kept: list[tuple[torch.Tensor, torch.Tensor]] = []  # (batch, its rows read alone)
    for epoch in range(3):  # a new loader per epoch, as training loops make them
        extra = {"prefetch_factor": 1} if workers else {}
        loader = ds.loader(4, generator=torch.Generator().manual_seed(epoch),
                           num_workers=workers, **extra)
        for i, batch in enumerate(loader):
            if i % 2 == 0:  # every other batch held past its loader
                kept.append((batch, batch.clone()))
            else:
                batch.add_(1000.0)  # a consumer that writes into a batch it dropped later
        assert len(sampler._SHARED[ds]) == 1  # one set of buffers for batch size 4
    for batch, seen in kept:
        assert torch.equal(batch, seen)
        assert all(any(torch.equal(r, row) for row in ref) for r in batch)
    alone = [b.clone() for b in ds.loader(4, shuffle=False, num_workers=workers)]
    assert torch.equal(torch.cat(alone), ref)  # buffers written since: the rows, not the +1000


def test_buffers_go_with_their_dataset(tmp_path: Path, young_gc: None) -> None:
    write(tmp_path, 3, 3000)
    ds = fxprobe.open_captures(tmp_path).dataset("h")
    for _ in ds.loader(4):
        pass
    for _ in ds.loader(4, num_workers=1):
        pass
    buffers = sampler._SHARED[ds][4]
    assert buffers.sets  # pages were kept for the next loader
    gone = weakref.ref(ds)
    del ds
    gc.collect()
    assert gone() is None
    assert all(key is not None for key in sampler._SHARED.keys())
    assert buffers not in [b for per in sampler._SHARED.values() for b in per.values()]
