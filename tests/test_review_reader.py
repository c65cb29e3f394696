"""Review of the reader and writer (numpy.take gathers, reused batch tensors, RowSampler's
equal split, ``Disk(queue=0)``): sequences of calls against independent references (the
written tensors, rows parsed from the safetensors files with NumPy, hooks on an untapped
model, ``DistributedSampler``)."""

from __future__ import annotations

import json
import struct
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

import fxprobe
from fxprobe.sinks.sampler import Batches

DT = {torch.float16: np.int16, torch.bfloat16: np.int16, torch.int64: np.int64,
      torch.float32: np.int32}


def bits(t: torch.Tensor) -> np.ndarray:
    """Bit patterns of ``t``: exact comparisons, NaN and bfloat16 included."""
    return t.contiguous().view({torch.float16: torch.int16, torch.bfloat16: torch.int16,
                                torch.float32: torch.int32}.get(t.dtype, t.dtype)).numpy()


def write_mixed(path: Path, forwards: int, shard_size: object = 700, mode: str = "new",
                start: int = 0) -> list[dict[str, torch.Tensor]]:
    """Three sites: float16, bfloat16, int64; "c" missing from every third forward; batch
    dims that vary, so shards hold different row counts."""
    out = []
    with fxprobe.Disk(path, shard_size=shard_size, fsync=False, mode=mode) as d:  # type: ignore[arg-type]
        for f in range(start, start + forwards):
            g = torch.Generator().manual_seed(f)
            b = 1 + f % 3
            v = {"a": torch.randn(b, 3, 4, generator=g).half(),
                 "b": torch.randn(b, 3, 2, generator=g).bfloat16(),
                 "c": torch.randint(-2**40, 2**40, (b, 3, 5), generator=g)}
            if f % 3 == 2:
                del v["c"]
            d.write(v)
            out.append({k: t.clone() for k, t in v.items()})
    return out


def ref_rows(written: list[dict[str, torch.Tensor]], name: str, lead: int = 2) -> np.ndarray:
    return np.concatenate([bits(w[name].flatten(0, lead - 1)) for w in written if name in w])


def numpy_shards(path: Path, name: str, lead: int = 2) -> np.ndarray:
    """The site's rows read straight from the safetensors files with NumPy, in forward order."""
    index = json.loads((path / "index.json").read_text())
    parts = []
    for shard in index["shards"]:
        raw = (path / shard["file"]).read_bytes()
        (hlen,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8:8 + hlen])
        keys = [k for k in header if k != "__metadata__" and k.split("/")[1] == name]
        for k in sorted(keys, key=lambda k: int(k.split("/")[0])):
            e = header[k]
            lo, hi = e["data_offsets"]
            dt = {"F16": np.int16, "BF16": np.int16, "I64": np.int64, "F32": np.int32}[e["dtype"]]
            arr = np.frombuffer(raw[8 + hlen + lo:8 + hlen + hi], dtype=dt).reshape(e["shape"])
            parts.append(arr.reshape(-1, *e["shape"][lead:]))
    return np.concatenate(parts)


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, torch.Tensor]]]:
    path = tmp_path_factory.mktemp("mixed")
    return path, write_mixed(path, 14)


def test_rows_of_three_dtypes_are_the_files_rows_with_a_site_missing_from_some_forwards(
        mixed: tuple[Path, list[dict[str, torch.Tensor]]]) -> None:
    path, written = mixed
    caps = fxprobe.open_captures(path)
    assert len(json.loads((path / "index.json").read_text())["shards"]) > 2
    rng = np.random.default_rng(0)
    for lead in (2, 1):
        for name in ("a", "b", "c"):
            ref = ref_rows(written, name, lead)
            assert np.array_equal(numpy_shards(path, name, lead), ref)
            for idx in (rng.permutation(len(ref)), rng.integers(0, len(ref), 11)[::-1].copy()):
                got = caps.rows(name, idx, lead)
                assert np.array_equal(bits(got), ref[idx])
                out = torch.full_like(got, 7)
                assert caps.rows(name, idx, lead, out=out) is out
                assert np.array_equal(bits(out), ref[idx])


