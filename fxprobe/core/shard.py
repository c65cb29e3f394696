"""How a site's value is split across the ranks of a tensor-parallel model.

Under tensor parallelism (``from_pretrained(..., tp_plan="auto")``, or
``torch.distributed.tensor.parallel.parallelize_module``) each rank computes part of a value:
this rank's heads of ``attn.q``, its columns of ``mlp.pre``, or a summand of a row-parallel
projection before the reduction. A :class:`Sharding` on a site (``Site.sharding``, in
``tapped.sites`` and ``tapped.sharding``) says which; a site without one holds the same full
value on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Sharding:
    """Which part of the full value a rank's value of a site is.

    Example: ``attn.q`` of a Llama with 4 heads on 2 ranks, ``gather=False``:
    ``Sharding(dim=1, ranks=2, rank=0, mesh="DeviceMesh((tp=2), 'cpu')")``: this rank holds
    heads 0-1 (the full value is the ranks' values concatenated along dim 1, in rank order).
    """

    dim: int | None
    """The dimension split into contiguous chunks, one per rank in rank order; None for a
    partial sum (``partial``) or a split fxprobe cannot follow (``understood`` False)."""
    ranks: int
    """How many ranks the value is split over (the size of the group)."""
    rank: int
    """This process's index in that group."""
    mesh: str
    """The device mesh (or process group) it is split over, as torch writes it."""
    partial: bool = False
    """Each rank holds a summand: the full value is the sum over the ranks (a row-parallel
    projection before its reduction)."""
    understood: bool = True
    """False where the value derives from a sharded one through ops fxprobe cannot follow:
    it is this rank's local value, whose relation to the full one is unknown (a warning
    names the module); ``gather=True`` cannot gather it."""
    gathered: bool = False
    """The value tapped, kept and handed to ``fn=`` and per-call edits is the full value,
    gathered from every rank (``tap(..., gather=True)``); an edit of it flows on as this
    rank's part of the edited value. False: this rank's local value (the default)."""
    dtensor: bool = False
    """The value is a ``torch.distributed.tensor.DTensor``, which knows its own placements
    (``full_tensor()`` is the full value): tapped as it is, never gathered; else a plain
    tensor holding this rank's part."""
    group: Any = field(default=None, compare=False, repr=False)
    """The ``torch.distributed`` process group of the ranks (for the gather)."""

    def span(self, full: int) -> tuple[int, int]:
        """``(start, stop)`` along ``dim`` of this rank's part of a full size ``full``
        (torch's chunking: ``ceil(full / ranks)`` per rank, the last ones shorter)."""
        step = -(-full // self.ranks)
        start = min(self.rank * step, full)
        return start, min(start + step, full)
