"""More sequences tests/test_life.py's long mode found on "twice-auto", shrunk, against hooks
on an untapped copy (``Twice``: a module dynamo runs as a frame of its own, called twice per
forward, under ``tracer="auto"`` with dynamo's recompile limit at 2).

- Eval forward, then ``train()`` and a block editing ``inner.relu_1`` (a site only dynamo's
  graphs reach): the first train-mode forward in the block is refused past the limit (as
  documented) before dynamo captured the train-mode sites, so the block's selector had matched
  nothing, and the next forward ran as written without the edit (its ``tapped.taps`` and
  output unedited). ``Lifecycle._refuse_lost_edits`` now counts the sites dynamo found in the
  module in the other mode: the next forward is refused too, naming the limit.
- A block on ``inner.fc``, and inside it two blocks whose edits raise (two input ranks, the
  limit used up): the block, entered while ``inner`` was deferred, had resolved its selectors
  without ``inner``'s hook sites (hidden then) and never met them once dynamo gave up on it,
  so the next forward ran as written without the edit. A block now resolves against them.
- A block on ``inner.fc_3``, and inside it two blocks whose edits raise: leaving the outer
  block said ``SelectorError: 'inner.fc_3' matches no site``, where a later call of the
  hooked ``inner.fc`` is that site and dynamo's limit is why no forward met it; it says the
  limit now (``DynamoError``).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from life_reference import edit_fn
from life_twice import SPEC, check_taps, forward_or_refused, tapped_twice, x_of

import fxprobe


@pytest.fixture(autouse=True)
def _fresh() -> None:
    torch._dynamo.reset()  # dynamo caches per code object: each test starts afresh


def _raising_block(tapped: Any, selector: str, x: torch.Tensor) -> None:
    def fails(site: object, value: torch.Tensor) -> torch.Tensor:
        raise ValueError("the edit failed")

    with pytest.raises((ValueError, fxprobe.DynamoError)):
        with tapped.intervene({selector: fails}):
            tapped(x)


def test_train_mode_block_after_an_eval_forward_taps_what_hooks_see() -> None:
    reference = SPEC.build()
    with tapped_twice() as tapped:
        tapped(x_of((2, 2, 2, 4), 1))
        tapped.train(True)
        reference.train(True)
        fn = edit_fn(-1.0, None)
        ctx = tapped.intervene({"inner.relu_1": fn})
        ctx.__enter__()
        for shape in [(2, 2, 2, 4), (3, 4)]:  # the second ran as written, unedited
            x = x_of(shape, 0)
            if forward_or_refused(tapped, x) is not None:
                check_taps(tapped, reference, x, [("inner.relu_1", fn)])
        try:
            ctx.__exit__(None, None, None)
        except fxprobe.DynamoError as e:  # a site only dynamo reached, gone: said so
            assert "recompile_limit" in str(e)


def test_block_after_raising_blocks_taps_what_hooks_see() -> None:
    reference = SPEC.build()
    with tapped_twice() as tapped:
        fn = edit_fn(2.0, None)
        ctx = tapped.intervene({"inner.fc": fn})
        ctx.__enter__()
        try:
            _raising_block(tapped, "inner.fc_2", x_of((3, 4), 0))
            _raising_block(tapped, "inner.fc_3", x_of((2, 3, 4), 0))
            x = x_of((2, 2, 2, 4), 1)
            tapped(x)
            check_taps(tapped, reference, x, [("inner.fc", fn)])
        finally:
            try:
                ctx.__exit__(None, None, None)
            except fxprobe.DynamoError as e:
                assert "recompile_limit" in str(e)


def test_leaving_a_block_after_raising_blocks_names_the_limit() -> None:
    with tapped_twice() as tapped:
        ctx = tapped.intervene({"inner.fc_3": edit_fn(2.0, None)})
        ctx.__enter__()
        _raising_block(tapped, "inner.fc_2", x_of((3, 4), 0))
        _raising_block(tapped, "inner.fc_2", x_of((2, 3, 4), 0))
        try:
            ctx.__exit__(None, None, None)  # raised SelectorError: matches no site
        except fxprobe.DynamoError as e:
            assert "recompile_limit" in str(e)