def test_several_sites_per_batch_with_threads_two_loaders_at_once(
        mixed: tuple[Path, list[dict[str, torch.Tensor]]]) -> None:
    path, written = mixed
    caps = fxprobe.open_captures(path)
    both = caps.dataset(["a", "b"])
    alone = caps.dataset("c")
    refs = {n: ref_rows(written, n) for n in "abc"}
    la = both.loader(5, generator=torch.Generator().manual_seed(1), num_workers=2)
    lc = alone.loader(4, generator=torch.Generator().manual_seed(2), num_workers=2,
                      prefetch_factor=1)
    da = Batches(len(both), 5, generator=torch.Generator().manual_seed(1))
    dc = Batches(len(alone), 4, generator=torch.Generator().manual_seed(2))
    for _ in range(2):  # two epochs, the two loaders interleaved
        ia, ic = iter(zip(da, la, strict=True)), iter(zip(dc, lc, strict=True))
        for pair in zip(ia, ic, strict=False):
            (xa, ba), (xc, bc) = pair
            assert np.array_equal(bits(ba["a"]), refs["a"][xa])
            assert np.array_equal(bits(ba["b"]), refs["b"][xa])
            assert np.array_equal(bits(bc), refs["c"][xc])
        for xa, ba in ia:
            assert np.array_equal(bits(ba["b"]), refs["b"][xa])
        for xc, bc in ic:
            assert np.array_equal(bits(bc), refs["c"][xc])


def _keep_every_way(b: torch.Tensor, want: np.ndarray, kept: list, grads: list) -> None:
    """What a training loop may keep of a batch (float rows ``b``, reference bits ``want``)."""
    kept.append((b[1:3], want[1:3]))  # a slice
    kept.append((b.numpy()[:1], want[:1]))  # an array
    kept.append((b.view(-1)[2:5], want.reshape(-1)[2:5]))  # a view
    kept.append(([b][0], want))  # a tensor stored in a list
    kept.append((b.to("cpu"), want))  # .to() that returns the same tensor
    kept.append((torch.utils.dlpack.from_dlpack(torch.utils.dlpack.to_dlpack(b)), want))
    box: list[torch.Tensor] = []
    t = threading.Thread(target=lambda: box.append(b))  # handed to another thread
    t.start()
    t.join()
    kept.append((box[0], want))
    storage = b.untyped_storage()  # only the storage kept
    kept.append((storage, want))
    leaf = b.requires_grad_()  # autograd: the batch itself a leaf
    w = torch.ones(b.shape[-1], dtype=b.dtype, requires_grad=True)
    loss = (leaf * w).sum()  # saves the batch for backward (grad of w)
    grads.append((loss, w, want))


def _as_bits(held: object, dtype: torch.dtype) -> np.ndarray:
    if isinstance(held, np.ndarray):
        return held.view(DT[dtype])
    if isinstance(held, torch.UntypedStorage):
        return held.numpy()
    return bits(held.detach())  # type: ignore[attr-defined]


