"""``fxprobe.ActivationStream``: rows straight from a tapped model through a mixing buffer.

Over an epoch the rows yielded are exactly the multiset of rows forward hooks on an untapped
copy produce (no duplicates, no losses, filters applied); batches mix rows of several forwards
(a check that fails without a buffer); the order is fixed by the seed; a state taken between
batches resumes with the same batches; Disk can be written at the same time.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from sae_models import D, batches, reference_rows, tiny
from torch import nn

import fxprobe
from fxprobe.runtime.stream import ActivationStream


class Tag(nn.Module):
    """Hands back its input: row (f, b, p) of forward f holds [f, b, p, ...]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 1


def tagged(n: int, vary: bool = True) -> list[torch.Tensor]:
    out = []
    for f in range(n):
        b, p = (2 + f % 3, 3 + f % 4) if vary else (2, 3)  # shapes change between forwards
        x = torch.zeros(b, p, 4)
        x[..., 0] = f
        x[..., 1] = torch.arange(b)[:, None]
        x[..., 2] = torch.arange(p)
        out.append(x)
    return out


def rows_of(stream: Any) -> list[torch.Tensor]:
    return list(stream)


def as_sorted(rows: torch.Tensor) -> list[tuple[float, ...]]:
    return sorted(map(tuple, rows.tolist()))


def forwards_in(batch: torch.Tensor) -> int:
    return len(set(batch[:, 0].tolist()))


def test_an_epoch_is_every_row_once_and_batches_mix_forwards() -> None:
    inputs = tagged(12)
    tapped = fxprobe.tap(Tag(), ops="mul")
    stream = ActivationStream(tapped, "mul", inputs, batch_size=7, buffer=4, seed=0)
    got = rows_of(stream)
    expected = torch.cat([x.flatten(0, 1) for x in inputs])
    assert as_sorted(torch.cat(got)) == as_sorted(expected)  # no duplicates, no losses
    assert all(len(b) == 7 for b in got[:-1]) and 0 < len(got[-1]) <= 7
    assert sum(forwards_in(b) > 1 for b in got) > len(got) // 2
    # Without a buffer to mix in (one forward of 6 rows, nothing kept) a batch holds one
    # forward: the check above can fail.
    inputs = tagged(12, vary=False)
    alone = rows_of(ActivationStream(tapped, "mul", inputs, batch_size=3, buffer=1,
                                     refill=0.0))
    assert as_sorted(torch.cat(alone)) == as_sorted(torch.cat([x.flatten(0, 1)
                                                                for x in inputs]))
    assert all(forwards_in(b) == 1 for b in alone)


def test_the_order_is_the_seeds_and_each_epoch_is_new() -> None:
    inputs = tagged(8)
    tapped = fxprobe.tap(Tag(), ops="mul")
    one = ActivationStream(tapped, "mul", inputs, batch_size=5, buffer=3, seed=1)
    first, second = rows_of(one), rows_of(one)
    again = rows_of(ActivationStream(tapped, "mul", inputs, batch_size=5, buffer=3, seed=1))
    other = rows_of(ActivationStream(tapped, "mul", inputs, batch_size=5, buffer=3, seed=2))
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    assert not torch.equal(torch.cat(first), torch.cat(second))
    assert not torch.equal(torch.cat(first), torch.cat(other))
    assert as_sorted(torch.cat(second)) == as_sorted(torch.cat(first))
    dropped = rows_of(ActivationStream(tapped, "mul", inputs, batch_size=5, buffer=3,
                                       seed=1, drop_last=True))
    assert all(len(b) == 5 for b in dropped) and len(dropped) == sum(
        x.shape[0] * x.shape[1] for x in inputs) // 5


@pytest.mark.parametrize("tracer", ["fx", "hooks"])
def test_filtered_rows_are_the_hooks_rows(tracer: str) -> None:
    inputs = batches(7)
    ops = ["input_ids", "attention_mask", "emb"] if tracer == "fx" else ["emb"]
    tapped = fxprobe.tap(tiny(), ops=ops, tracer=tracer)
    if tracer == "fx":
        stream = ActivationStream(tapped, "emb", inputs, batch_size=6, buffer=3,
                                  mask="attention_mask", exclude_token_ids=[1],
                                  positions=slice(0, 6))
        expected = reference_rows(inputs, mask=True, exclude=(1,), positions=slice(0, 6))
    else:  # no input sites under hooks: positions only
        stream = ActivationStream(tapped, "emb", inputs, batch_size=6, buffer=3,
                                  positions=slice(1, None))
        expected = reference_rows(inputs, positions=slice(1, None))
    assert as_sorted(torch.cat(rows_of(stream))) == as_sorted(expected)


