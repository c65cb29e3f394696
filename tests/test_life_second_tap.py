"""A block in a second tap of one model (dynamo's compiled entries are the code's, shared by
every tap of it in the process) on "twice-auto" (``Inner``, run by dynamo as a frame of its
own, called twice per forward) under dynamo's recompile limit of 2, against hooks on an
untapped copy (found by tests/test_life.py's long mode, shrunk).

The first tap used up the limit; the second entered a block on ``inner.relu_1`` (a site only
dynamo's graphs reach) before dynamo captured ``Inner`` for it, a nested block's forward was
refused past the limit, and the next forward ran ``Inner`` as written, unedited (taps and
output): no graph of the second tap had named the site, so nothing counted it lost.
"""

from __future__ import annotations

import pytest
import torch
from life_reference import edit_fn
from life_twice import (
    SPEC,
    check_taps,
    fails,
    forward_or_refused,
    tapped_twice,
    use_up_limit,
    x_of,
)

import fxprobe


@pytest.fixture(autouse=True)
def _fresh() -> None:
    torch._dynamo.reset()  # dynamo caches per code object: each test starts afresh


def test_a_block_in_a_second_tap_past_the_limit_edits_or_refuses() -> None:
    reference = SPEC.build()
    x = x_of((3, 4), 0)
    use_up_limit(x)  # dynamo's limit for Inner's code
    fn = edit_fn(2.0, None)
    with tapped_twice() as tapped:
        ctx = tapped.intervene({"inner.relu_1": fn})
        ctx.__enter__()
        with pytest.raises((ValueError, fxprobe.DynamoError)):
            with tapped.intervene({"inner.fc": fails}):
                tapped(x)
        for shape in [(3, 4), (2, 3, 4)]:
            x = x_of(shape, 1)
            out = forward_or_refused(tapped, x)
            if out is not None:
                check_taps(tapped, reference, x, [("inner.relu_1", fn)], out)
        try:
            ctx.__exit__(None, None, None)
        except fxprobe.DynamoError as e:  # a site only dynamo reached, gone: said so
            assert "recompile_limit" in str(e)