@pytest.mark.parametrize("workers", [1, 2])
def test_kept_batches_never_change_while_the_loader_goes_on(tmp_path: Path, workers: int
                                                            ) -> None:
    g = torch.Generator().manual_seed(0)
    written = []
    with fxprobe.Disk(tmp_path, shard_size=900, fsync=False) as d:
        for _ in range(12):
            written.append({"h": torch.randn(2, 3, 6, generator=g)})
            d.write(written[-1])
    ref = ref_rows(written, "h")
    ds = fxprobe.open_captures(tmp_path).dataset("h")
    loader = ds.loader(4, generator=torch.Generator().manual_seed(5), num_workers=workers,
                       prefetch_factor=1)
    draws = Batches(len(ds), 4, generator=torch.Generator().manual_seed(5))
    kept: list = []
    grads: list = []
    outs: list = []
    for epoch in range(3):
        for i, (idx, b) in enumerate(zip(draws, loader, strict=True)):
            assert np.array_equal(bits(b), ref[idx])
            if (i + epoch) % 3 == 0:
                _keep_every_way(b, ref[idx], kept, grads)
            elif (i + epoch) % 3 == 1:  # the batch used as the out= of the user's op
                torch.mul(torch.ones_like(b), 3.0, out=b)
                outs.append(b)
            del b
    for held, want in kept:
        if isinstance(held, torch.UntypedStorage):
            assert np.array_equal(held.tolist()[:want.nbytes], want.view(np.uint8).reshape(-1)
                                  .tolist())
        else:
            assert np.array_equal(_as_bits(held, torch.float32), want)
    for loss, w, want in grads:
        loss.backward()
        assert np.array_equal(w.grad.numpy(),  # type: ignore[union-attr]
                              want.view(np.float32).reshape(-1, 6).sum(0, dtype=np.float32))
    for b in outs:
        assert bool((b == 3.0).all())  # the user's values, not rows of a later batch


def test_an_abandoned_epoch_then_a_new_one_and_a_state_dict_mid_epoch(
        mixed: tuple[Path, list[dict[str, torch.Tensor]]]) -> None:
    path, written = mixed
    ref = ref_rows(written, "a")
    ds = fxprobe.open_captures(path).dataset("a")
    loader = ds.loader(3, generator=torch.Generator().manual_seed(9), num_workers=2)
    draws = Batches(len(ds), 3, generator=torch.Generator().manual_seed(9))
    d0, d1 = list(draws), list(draws)  # the loader's generator draws these two epochs
    first = iter(loader)
    held = [next(first) for _ in range(2)]  # left midway, never closed
    seen = [bits(h).copy() for h in held]
    for idx, b in zip(d1, loader, strict=True):  # a whole new epoch meanwhile
        assert np.array_equal(bits(b), ref[idx])
    for h, want, s in zip(held, d0, seen, strict=False):
        assert np.array_equal(bits(h), s)
        assert np.array_equal(bits(h), ref[want])
    del first
    # RowSampler through DataLoader's worker processes is documented as needing torchdata;
    # with num_workers=0 its state is where training stands.
    sampler = fxprobe.RowSampler(ds, 4, seed=3)
    dl = DataLoader(ds, batch_size=None, sampler=sampler)
    it = iter(dl)
    got = [bits(next(it)) for _ in range(3)]
    state = sampler.state_dict()
    rest = [bits(b) for b in it]
    again = fxprobe.RowSampler(ds, 4, seed=3)
    again.load_state_dict(state)
    resumed = [bits(b) for b in DataLoader(ds, batch_size=None, sampler=again)]
    assert len(got) + len(resumed) == len(sampler)
    for a, b in zip(rest, resumed, strict=True):
        assert np.array_equal(a, b)
    order = fxprobe.RowSampler(ds, 4, seed=3).order().numpy()
    assert np.array_equal(np.concatenate(got + resumed), ref[order])


@pytest.mark.parametrize("rows,world,batch,drop", [(10, 3, 2, False), (10, 3, 2, True),
                                                    (7, 4, 3, False), (7, 4, 3, True),
                                                    (2, 3, 1, False), (2, 3, 1, True),
                                                    (11, 2, 4, True)])
