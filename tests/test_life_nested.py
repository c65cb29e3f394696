"""A block on a later call of a hooked module (``inner.fc_1``) whose forwards all run inside
a nested block or ``run_with_cache``, on "twice-auto" (``Inner``, run by dynamo as a frame of
its own, called twice per forward) under dynamo's recompile limit of 2, against hooks on an
untapped copy.

Two inner blocks whose edits raise use up the limit, so ``Inner`` runs as written from then
on; a forward inside a third, nested, applies the outer block's edit at ``inner.fc_1`` (its
taps and output are the hooks'), yet leaving the outer block said that its selector matched
no site because of the limit: the nested table told the outer one of the later call, but
the outer one had not yet met ``Inner``'s hook sites (it meets them at a forward of its own).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from life_reference import edit_fn
from life_twice import SPEC, check_taps, tapped_twice, x_of

import fxprobe


@pytest.fixture(autouse=True)
def _fresh() -> None:
    torch._dynamo.reset()  # dynamo caches per code object: each test starts afresh


def _fails(site: object, value: torch.Tensor) -> torch.Tensor:
    raise ValueError("the edit failed")


def _inner_forward(tapped: Any, kind: str, x: torch.Tensor) -> torch.Tensor:
    if kind == "cache":
        out, cache = tapped.run_with_cache(x, names="head")
        assert torch.equal(cache["head"], out)
        return out  # type: ignore[no-any-return]
    with tapped.intervene({"head": edit_fn(1.0, None)}):
        return tapped(x)  # type: ignore[no-any-return]


@pytest.mark.parametrize("kind", ["cache", "block"])
@pytest.mark.parametrize("selector", ["inner.fc_1", "inner.fc_*"])
def test_an_edit_met_only_inside_a_nested_table_is_matched(kind: str, selector: str) -> None:
    reference = SPEC.build()
    with tapped_twice() as tapped:
        fn = edit_fn(2.0, None)
        with tapped.intervene({selector: fn}):  # left without an error: the edit applied
            for raising, shape in [("inner.fc_2", (3, 4)), ("inner.fc_3", (2, 3, 4))]:
                with pytest.raises((ValueError, fxprobe.DynamoError)):
                    with tapped.intervene({raising: _fails}):
                        tapped(x_of(shape, 0))
            x = x_of((2, 2, 2, 4), 1)
            out = _inner_forward(tapped, kind, x)
            names = ["inner.fc_1"] if selector == "inner.fc_1" else [
                "inner.fc_1", "inner.fc_2", "inner.fc_3"]
            check_taps(tapped, reference, x, [(n, fn) for n in names], out)
