"""Review of the SAE reader and stream: sequences of calls checked against references.

Each test here failed before the fix it names (states taken at an epoch's edge, ...).
"""

from __future__ import annotations

import torch
from sae_models import batches, reference_rows, tiny

import fxprobe


def _stream(tapped: object, inputs: list) -> fxprobe.ActivationStream:
    return fxprobe.ActivationStream(tapped, "emb", inputs, batch_size=3, buffer=1, seed=0,
                                    mask="attention_mask")


def test_a_state_after_an_epochs_last_batch_resumes_with_the_next_epoch() -> None:
    # Before the fix the resumed stream ran the finished epoch again: every row twice.
    inputs = batches(4)
    tapped = fxprobe.tap(tiny(), ops=["emb", "attention_mask"])
    stream = _stream(tapped, inputs)
    it = iter(stream)
    n = len(list(_stream(tapped, inputs)))
    first = [next(it) for _ in range(n)]          # the whole epoch, the generator not ended
    state = stream.state_dict()
    assert list(it) == []                         # the original: nothing more in epoch 0
    following = list(stream)                      # ... then epoch 1
    resumed = _stream(tapped, inputs)
    resumed.load_state_dict(state)
    again = list(resumed)
    assert len(again) == len(following)
    assert all(torch.equal(a, b) for a, b in zip(again, following, strict=True))
    rows = torch.cat(first)
    assert sorted(map(tuple, rows.tolist())) == \
        sorted(map(tuple, reference_rows(inputs, mask=True).tolist()))
