"""A hook registered inside a block (the model traced again) on "twice-auto" (``Inner``, run
by dynamo as a frame of its own, called twice per forward) under dynamo's recompile limit of
2, against hooks on an untapped copy.

A block editing ``inner.relu`` (a site only dynamo's graphs reach), then a hook registered on
``inner.fc`` of the tapped module: the module is traced again, the next forward is refused
past the limit, and the forwards after it ran ``Inner`` as written, unedited (taps and
output): the new program had captured no site of ``Inner``, and the block's own (resolved
against the program traced away) were not counted among the edits a fallen module loses.
"""

from __future__ import annotations

import pytest
import torch
from life_reference import edit_fn
from life_twice import SPEC, check_taps, forward_or_refused, tapped_twice, x_of


@pytest.fixture(autouse=True)
def _fresh() -> None:
    torch._dynamo.reset()  # dynamo caches per code object: each test starts afresh


@pytest.mark.parametrize("site", ["inner.relu", "inner.relu_1"])
def test_a_block_across_a_new_trace_edits_or_refuses(site: str) -> None:
    reference = SPEC.build()
    with tapped_twice() as tapped:
        tapped(x_of((2, 2, 2, 4), 1))
        fn = edit_fn(-2.0, None)
        with tapped.intervene({site: fn}):
            for i, shape in enumerate([(2, 2, 2, 4), (3, 4), (2, 3, 4), (4,)]):
                if i == 1:  # the tapped module's own hook: traced again
                    tapped.get_submodule("inner.fc").register_forward_hook(
                        lambda m, args, out: None)
                x = x_of(shape, i)
                out = forward_or_refused(tapped, x)
                if out is not None:
                    check_taps(tapped, reference, x, [(site, fn)], out)
