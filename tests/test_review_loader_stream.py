"""Review of ``ActivationStream``'s checked resume, as sequences of calls against an
independent reference: a model that hands its input back, so the rows of each input are known
(``ds.loader``'s shared buffers: ``test_review_loader_buffers.py``).

A resumed epoch must run each input exactly once, or refuse. The checksum of the skipped
inputs must tell apart inputs that hold the same values in other places (one-hot or permuted
inputs), inputs inside mappings that are not dicts (a tokenizer's ``BatchEncoding``), and must
never raise on an input the model takes (conjugate, sparse, negative-bit views); inputs with a
``state_dict`` that is not a place (a map-style dataset, accelerate's non-stateful loader) are
skipped and checked; a state saved right after loading one, and ``set_epoch`` of the restored
epoch, keep the place.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
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
    big = np.arange(6, dtype=">f4")  # not the machine's byte order: torch.from_numpy refuses
    assert tags({"a": big}) == tags({"a": big.astype("<f4")}) != tags({"a": big[::-1]})
    assert tags(np.array(["x", None, 2], dtype=object)) != tags(np.array(["y", None, 2],
                                                                         dtype=object))


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


def test_a_hugging_face_iterable_dataset_resumes_itself() -> None:
    datasets = pytest.importorskip("datasets", reason="datasets is not installed")
    inputs = tagged_inputs(12)
    table = {"x": [x[0].tolist() for x in inputs]}

    def hf() -> Any:
        return datasets.Dataset.from_dict(table).to_iterable_dataset().with_format("torch")

    def keyed() -> ActivationStream:
        return ActivationStream(fxprobe.tap(Unbatched(), ops="mul"), "mul", hf(), **KW)

    s = keyed()
    it = iter(s)
    head = [next(it), next(it)]
    state = s.state_dict()
    assert state["inputs"] is not None  # its own place, not a skip
    resumed = keyed()
    resumed.load_state_dict(state)
    assert as_sorted(torch.cat(head + list(resumed))) == every_row(inputs)


class Unbatched(nn.Module):
    """Takes one [2, 3] row of a dataset (a batch of one)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[None] * 1
