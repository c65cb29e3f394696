"""Which inputs a stream's epoch ran, in order: what a resumed epoch checks before it skips them.

``ActivationStream.load_state_dict`` continues an epoch by iterating the inputs again and
skipping as many as the saved epoch had run. That is right only if the inputs come in the same
order again; a ``DataLoader(shuffle=True)`` draws a new order each time it is iterated, so the
skipped inputs would be other ones: some run twice in the epoch, others never, and nothing
would say so. :class:`InputTrail` is an order-sensitive checksum of the items run: the state
keeps it, and the resumed stream computes it over the items it skips and compares.

The checksum reads every tensor's bits (floating point reinterpreted as integers, so it is
exact), reduced on the tensor's own device without reading the result back: one read when the
state is saved and one when a resumed epoch has skipped its inputs, never per forward.
"""

from __future__ import annotations

import zlib
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

_MOD = 2_147_483_647  # 2**31 - 1: acc * _MUL + s stays below 2**63
_MUL = 1_000_003
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _tensor_sum(t: torch.Tensor) -> torch.Tensor:
    """The sum of ``t``'s elements as integers (its bits where it is not integer), mod
    ``_MOD``: a 0-d int64 tensor on ``t``'s device."""
    t = t.detach()
    if t.is_complex():
        t = torch.view_as_real(t)
    if t.dtype == torch.bool:
        t = t.to(torch.uint8)
    elif t.is_floating_point():
        t = t.contiguous().view(_BITS[t.element_size()])
    return t.to(torch.int64).remainder(_MOD).sum().remainder(_MOD)


class InputTrail:
    """An order-sensitive checksum of the items given to :meth:`add`."""

    def __init__(self, state: list[int] | None = None) -> None:
        self._py, saved = (state[0], state[1]) if state else (0, 0)
        self._acc: torch.Tensor | int = saved  # a 0-d tensor on the inputs' device, or an int

    def add(self, item: Any) -> None:
        leaves, spec = tree_flatten(item)
        shape = repr((str(spec), [(str(x.dtype), tuple(x.shape)) if isinstance(x, torch.Tensor)
                                  else repr(x) for x in leaves]))  # not hash(): salted per process
        self._py = (self._py * _MUL + zlib.crc32(shape.encode())) % _MOD
        for x in leaves:
            if isinstance(x, torch.Tensor) and x.numel():
                s = _tensor_sum(x)
                acc = self._acc
                if isinstance(acc, torch.Tensor):
                    s = s.to(acc.device, non_blocking=True)
                self._acc = (acc * _MUL + s).remainder(_MOD)

    def state(self) -> list[int]:
        """The checksum as two ints (reads the tensors' part back: one device sync)."""
        return [self._py, int(self._acc)]
