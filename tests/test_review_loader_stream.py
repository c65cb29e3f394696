"""Review of ``ds.loader``'s shared batch buffers and ``ActivationStream``'s checked resume, as
sequences of calls against independent references (the rows written, read back with
``caps.rows`` or a fresh copy; a model that hands its input back, so the rows of each input are
known).

Stream: a resumed epoch must run each input exactly once, or refuse. The checksum of the
skipped inputs must tell apart inputs that hold the same values in other places (one-hot or
permuted inputs), inputs inside mappings that are not dicts (a tokenizer's ``BatchEncoding``),
and must never raise on an input the model takes (conjugate, sparse, negative-bit views).
"""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from test_disk_reader import flat, write
from test_sae_stream import Tag, as_sorted
from torch import nn

import fxprobe
from fxprobe.runtime.stream import ActivationStream
from fxprobe.runtime.trail import InputTrail

KW: dict[str, Any] = dict(batch_size=5, buffer=2, seed=3)


def stream(inputs: Any, model: nn.Module | None = None) -> ActivationStream:
    return ActivationStream(fxprobe.tap(model or Tag(), ops="mul"), "mul", inputs, **KW)


def saved_after(inputs: Any, k: int) -> tuple[list[torch.Tensor], dict[str, Any]]:
    s = stream(inputs)
    it = iter(s)
    head = [next(it) for _ in range(k)]
    return head, s.state_dict()


def swapped(inputs: list[Any], consumed: int) -> list[Any]:
    """The same inputs with the first ``consumed`` exchanged for the next ``consumed``: a
    resumed epoch skipping them would run the first ones twice and the next ones never."""
    assert 2 * consumed <= len(inputs)
    c = consumed
    return inputs[c:2 * c] + inputs[:c] + inputs[2 * c:]


# -- the checksum of the skipped inputs ----------------------------------------------------

def one_hot(n: int) -> list[torch.Tensor]:
    """Inputs [1, 2, n] with a single 1 each, at the input's own place: every input holds the
    same values (one 1, zeros) in another place."""
    out = []
    for f in range(n):
        x = torch.zeros(1, 2, n)
        x[0, 0, f] = 1.0
        out.append(x)
    return out


def test_inputs_with_the_same_values_in_other_places_are_refused() -> None:
    inputs = one_hot(12)
    head, state = saved_after(inputs, 1)
    consumed = state["progress"]["consumed"]
    resumed = stream(swapped(inputs, consumed))
    resumed.load_state_dict(state)
    with pytest.raises(fxprobe.ConfigError, match="not the ones the saved stream ran"):
        list(resumed)
    again = stream([x.clone() for x in inputs])  # equal values, other objects: resumes
    again.load_state_dict(state)
    rows = torch.cat(head + list(again))
    assert as_sorted(rows) == as_sorted(torch.cat([x.flatten(0, 1) for x in inputs]))


