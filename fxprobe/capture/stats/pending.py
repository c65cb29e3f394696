"""Statistics of a kept value not yet read: still on its device (no host synchronisation), or,
until the end of the forward, the small tensor to reduce then with the forward's others
(``Pipeline.finish``); read all at once, in one transfer, when the forward's values are."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from .batch import StatsBatch
from .math import stats_vector


class PendingStats:
    """A tensor's statistics, still on its device (no host synchronisation yet); or, until the
    end of the forward, the small tensor to reduce then (``tensor``)."""

    __slots__ = ("vector", "shape", "dtype", "tensor", "table", "index")

    def __init__(self, t: torch.Tensor, vector: torch.Tensor | None,
                 tensor: torch.Tensor | None = None) -> None:
        self.vector = vector
        self.tensor = tensor
        self.shape = tuple(t.shape)
        self.dtype = t.dtype  # as a string when read: not in every forward
        self.table: Any = None
        """On a CPU, after the forward: the float64 rows of the forward's small tensors ..."""
        self.index = 0
        """... and this one's row."""

    def resolved(self) -> torch.Tensor:
        if self.vector is None:
            if self.table is not None:  # as stats_vector gives it: float32 unless float64
                row = torch.from_numpy(self.table[self.index])
                self.vector = row if self.dtype == torch.float64 else row.float()
                self.table = None
            else:  # a forward that raised before its end: reduce it now
                assert self.tensor is not None
                self.vector, self.tensor = stats_vector(self.tensor), None
        return self.vector


def resolve_stats(values: dict[str, Any]) -> dict[str, Any]:
    """Fetch every site's statistics in one transfer and put :class:`Stats` in their place."""
    flat = {name: tree_flatten(v) for name, v in values.items()}
    keys: list[str] = []
    pending: list[PendingStats] = []
    for name, (leaves, _) in flat.items():
        for i, leaf in enumerate(leaves):
            if isinstance(leaf, PendingStats):
                keys.append(f"{name}\0{i}")
                pending.append(leaf)
    if not pending:
        return values
    fetched = StatsBatch(keys, [p.resolved() for p in pending], [p.shape for p in pending],
                         [str(p.dtype) for p in pending]).fetch()
    out = {}
    for name, (leaves, spec) in flat.items():
        leaves = [fetched[f"{name}\0{i}"] if isinstance(leaf, PendingStats) else leaf
                  for i, leaf in enumerate(leaves)]
        out[name] = tree_unflatten(leaves, spec)
    return out