def test_row_sampler_matches_distributed_sampler_and_resumes(rows: int, world: int, batch: int,
                                                             drop: bool) -> None:
    counts = set()
    for rank in range(world):
        s = fxprobe.RowSampler(rows, batch, seed=4, rank=rank, world_size=world,
                               drop_last=drop)
        ref = DistributedSampler(list(range(rows)), num_replicas=world, rank=rank,
                                 shuffle=True, seed=4, drop_last=drop)
        for epoch in range(2):
            ref.set_epoch(epoch)
            mine = list(ref)
            want = [mine[i:i + batch] for i in range(0, len(mine), batch)]
            if drop and want and len(want[-1]) < batch:
                want = want[:-1]
            got = list(s)
            assert got == want and len(got) == len(s)
            counts.add(len(got))
        s.set_epoch(1)  # resume after each possible number of batches handed out
        for k in range(len(s) + 1):
            s.set_epoch(1)
            it = iter(s)
            head = [next(it) for _ in range(k)]
            t = fxprobe.RowSampler(rows, batch, seed=4, rank=rank, world_size=world,
                                   drop_last=drop)
            t.load_state_dict(s.state_dict())
            assert head + list(t) == want and t.epoch == 2
    assert len(counts) == 1


def test_a_resumed_sampler_keeps_its_place_through_the_ddp_loops_set_epoch() -> None:
    # The DistributedSampler idiom: set_epoch(epoch) before each epoch, also the first after
    # a resume. It must not start the restored epoch over (torchdata's samplers do not).
    s = fxprobe.RowSampler(23, 4, seed=1, rank=1, world_size=2)
    s.set_epoch(2)
    whole = list(s)
    s.set_epoch(2)
    it = iter(s)
    head = [next(it) for _ in range(2)]
    state = s.state_dict()
    t = fxprobe.RowSampler(23, 4, seed=1, rank=1, world_size=2)
    t.load_state_dict(state)
    seen = []
    for epoch in range(state["epoch"], 4):
        t.set_epoch(epoch)
        seen.append(list(t))
    assert head + seen[0] == whole  # the rest of epoch 2, once
    s.set_epoch(3)
    assert seen[1] == list(s)
    t.set_epoch(3)  # no resume pending: set_epoch starts the epoch from its beginning
    it = iter(t)
    next(it)
    t.set_epoch(3)
    assert list(t) == seen[1]


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.act = nn.ReLU()
        self.calls = 0
        self.fail_at = -1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        y = self.act(self.fc(x))
        if self.calls - 1 == self.fail_at:
            raise RuntimeError("boom")
        return y * 2


@pytest.mark.parametrize("queue", [0, 2])
def test_an_exception_mid_run_then_append_reads_the_hooks_values(tmp_path: Path, queue: int
                                                                  ) -> None:
    torch.manual_seed(0)
    net = Net()
    ref = Net()
    ref.load_state_dict(net.state_dict())
    want: list[torch.Tensor] = []
    ref.act.register_forward_hook(lambda m, i, o: want.append(o.detach().clone()))
    xs = [torch.randn(1 + i % 2, 5, 4, generator=torch.Generator().manual_seed(i))
          for i in range(8)]
    net.fail_at = 3
    with pytest.raises(RuntimeError, match="boom"):
        with fxprobe.tap(net, ops=nn.ReLU, to=fxprobe.Disk(tmp_path, queue=queue,
                                                           fsync=False)) as tapped:
            for x in xs[:5]:
                tapped(x)
    for x in xs[:3]:
        ref(x)
    caps = fxprobe.open_captures(tmp_path)
    (site,) = caps.names
    written = [caps.forward(i)[site].clone() for i in range(len(caps))]
    n = len(written)
    assert n in (3, 4)  # the failed forward's value may or may not be kept, but no other
    for got, w in zip(written[:3], want, strict=True):
        assert torch.equal(got, w)
    net.fail_at = -1
    with fxprobe.tap(net, ops=nn.ReLU, to=fxprobe.Disk(tmp_path, mode="append", queue=queue,
                                                       fsync=False)) as tapped:
        for x in xs[5:]:
            tapped(x)
    for x in xs[5:]:
        ref(x)
    caps = fxprobe.open_captures(tmp_path)
    assert len(caps) == n + 3
    for i, w in zip(range(n, n + 3), want[3:], strict=True):
        assert torch.equal(caps.forward(i)[site], w)
    rows = caps.rows(site, np.arange(caps.row_count(site)))
    assert torch.equal(rows, torch.cat([w.flatten(0, 1) for w in written + want[3:]]))


