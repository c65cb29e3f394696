"""A per-call block in one mode after forwards in the other, on "twice-auto" (``Inner``, run by
dynamo as a frame of its own, called twice per forward) under dynamo's recompile limit of 2,
against hooks on an untapped copy.

tap() builds the model's own mode (eval) first. A train-mode forward, then ``eval()`` and a
block editing ``inner.relu_1`` (a site only dynamo's graphs reach): the first eval forward is
refused past the limit before dynamo captured any eval-mode site of ``Inner``, and the
forwards after it ran as written, unedited (taps and output), where the mirrored sequence
(eval, then a train-mode block) is refused: the lifecycle built first never saw the other
mode's sites (it kept a private, empty table of the modes' lifecycles).
"""

from __future__ import annotations

import pytest
import torch
from life_reference import edit_fn
from life_twice import SPEC, check_taps, forward_or_refused, tapped_twice, x_of

import fxprobe


@pytest.fixture(autouse=True)
def _fresh() -> None:
    torch._dynamo.reset()  # dynamo caches per code object: each test starts afresh


@pytest.mark.parametrize("first", [True, False], ids=["train-then-eval", "eval-then-train"])
@pytest.mark.parametrize("site", ["inner.relu_1", "inner.relu"])
def test_block_in_one_mode_after_a_forward_in_the_other(first: bool, site: str) -> None:
    reference = SPEC.build()
    with tapped_twice() as tapped:
        tapped.train(first)
        tapped(x_of((2, 2, 2, 4), 1))
        tapped.train(not first)
        reference.train(not first)
        fn = edit_fn(-1.0, None)
        ctx = tapped.intervene({site: fn})
        ctx.__enter__()
        for shape in [(2, 2, 2, 4), (3, 4), (2, 3, 4)]:
            x = x_of(shape, 0)
            out = forward_or_refused(tapped, x)
            if out is not None:
                check_taps(tapped, reference, x, [(site, fn)], out)
        try:
            ctx.__exit__(None, None, None)
        except fxprobe.DynamoError as e:  # a site only dynamo reached, gone: said so
            assert "recompile_limit" in str(e)
        out = tapped(x_of((3, 4), 2))  # outside the block: as the model computes it
        assert torch.equal(out, reference(x_of((3, 4), 2)))
