"""The "twice-auto" model of the stateful test (``tests/life_models.py``: a module dynamo runs
as a frame of its own, called twice per forward) tapped under dynamo's recompile limit of 2,
and its taps and output checked against hooks on an untapped copy (``life_reference``)."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from life_models import SPECS
from life_reference import run

import fxprobe

SPEC = SPECS["twice-auto"]


@contextlib.contextmanager
def tapped_twice(ops: Any = None) -> Iterator[Any]:
    """A fresh model tapped as ``SPEC`` says (or at ``ops``) under dynamo's recompile limit
    of 2 (warnings ignored), removed on leaving."""
    with torch._dynamo.config.patch(recompile_limit=2), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tapped = fxprobe.tap(SPEC.build(), ops=SPEC.ops if ops is None else ops,
                             tracer=SPEC.tracer)
        try:
            yield tapped
        finally:
            tapped.remove()


def fails(site: object, value: torch.Tensor) -> torch.Tensor:
    """An edit that raises."""
    raise ValueError("the edit failed")


def use_up_limit(x: torch.Tensor) -> None:
    """Use up dynamo's limit for the model's inner module's code with a first tap (a block
    whose edit raises, then a forward), as a second tap of the same model then meets it."""
    with tapped_twice() as first:
        with pytest.raises(ValueError):
            with first.intervene({"inner.fc": fails}):
                first(x)
        first(x)


def x_of(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen, dtype=torch.float64).float()


def forward_or_refused(tapped: Any, x: torch.Tensor) -> torch.Tensor | None:
    """``tapped(x)``, or None where it was refused past dynamo's recompile limit (documented:
    a ``DynamoError`` that names the limit)."""
    try:
        return tapped(x)  # type: ignore[no-any-return]
    except fxprobe.DynamoError as e:
        assert "recompile_limit" in str(e)
        return None


def check_taps(tapped: Any, reference: torch.nn.Module, x: torch.Tensor,
               edits: list[tuple[str, Any]], out: torch.Tensor | None = None) -> None:
    """``tapped.taps`` (and ``out``, the forward's output, if given) as hooks on
    ``reference`` see them with ``edits`` applied."""
    reads = {n: SPEC.points[n] for n in SPEC.taps}
    expected, seen = run(reference, lambda: reference(x),
                         [(SPEC.points[n], fn) for n, fn in edits], reads)
    taps = tapped.taps
    wrong = [n for n in SPEC.taps  # a site gone past dynamo's limit is said so, not compared
             if n in taps and not torch.equal(taps[n], seen[n][0])]
    assert not wrong, f"tapped.taps differ from the hooks' values at {wrong}"
    assert out is None or torch.equal(out, expected), "the output differs from the hooks'"