def test_an_append_while_a_reader_reads(tmp_path: Path) -> None:
    first = write_mixed(tmp_path, 6)
    caps = fxprobe.open_captures(tmp_path)
    ds = caps.dataset("b")
    ref = ref_rows(first, "b")
    loader = ds.loader(4, generator=torch.Generator().manual_seed(1), num_workers=2)
    draws = Batches(len(ds), 4, generator=torch.Generator().manual_seed(1))
    more: list = []
    for i, (idx, b) in enumerate(zip(draws, loader, strict=True)):
        if i == 1:  # another process's Disk appends meanwhile
            more = write_mixed(tmp_path, 5, mode="append", start=6)
        assert np.array_equal(bits(b), ref[idx])
    caps.refresh()
    draws = Batches(len(ds), 4, generator=torch.Generator().manual_seed(1))
    for idx, b in zip(draws, ds.loader(4, generator=torch.Generator().manual_seed(1)),
                      strict=True):  # the old dataset: its rows, still
        assert np.array_equal(bits(b), ref[idx])
    allrows = ref_rows(first + more, "b")
    new = caps.dataset("b")
    assert np.array_equal(bits(new[np.arange(len(new))]), allrows)
    assert np.array_equal(bits(fxprobe.open_captures(tmp_path).rows("b", np.arange(
        len(allrows)))), allrows)


def test_a_write_that_returns_had_every_earlier_forward_journaled_or_raises(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # queue=0 promises: when write(N) returns, forwards < N are journaled. A writer that fails
    # on forward 1 while write(2) waits must make write(2) raise, not return.
    import time

    from fxprobe.sinks import shards

    add = shards.Shard.add
    started = threading.Event()

    def failing(self: object, job: object, layout: object) -> None:
        if getattr(job, "forward", None) == 1:
            started.set()
            time.sleep(0.3)  # write(2) is queued and waiting meanwhile
            raise OSError("disk full")
        add(self, job, layout)  # type: ignore[arg-type]

    monkeypatch.setattr(shards.Shard, "add", failing)
    d = fxprobe.Disk(tmp_path, fsync=False)
    d.write({"h": torch.ones(2, 3)})
    d.write({"h": torch.ones(2, 3)})
    assert started.wait(10)
    with pytest.raises(fxprobe.DiskError, match=r"disk full.*The 1 forwards.*the 1 forward\(s\)"):
        d.write({"h": torch.ones(2, 3)})  # forward 1 lost; this one raised, not handed over
    with pytest.raises(fxprobe.DiskError):
        d.close()
    assert len(fxprobe.open_captures(tmp_path)) == 1


def test_rows_refuse_out_in_any_shard_of_the_captures(tmp_path: Path) -> None:
    written = []
    with fxprobe.Disk(tmp_path, shard_size=200, fsync=False) as d:
        for f in range(4):
            written.append({"h": torch.full((2, 3, 4), float(f))})
            d.write(written[-1])
    caps = fxprobe.open_captures(tmp_path)
    assert len(json.loads((tmp_path / "index.json").read_text())["shards"]) > 1
    other = caps.forward(3)["h"].flatten(0, 1)[:2]  # in the last shard; row 0 in the first
    with pytest.raises(fxprobe.ConfigError, match="view of captured memory"):
        caps.rows("h", [0, 1], out=other)
    again = fxprobe.open_captures(tmp_path)  # another Captures' maps are guarded too
    with pytest.raises(fxprobe.ConfigError, match="view of captured memory"):
        again.rows("h", [0, 1], out=other)
    assert torch.equal(caps.forward(3)["h"], written[3]["h"])
    mine = torch.empty(2, 4)
    assert torch.equal(caps.rows("h", [0, 7], out=mine), torch.tensor([[0.0] * 4, [1.0] * 4]))
