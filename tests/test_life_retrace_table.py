"""A block whose model is traced again inside it (a hook registered on the tapped module),
on "twice-auto" (``Inner``, run by dynamo as a frame of its own, called twice per forward),
against hooks on an untapped copy: leaving the block judges its selectors by the program the
forwards ran, not by the one traced away.

Entered before the first forward, the block's table kept the first program's lifecycle, whose
dynamo region never ran: leaving it checked nothing, so a misspelt name (``inner.relu_9``)
left the block without an error, and where a second tap found dynamo's limit used up, a name
only dynamo's graphs reach left it silently too (without the new trace, both raise).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from life_reference import edit_fn
from life_twice import SPEC, check_taps, tapped_twice, use_up_limit, x_of

import fxprobe


@pytest.fixture(autouse=True)
def _fresh() -> None:
    torch._dynamo.reset()  # dynamo caches per code object: each test starts afresh


@contextlib.contextmanager
def _tapped(tracer: str) -> Iterator[Any]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the new trace is said in a warning
        tapped = fxprobe.tap(SPEC.build(), ops=SPEC.ops, tracer=tracer)
        try:
            yield tapped
        finally:
            tapped.remove()


def _rehook(tapped: Any) -> None:
    """A hook on a module of the tapped module: its next forward traces the model again."""
    tapped.get_submodule("inner.fc").register_forward_hook(lambda m, args, out: None)


@pytest.mark.parametrize("tracer", ["auto", "dynamo"])
def test_a_misspelt_name_is_said_after_a_new_trace_in_the_block(tracer: str) -> None:
    reference = SPEC.build()
    fn = edit_fn(2.0, None)
    with _tapped(tracer) as tapped:
        with pytest.raises(fxprobe.SelectorError, match=r"'inner\.relu_9'.*inner\.relu_1"):
            with tapped.intervene({"inner.relu_1": fn, "inner.relu_9": fn}):
                _rehook(tapped)
                for shape in [(3, 4), (2, 3, 4)]:  # the edit applies across the new trace
                    x = x_of(shape, 1)
                    out = tapped(x)
                    check_taps(tapped, reference, x, [("inner.relu_1", fn)], out)
        x = x_of((3, 4), 2)  # and the block left nothing behind
        check_taps(tapped, reference, x, [], tapped(x))


def test_a_second_tap_past_the_limit_says_so_after_a_new_trace_in_the_block() -> None:
    x = x_of((3, 4), 0)
    use_up_limit(x)  # dynamo's limit for Inner's code
    with tapped_twice() as tapped:
        with pytest.raises(fxprobe.DynamoError, match="recompile_limit") as left:
            with tapped.intervene({"inner.relu_1": edit_fn(2.0, None)}):
                _rehook(tapped)
                for _ in range(2):
                    with pytest.raises(fxprobe.DynamoError, match="recompile_limit"):
                        tapped(x)  # refused: it would run unedited
        assert "stopped capturing Inner" in str(left.value)
