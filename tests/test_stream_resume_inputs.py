"""A resumed ``ActivationStream`` epoch runs each input once, whatever order its inputs come in.

The stream resumes an epoch by iterating its inputs again and skipping those the saved epoch
ran. Inputs shuffled anew each iteration (``DataLoader(shuffle=True)``) would make the skipped
inputs other ones: some rows twice in the epoch, others never. The stream checks the inputs it
skips against a checksum the state keeps and refuses a mismatch; inputs that save their own
place (torchdata's ``StatefulDataLoader``) are restored to it instead, and the resumed epoch
is then exactly the uninterrupted one. The reference: the rows of every input, as the inputs
themselves hold them (the model hands its input back).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_sae_stream import Tag, as_sorted
from torch.utils.data import DataLoader

import fxprobe
from fxprobe.runtime.stream import ActivationStream

KW: dict[str, Any] = dict(batch_size=5, buffer=2, seed=3)


def tagged(n: int) -> torch.Tensor:
    """``n`` inputs of [2, 3, 4] (batched by a loader of batch size 1 to [1, 2, 3, 4]): every
    row holds its input's number first."""
    x = torch.zeros(n, 2, 3, 4)
    x[..., 0] = torch.arange(n, dtype=torch.float32)[:, None, None]
    x[..., 1] = torch.arange(2, dtype=torch.float32)[:, None]
    x[..., 2] = torch.arange(3, dtype=torch.float32)
    return x


def stream(inputs: Any) -> ActivationStream:
    return ActivationStream(fxprobe.tap(Tag(), ops="mul"), "mul", inputs, **KW)


def halves(inputs: Any, resumed_inputs: Any, k: int) -> tuple[list[torch.Tensor], Any]:
    s = stream(inputs)
    it = iter(s)
    head = [next(it) for _ in range(k)]
    state = s.state_dict()
    resumed = stream(resumed_inputs)
    resumed.load_state_dict(state)
    return head, resumed


def test_a_shuffled_dataloader_is_refused_not_skipped_wrongly() -> None:
    data = tagged(12)
    loader = DataLoader(data, batch_size=1, shuffle=True)
    head, resumed = halves(loader, DataLoader(data, batch_size=1, shuffle=True), 3)
    with pytest.raises(fxprobe.ConfigError, match="not the ones the saved stream ran"):
        list(resumed)


def test_inputs_in_another_order_are_refused_and_the_same_order_resumes() -> None:
    inputs = list(tagged(12))
    head, resumed = halves(inputs, inputs[1:2] + inputs[:1] + inputs[2:], 2)
    with pytest.raises(fxprobe.ConfigError, match="another order"):
        list(resumed)
    head, resumed = halves(inputs, [x.clone() for x in inputs], 2)  # equal values: the same
    rows = torch.cat(head + list(resumed))
    assert as_sorted(rows) == as_sorted(torch.stack(inputs).flatten(0, 2))


def test_a_stateful_dataloader_resumes_its_own_shuffled_order() -> None:
    stateful = pytest.importorskip("torchdata.stateful_dataloader",
                                   reason="torchdata is not installed")
    data = tagged(12)

    def loader() -> Any:
        return stateful.StatefulDataLoader(data, batch_size=1, shuffle=True,
                                           generator=torch.Generator().manual_seed(7))

    whole = list(stream(loader()))
    every = torch.cat(whole)
    assert as_sorted(every) == as_sorted(data.flatten(0, 1))  # each input's rows once
    # (a loader's batch of one adds a dim: rows are [3, 4])
    for k in (1, 4):
        head, resumed = halves(loader(), loader(), k)
        tail = list(resumed)
        assert len(head) + len(tail) == len(whole)
        assert all(torch.equal(a, b) for a, b in zip(head + tail, whole, strict=True))
    state = stream(loader()).state_dict()
    assert state["inputs"] is not None  # the loader's own state travels with the stream's
    with pytest.raises(fxprobe.ConfigError, match="same kind of inputs"):
        s = stream(loader())
        it = iter(s)
        next(it)
        stream(list(data)).load_state_dict(s.state_dict())


def test_a_state_saved_without_a_trail_still_resumes() -> None:
    inputs = list(tagged(10))
    s = stream(inputs)
    it = iter(s)
    head = [next(it) for _ in range(2)]
    state = s.state_dict()
    del state["trail"], state["inputs"]  # as fxprobe saved states before it kept them
    resumed = stream(inputs)
    resumed.load_state_dict(state)
    rows = torch.cat(head + list(resumed))
    assert as_sorted(rows) == as_sorted(torch.stack(inputs).flatten(0, 2))


def test_the_checksum_sees_bits_not_values_and_types() -> None:
    from fxprobe.runtime.trail import InputTrail

    def trail(*items: Any) -> list[int]:
        t = InputTrail()
        for item in items:
            t.add(item)
        return t.state()

    a, b = torch.tensor([0.0, 1.0]), torch.tensor([2.0, 0.0])
    assert trail(a, b) != trail(b, a)  # order of items
    assert trail(torch.tensor([0.0])) != trail(torch.tensor([-0.0]))  # bits
    assert trail(torch.tensor([1])) != trail(torch.tensor([1.0]))  # dtype
    assert trail({"x": a}) != trail({"y": a})  # keys
    assert trail(a, {"ids": b}) == trail(a.clone(), {"ids": b.clone()})
    assert InputTrail(trail(a)).state() == trail(a)
