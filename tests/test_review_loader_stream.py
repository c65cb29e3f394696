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

from typing import Any

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