def test_a_state_between_batches_resumes_with_the_same_batches() -> None:
    inputs = tagged(10)
    kw: dict[str, Any] = dict(batch_size=4, buffer=3, seed=5, normalize=True)
    whole = rows_of(ActivationStream(fxprobe.tap(Tag(), ops="mul"), "mul", inputs, **kw))
    for k in (1, 6, len(whole) - 1):
        s = ActivationStream(fxprobe.tap(Tag(), ops="mul"), "mul", inputs, **kw)
        it = iter(s)
        head = [next(it) for _ in range(k)]
        state = s.state_dict()
        resumed = ActivationStream(fxprobe.tap(Tag(), ops="mul"), "mul", inputs, **kw)
        resumed.load_state_dict(state)
        tail = rows_of(resumed)
        assert len(head) + len(tail) == len(whole)
        assert all(torch.equal(a, b) for a, b in zip(head + tail, whole, strict=True))
    with pytest.raises(fxprobe.ConfigError, match="batch_size"):
        ActivationStream(fxprobe.tap(Tag(), ops="mul"), "mul", inputs,
                         **dict(kw, batch_size=5)).load_state_dict(state)


def test_streaming_while_writing_to_disk(tmp_path: Path) -> None:
    inputs = batches(6)
    tapped = fxprobe.tap(tiny(), ops=["attention_mask", "emb", "lin"],
                         to=fxprobe.Disk(tmp_path))
    stream = ActivationStream(tapped, ["emb", "lin"], inputs, batch_size=8, buffer=2,
                              mask="attention_mask", layout="stack")
    got = torch.cat(rows_of(stream))
    tapped.remove()
    emb, lin = (reference_rows(inputs, s, mask=True) for s in ("emb", "lin"))
    assert got.shape == (len(emb), 2, D)
    assert as_sorted(got.flatten(1)) == as_sorted(torch.stack([emb, lin], 1).flatten(1))
    caps = fxprobe.open_captures(tmp_path)
    assert len(caps) == len(inputs)
    ds = caps.dataset(["emb", "lin"], mask="attention_mask", layout="stack")
    assert torch.equal(ds[list(range(len(ds)))], torch.stack([emb, lin], 1))


def test_normalized_batches_invert_to_the_hooks_rows() -> None:
    inputs = batches(5)
    tapped = fxprobe.tap(tiny(), ops=["lin"])
    stream = ActivationStream(tapped, "lin", inputs, batch_size=10, buffer=100,
                              normalize=True)
    got = torch.cat(rows_of(stream))
    raw = reference_rows(inputs, "lin")
    assert stream.scale is not None  # the first (here: the only) buffer is every row
    factor = D ** 0.5 / float(raw.double().norm(dim=1).mean())
    assert stream.scale.factors["lin"] == pytest.approx(factor, rel=1e-6)
    torch.testing.assert_close(torch.tensor(as_sorted(stream.scale.undo(got))),
                               torch.tensor(as_sorted(raw)))


def test_bad_input_says_what_to_do() -> None:
    inputs = batches(2)
    tapped = fxprobe.tap(tiny(), ops=["emb"])
    with pytest.raises(fxprobe.ConfigError, match=r"attention_mask.*Tap it"):
        rows_of(ActivationStream(tapped, "emb", inputs, mask="attention_mask"))
    for bad in ({"buffer": 0}, {"refill": 1.0}, {"batch_size": True}, {"rows": "x"},
                {"layout": "tuple"}, {"positions": 2}):
        with pytest.raises(fxprobe.ConfigError):
            ActivationStream(tapped, "emb", inputs, **bad)
    with pytest.raises(fxprobe.ConfigError, match="tapped module"):
        ActivationStream(tiny(), "emb", inputs)


def test_a_second_iteration_takes_the_buffer_and_the_first_says_so() -> None:
    inputs = tagged(6)
    stream = ActivationStream(fxprobe.tap(Tag(), ops="mul"), "mul", inputs, batch_size=4,
                              buffer=2)
    first = iter(stream)
    next(first)
    second = rows_of(stream)  # a whole epoch of its own
    assert as_sorted(torch.cat(second)) == as_sorted(torch.cat([x.flatten(0, 1)
                                                                 for x in inputs]))
    with pytest.raises(fxprobe.ConfigError, match="iterated again"):
        next(first)
