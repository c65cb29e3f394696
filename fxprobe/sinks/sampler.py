"""``RowSampler``: batches of row numbers for a dataset of captured rows, shuffled per epoch,
split across training ranks, with a ``state_dict`` to resume mid-epoch.

``DataLoader(ds, batch_size=None, sampler=RowSampler(ds, 4096))`` hands each batch of row
numbers to ``ds[rows]`` (one gather per forward). Like ``DistributedSampler`` the order is a
permutation drawn from ``seed + epoch``; rank ``r`` of ``world_size`` takes every
``world_size``-th row of it from the ``r``-th. Every rank gets the same number of rows, so the
same number of batches (a rank with one batch more would wait in DDP's all-reduce forever):
where the rows do not divide evenly, the permutation is padded with its own first rows (a few
rows twice in the epoch) or, with ``drop_last=True``, its last rows are left out (a few rows
not at all), as ``DistributedSampler`` does.
"""

from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import Any

import torch
from torch.utils.data import Sampler

from ..core.errors import ConfigError


def _positive(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"RowSampler({name}={value!r}) must be a positive int")
    return value


class RowSampler(Sampler[list[int]]):
    """Batches of row numbers: one epoch per iteration, shuffled by ``seed + epoch``.

    Args:
        data: the dataset (or its number of rows).
        batch_size: rows per batch.
        shuffle: a new permutation each epoch (else rows in order).
        seed: the permutation's seed; every rank must pass the same one.
        drop_last: leave out the last batch when it is short, and across ranks the rows
            that do not divide evenly (else the epoch is padded with its first rows).
        rank, world_size: this training rank and how many there are; by default
            torch.distributed's, else 0 and 1.

    The epoch advances by itself at the end of each full iteration (``set_epoch`` sets it,
    as with ``DistributedSampler``). ``state_dict()`` holds the epoch and the batches handed
    out in it: with ``num_workers=0`` that is where training stands; with workers use
    ``torchdata``'s ``StatefulDataLoader`` (whose ``state_dict`` counts what it yielded).

    Example:
        >>> sampler = fxprobe.RowSampler(ds, 4096, seed=0)
        >>> loader = DataLoader(ds, batch_size=None, sampler=sampler)
    """

    def __init__(self, data: Sized | int, batch_size: int, *, shuffle: bool = True,
                 seed: int = 0, drop_last: bool = False, rank: int | None = None,
                 world_size: int | None = None) -> None:
        n = data if isinstance(data, int) and not isinstance(data, bool) else len(data)  # type: ignore[arg-type]
        if rank is None and world_size is None:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                rank, world_size = dist.get_rank(), dist.get_world_size()
        if (rank is None) != (world_size is None):
            raise ConfigError(f"RowSampler(rank={rank!r}, world_size={world_size!r}): pass "
                              "both (each rank its own rank) or neither (torch.distributed's)")
        world_size = 1 if world_size is None else _positive("world_size", world_size)
        rank = 0 if rank is None else rank
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ConfigError(f"RowSampler(rank={rank!r}) must be in [0, world_size="
                              f"{world_size})")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ConfigError(f"RowSampler(seed={seed!r}) must be an int")
        self.rows = int(n)
        self.batch_size = _positive("batch_size", batch_size)
        self.shuffle = bool(shuffle)
        self.seed = seed
        self.drop_last = bool(drop_last)
        self.rank = rank
        self.world_size = world_size
        self.epoch = 0
        self._next = 0  # batches of this epoch already handed out

    def _mine(self) -> int:
        """Rows per rank: the same on every rank (padded, or with ``drop_last`` cut)."""
        if self.drop_last:
            return self.rows // self.world_size
        return -(-self.rows // self.world_size)

    def __len__(self) -> int:
        mine = self._mine()
        return mine // self.batch_size if self.drop_last else -(-mine // self.batch_size)

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` from its beginning at the next iteration."""
        self.epoch = int(epoch)
        self._next = 0

    def order(self) -> torch.Tensor:
        """This rank's rows of the current epoch, in the order they are handed out."""
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            perm = torch.randperm(self.rows, generator=g)
        else:
            perm = torch.arange(self.rows)
        total = self._mine() * self.world_size
        if total > self.rows:  # pad with the first rows (again, if there are fewer rows)
            perm = perm.repeat(-(-total // self.rows))
        return perm[self.rank:total:self.world_size]

    def __iter__(self) -> Iterator[list[int]]:
        order = self.order()
        for b in range(self._next, len(self)):
            self._next = b + 1
            yield order[b * self.batch_size:(b + 1) * self.batch_size].tolist()
        self.epoch += 1
        self._next = 0

    def state_dict(self) -> dict[str, Any]:
        """Where the sampler stands: its epoch, the batches of it handed out, its settings."""
        return {"epoch": self.epoch, "next": self._next, "seed": self.seed,
                "rows": self.rows, "batch_size": self.batch_size, "rank": self.rank,
                "world_size": self.world_size, "shuffle": self.shuffle}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``: the next iteration hands out the batches not yet given.

        Raises:
            ConfigError: the state is of another dataset size, batch size, seed or split."""
        for key in ("rows", "batch_size", "seed", "rank", "world_size", "shuffle"):
            if state.get(key) != getattr(self, key):
                raise ConfigError(
                    f"RowSampler.load_state_dict: the state has {key}={state.get(key)!r} where "
                    f"this sampler has {getattr(self, key)!r}; a position is resumed only "
                    "over the same rows, batch size, seed and split")
        self.epoch = int(state["epoch"])
        self._next = int(state["next"])

    def __repr__(self) -> str:
        return (f"RowSampler({self.rows} rows, batch_size={self.batch_size}, rank={self.rank}/"
                f"{self.world_size}, epoch={self.epoch}, next={self._next})")