class Keywords(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 1


def test_inputs_in_a_batch_encoding_differing_past_what_repr_shows_are_refused() -> None:
    from transformers import BatchEncoding

    def enc(f: int) -> Any:
        x = torch.zeros(1, 2, 1200)  # more than repr prints: the middle is "..."
        x[0, :, 600] = float(f)
        return BatchEncoding({"x": x})

    inputs = [enc(f) for f in range(12)]
    s = ActivationStream(fxprobe.tap(Keywords(), ops="mul"), "mul", inputs, **KW)
    it = iter(s)
    head = [next(it)]
    state = s.state_dict()
    consumed = state["progress"]["consumed"]
    resumed = ActivationStream(fxprobe.tap(Keywords(), ops="mul"), "mul",
                               swapped(inputs, consumed), **KW)
    resumed.load_state_dict(state)
    with pytest.raises(fxprobe.ConfigError, match="not the ones the saved stream ran"):
        list(resumed)
    same = ActivationStream(fxprobe.tap(Keywords(), ops="mul"), "mul",
                            [enc(f) for f in range(12)], **KW)
    same.load_state_dict(state)
    rows = torch.cat(head + list(same))
    assert sorted(rows[:, 600].tolist()) == sorted([float(f) for f in range(12)] * 2)


class WithExtra(nn.Module):
    """Hands back ``x``; ``extra`` (any tensor) is taken and not used."""

    def forward(self, x: torch.Tensor, extra: Any) -> torch.Tensor:
        return x * 1


def odd(f: int) -> dict[str, torch.Tensor]:
    c = torch.tensor([1 + 2j, float(f) - 1j], dtype=torch.complex64)
    return {"conj": c.conj(), "neg": torch.tensor([float(f), 2.0])._neg_view(),
            "sparse": torch.tensor([[0.0, float(f)], [3.0, 0.0]]).to_sparse(),
            "t": torch.arange(6.0).reshape(2, 3).t() + f, "zero_d": torch.tensor(f),
            "empty": torch.empty(0, 3), "bf16": torch.tensor([f / 3], dtype=torch.bfloat16),
            "bool": torch.tensor([f % 2 == 0])}


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_the_checksum_never_raises_and_tells_odd_tensors_apart() -> None:
    def tags(item: Any) -> list[int]:
        t = InputTrail()
        t.add(item)
        return t.state()

    for key in odd(0):
        a, b = tags({key: odd(1)[key]}), tags({key: odd(2)[key]})
        assert a == tags({key: odd(1)[key].clone()}), key
        if key not in ("empty",):
            assert a != b, key
    nested = torch.nested.nested_tensor([torch.ones(2), torch.zeros(3)])
    assert tags([nested, None, "s", {"k": [1, [2, (3,)]]}]) == \
        tags([torch.nested.nested_tensor([torch.ones(2), torch.zeros(3)]), None, "s",
              {"k": [1, [2, (3,)]]}])
    assert tags([1, [2, 3]]) != tags([1, [2, 4]])


def test_a_stream_over_odd_inputs_runs_and_resumes() -> None:
    inputs = [{"x": torch.full((1, 2, 3), float(f)), "extra": odd(f)} for f in range(10)]
    whole = torch.cat(list(stream(inputs, WithExtra())))
    assert sorted(whole[:, 0].tolist()) == sorted([float(f) for f in range(10)] * 2)
    s = stream(inputs, WithExtra())
    it = iter(s)
    head = [next(it)]
    state = s.state_dict()
    resumed = stream([{"x": torch.full((1, 2, 3), float(f)), "extra": odd(f)}
                      for f in range(10)], WithExtra())
    resumed.load_state_dict(state)
    rows = torch.cat(head + list(resumed))
    assert as_sorted(rows) == as_sorted(whole)


class Note:
    """An input part fxprobe cannot compare by value (default repr: its address)."""

    def __init__(self, text: str) -> None:
        self.text = text


def test_inputs_with_objects_that_cannot_be_compared_are_refused_by_name() -> None:
    def inputs(order: list[int]) -> list[Any]:
        return [{"x": torch.full((1, 2, 3), float(f)), "extra": Note(str(f))} for f in order]

    s = stream(inputs(list(range(10))), WithExtra())
    it = iter(s)
    next(it)
    state = s.state_dict()
    resumed = stream(inputs(list(range(10))), WithExtra())
    resumed.load_state_dict(state)
    with pytest.raises(fxprobe.ConfigError, match="hold Note objects.*cannot compare"):
        list(resumed)


# -- what a resumed stream restores -------------------------------------------------------

def tagged_inputs(n: int) -> list[torch.Tensor]:
    """Inputs [1, 2, 3]: every row holds its input's number first."""
    out = []
    for f in range(n):
        x = torch.zeros(1, 2, 3)
        x[..., 0] = float(f)
        x[0, :, 1] = torch.arange(2.0)
        out.append(x)
    return out


def every_row(inputs: list[torch.Tensor]) -> list[tuple[float, ...]]:
    return as_sorted(torch.cat([x.flatten(0, 1) for x in inputs]))


def test_a_capture_dataset_as_inputs_is_skipped_not_taken_for_a_stateful_loader(
        tmp_path: Path) -> None:
    # A CaptureDataset has a state_dict()/load_state_dict() (its sites and factors), not a
    # place in an iteration: the resumed epoch must skip the inputs the saved one ran.
    inputs = tagged_inputs(10)
    with fxprobe.Disk(tmp_path, fsync=False) as d:
        for x in inputs:
            d.write({"x": x[None]})  # [1, 1, 2, 3]: one sample row per forward, [1, 2, 3]
    ds = fxprobe.open_captures(tmp_path).dataset("x", rows="samples")
    assert torch.equal(ds[3], inputs[3])
    head, state = saved_after(ds, 2)
    resumed = stream(fxprobe.open_captures(tmp_path).dataset("x", rows="samples"))
    resumed.load_state_dict(state)
    assert as_sorted(torch.cat(head + list(resumed))) == every_row(inputs)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_a_state_saved_right_after_loading_one_is_that_state(k: int) -> None:
    # A checkpoint written before the resumed stream hands out its first batch.
    inputs = tagged_inputs(12)
    head, state = saved_after(inputs, k)
    resumed = stream(inputs)
    resumed.load_state_dict(state)
    again = resumed.state_dict()
    third = stream(inputs)
    third.load_state_dict(again)
    assert as_sorted(torch.cat(head + list(third))) == every_row(inputs)
    assert as_sorted(torch.cat(head + list(resumed))) == every_row(inputs)


def test_set_epoch_of_the_restored_epoch_keeps_the_place() -> None:
    # The DistributedSampler loop: set_epoch(epoch) before each epoch, the resumed one too.
    inputs = tagged_inputs(12)
    s = stream(inputs)
    list(s)  # epoch 0
    s.set_epoch(1)
    it = iter(s)
    head = [next(it), next(it)]
    state = s.state_dict()
    resumed = stream(inputs)
    resumed.load_state_dict(state)
    resumed.set_epoch(1)
    assert as_sorted(torch.cat(head + list(resumed))) == every_row(inputs)
    resumed.set_epoch(2)
    assert as_sorted(torch.cat(list(resumed))) == every_row(inputs)
    fresh = stream(inputs)
    fresh.load_state_dict(state)
    fresh.set_epoch(2)  # another epoch: from its beginning
    assert as_sorted(torch.cat(list(fresh))) == every_row(inputs)


class Pair(nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return x * 1


def test_tuple_and_dict_items_resume_and_one_item_differing_deep_in_the_skip_is_refused(
        tmp_path: Path) -> None:
    base = tagged_inputs(12)
    kinds = {"tuple": [(x, torch.tensor([f], dtype=torch.bfloat16)) for f, x in enumerate(base)],
             "list": [[x, torch.tensor([f % 2 == 0])] for f, x in enumerate(base)],
             "dict": [{"x": x, "y": torch.tensor([f], dtype=torch.int32)}
                      for f, x in enumerate(base)]}
    for kind, inputs in kinds.items():
        s = stream(inputs, Pair())
        it = iter(s)
        head = [next(it), next(it)]
        s.state_dict()  # saved twice in one epoch: the second is the one used
        torch.save(s.state_dict(), tmp_path / "state.pt")
        state = torch.load(tmp_path / "state.pt", weights_only=False)
        consumed = state["progress"]["consumed"]
        assert consumed >= 2, kind
        resumed = stream([type(i)(i) if kind != "dict" else dict(i) for i in inputs], Pair())
        resumed.load_state_dict(state)
        assert as_sorted(torch.cat(head + list(resumed))) == every_row(base), kind
        for where in (0, consumed - 1):  # one item differing in one element, in the skip
            other = [dict(i) if kind == "dict" else type(i)(i) for i in inputs]
            second = other[where][1 if kind != "dict" else "y"]
            changed = ~second if second.dtype == torch.bool else second + 1
            if kind == "dict":
                other[where]["y"] = changed
            elif kind == "tuple":
                other[where] = (other[where][0], changed)
            else:
                other[where][1] = changed
            refused = stream(other, Pair())
            refused.load_state_dict(state)
            with pytest.raises(fxprobe.ConfigError, match="not the ones"):
                list(refused)


def test_a_stateful_loader_with_workers_resumes_mid_epoch_after_an_epoch_and_at_its_end(
        ) -> None:
    stateful = pytest.importorskip("torchdata.stateful_dataloader",
                                   reason="torchdata is not installed")
    data = torch.stack(tagged_inputs(12))[:, 0]  # [12, 2, 3]: loader batches of 1

    def loader() -> Any:
        return stateful.StatefulDataLoader(data, batch_size=1, shuffle=True, num_workers=2,
                                           generator=torch.Generator().manual_seed(5))

    def epochs(s: ActivationStream, n: int) -> list[list[tuple[float, ...]]]:
        return [as_sorted(torch.cat(list(s))) for _ in range(n)]

    ref = stream(loader())
    whole = [torch.cat(list(ref)) for _ in range(2)]
    every = as_sorted(data.flatten(0, 1))
    assert all(as_sorted(w) == every for w in whole)
    s = stream(loader())
    list(s)  # epoch 0
    it = iter(s)  # epoch 1, the loader's second permutation
    head = [next(it), next(it)]
    state = s.state_dict()
    resumed = stream(loader())
    resumed.load_state_dict(state)
    rest = list(resumed)
    assert as_sorted(torch.cat(head + rest)) == every
    assert torch.equal(torch.cat(head + rest), whole[1])  # exactly the uninterrupted epoch
    assert epochs(resumed, 1) == [every]
    batches = len(whole[0]) // KW["batch_size"] + bool(len(whole[0]) % KW["batch_size"])
    end2 = stream(loader())  # saved after the epoch's last batch
    it2 = iter(end2)
    for _ in range(batches):
        next(it2)
    state = end2.state_dict()
    after = stream(loader())
    after.load_state_dict(state)
    assert list(after) == []  # that epoch ends with no batch
    assert epochs(after, 1) == [every]


# -- ds.loader: batch buffers shared by the loaders of one dataset ----------------------------

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


def test_a_batch_outlives_its_loader_and_its_dataset(tmp_path: Path) -> None:
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


def test_a_resumed_stream_saved_and_resumed_again_and_a_seeded_loaders_second_epoch(
        ) -> None:
    from torch.utils.data import DataLoader

    inputs = tagged_inputs(14)
    head, state = saved_after(inputs, 1)
    first = stream(inputs)
    first.load_state_dict(state)
    it = iter(first)
    head += [next(it), next(it)]
    second = stream([x.clone() for x in inputs])
    second.load_state_dict(first.state_dict())
    assert as_sorted(torch.cat(head + list(second))) == every_row(inputs)
    data = torch.stack(inputs)[:, 0]

    def loader() -> Any:
        return DataLoader(data, batch_size=1, shuffle=True,
                          generator=torch.Generator().manual_seed(11))

    s = stream(loader())
    list(s)  # epoch 0: the generator's first permutation
    it = iter(s)
    next(it)
    state = s.state_dict()  # epoch 1: its second
    fresh = stream(loader())  # a new process: its first permutation again
    fresh.load_state_dict(state)
    with pytest.raises(fxprobe.ConfigError, match="not the ones"):
        list(fresh)


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


def test_an_accelerate_prepared_dataloader_saves_and_resumes() -> None:
    # accelerate's DataLoaderShard has state_dict()/load_state_dict() methods, which raise
    # unless it wraps a StatefulDataLoader: the stream skips and checks its inputs instead.
    shard = pytest.importorskip("accelerate.data_loader", reason="accelerate is not installed")
    inputs = tagged_inputs(12)
    data = torch.stack(inputs)[:, 0]
    s = stream(shard.DataLoaderShard(data, batch_size=1))
    it = iter(s)
    head = [next(it), next(it)]
    state = s.state_dict()
    assert state["inputs"] is None
    resumed = stream(shard.DataLoaderShard(data, batch_size=1))
    resumed.load_state_dict(state)
    assert as_sorted(torch.cat(head + list(resumed))) == every_row(inputs)
