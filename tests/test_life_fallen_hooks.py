"""A block on a hooked module call (``inner.fc``, its later calls ``inner.fc_1``...) of
``Inner``, a module dynamo runs as a frame of its own (``tracer="auto"``), when dynamo stops
capturing it past its recompile limit (2) inside the block, against hooks on an untapped copy,
where tap() did not select the call (its hook is the block's own to install).

- ``ops=[torch.relu]``, a block on ``inner.fc``: the block had resolved ``inner.fc`` as the
  site dynamo names the call by, and on meeting the hook sites of the fallen module it left
  out those it knew by name, so no hook was installed: later forwards ran it unedited.
- ``ops="inner"``, a block on ``inner.fc_1``, a hook registered on ``inner.fc`` inside it (the
  model traced again): the block met no hook site of the new program's fallen module (it was
  resolved against the program traced away), so later forwards ran it unedited.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from life_reference import edit_fn, run
from life_twice import SPEC, forward_or_refused, tapped_twice, x_of


@pytest.fixture(autouse=True)
def _fresh() -> None:
    torch._dynamo.reset()  # dynamo caches per code object: each test starts afresh


@pytest.mark.parametrize(("ops", "site", "hook"), [
    ([torch.relu], "inner.fc", False), ([torch.relu], "inner.fc_1", False),
    ("inner", "inner.fc_1", True), ("inner", "inner.fc_3", True)])
def test_a_fallen_module_call_is_edited_or_refused(ops: Any, site: str, hook: bool) -> None:
    reference = SPEC.build()
    fn = edit_fn(-2.0, None)
    ran = 0
    with tapped_twice(ops) as tapped:
        tapped(x_of((2, 2, 2, 4), 1))
        with tapped.intervene({site: fn}):
            for i, shape in enumerate([(2, 2, 2, 4), (3, 4), (2, 3, 4), (4,)]):
                if i == 1 and hook:  # the tapped module's own hook: traced again
                    tapped.get_submodule("inner.fc").register_forward_hook(
                        lambda m, args, out: None)
                x = x_of(shape, i)
                out = forward_or_refused(tapped, x)
                if out is not None:
                    ran += 1
                    expected, _ = run(reference, lambda x=x: reference(x),
                                      [(SPEC.points[site], fn)], {})
                    assert torch.equal(out, expected), f"forward {i} ({shape}) unedited"
    assert ran >= 2  # what runs as written past the limit is edited there
