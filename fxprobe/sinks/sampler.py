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

``ds.loader`` draws its batches with :class:`Batches` (sorted row numbers of each batch of an
epoch) and, with ``num_workers``, gathers them ahead in threads of this process
(:class:`ThreadedBatches`) into batch tensors it reuses once nothing holds them
(:class:`Buffers`, one set per dataset and batch size: a new loader for each epoch reuses the
last one's).
"""

from __future__ import annotations

import collections
import threading
import weakref
from collections.abc import Iterator, Mapping, Sized
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
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
        self._resumed = False  # a load_state_dict's place, not yet iterated from

    def _mine(self) -> int:
        """Rows per rank: the same on every rank (padded, or with ``drop_last`` cut)."""
        if self.drop_last:
            return self.rows // self.world_size
        return -(-self.rows // self.world_size)

    def __len__(self) -> int:
        mine = self._mine()
        return mine // self.batch_size if self.drop_last else -(-mine // self.batch_size)

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` from its beginning at the next iteration; after
        :meth:`load_state_dict`, ``set_epoch`` of the restored epoch keeps its place (the
        ``DistributedSampler`` loop calls it before each epoch, the resumed one too)."""
        if not (self._resumed and int(epoch) == self.epoch):
            self._next = 0
        self.epoch = int(epoch)
        self._resumed = False

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
        self._resumed = False
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
        self._resumed = True

    def __repr__(self) -> str:
        return (f"RowSampler({self.rows} rows, batch_size={self.batch_size}, rank={self.rank}/"
                f"{self.world_size}, epoch={self.epoch}, next={self._next})")


class Batches(torch.utils.data.Sampler[np.ndarray]):
    """Batches of row numbers (sorted 1-d int64 arrays) of a shuffled (or ordered) epoch."""

    def __init__(self, n: int, batch_size: int, shuffle: bool = True, drop_last: bool = False,
                 generator: torch.Generator | None = None) -> None:
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ConfigError(f"batch_size={batch_size!r}: a positive int")
        self.n = n
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.generator = generator

    def __len__(self) -> int:
        full, rest = divmod(self.n, self.batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    def __iter__(self) -> Any:
        if self.shuffle:
            g = self.generator
            if g is None:  # as RandomSampler: a seed from torch's global generator
                g = torch.Generator().manual_seed(int(torch.empty((), dtype=torch.int64)
                                                      .random_().item()))
            order = torch.randperm(self.n, generator=g).numpy()
        else:
            order = np.arange(self.n, dtype=np.int64)
        for b in range(len(self)):
            part = order[b * self.batch_size:(b + 1) * self.batch_size]
            yield np.sort(part) if self.shuffle else part


class Buffers:
    """The tensors of the batches of ``rows`` rows a loader hands out, reused once nothing
    holds them, at most ``keep`` sets.

    Each tensor is ``torch.from_numpy`` of a fresh NumPy view of a kept buffer: its storage
    holds that view, and only it, so the view dies (a weak reference says so) when the last
    tensor sharing the storage does, whatever the consumer made of the batch (slices,
    ``.numpy()``, a tensor kept for later). A buffer still held is never written again; a new
    one is made (or, past ``keep``, a tensor not kept). Reused, a batch costs no page faults:
    a fresh 12 MB tensor made in another thread than the one that frees it comes back as
    fresh pages from the allocator, one fault per 4 KiB."""

    def __init__(self, ds: Any, rows: int, keep: int) -> None:
        self.rows, self.keep = rows, keep  # ds not held: _SHARED keys it weakly
        self.sizes = {n: int(np.prod(ds.row_shapes[n], dtype=np.int64)) *
                      ds.row_dtypes[n].itemsize for n in ds.names}
        self.shapes = {n: tuple(ds.row_shapes[n]) for n in ds.names}
        self.dtypes = {n: ds.row_dtypes[n] for n in ds.names}
        self.sets: list[tuple[dict[str, np.ndarray], list[weakref.ref[np.ndarray]]]] = []
        self.lock = threading.Lock()

    def get(self, n: int) -> dict[str, torch.Tensor]:
        """Tensors for ``n <= rows`` rows of every name, held by nothing else."""
        if n > self.rows or not all(self.sizes.values()):
            return self._fresh(n)
        with self.lock:
            free = [s for s in self.sets if all(r() is None for r in s[1])]
            if free:
                raw, held = free[0]
            elif len(self.sets) < self.keep:
                raw = {k: np.empty(self.rows * size, dtype=np.uint8)
                       for k, size in self.sizes.items()}
                held = []
                self.sets.append((raw, held))
            else:
                return self._fresh(n)
            out: dict[str, torch.Tensor] = {}
            views = []
            for k, buf in raw.items():
                view = buf[:n * self.sizes[k]]
                views.append(view)
                out[k] = torch.from_numpy(view).view(self.dtypes[k]).view(n, *self.shapes[k])
            held[:] = [weakref.ref(v) for v in views]
            return out

    def _fresh(self, n: int) -> dict[str, torch.Tensor]:
        return {k: torch.empty(n, *self.shapes[k], dtype=self.dtypes[k]) for k in self.sizes}


_SHARED: weakref.WeakKeyDictionary[Any, dict[int, Buffers]] = weakref.WeakKeyDictionary()
_SHARED_LOCK = threading.Lock()


def shared_buffers(ds: Any, rows: int, keep: int) -> Buffers:
    """The :class:`Buffers` of ``ds``'s batches of ``rows`` rows, kept as long as ``ds`` is:
    the loaders of one dataset (``ds.loader(...)`` called anew each epoch, as training loops
    do) share them, so only the first faults in fresh pages. ``keep`` grows to the largest a
    loader asked for."""
    with _SHARED_LOCK:
        per = _SHARED.setdefault(ds, {})
        buffers = per.get(rows)
        if buffers is None:
            buffers = per[rows] = Buffers(ds, rows, keep)
        buffers.keep = max(buffers.keep, keep)
        return buffers


class BufferedRows(torch.utils.data.Dataset[Any]):
    """What the ``DataLoader`` of ``ds.loader(num_workers=0)`` reads: ``ds[rows]`` for each
    batch of row numbers, gathered into the dataset's shared :class:`Buffers` (a batch dropped
    by the training step is the next one's memory: no heap grown by a fresh 12 MB tensor per
    batch). ``dataset`` is the :class:`~.dataset.CaptureDataset`."""

    def __init__(self, ds: Any, buffers: Buffers) -> None:
        self.dataset, self.buffers = ds, buffers

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, idx: np.ndarray) -> Any:
        ds = self.dataset
        return ds._pack(ds._read(idx, self.buffers.get(len(idx))))


class ThreadedBatches:
    """The batches of ``ds.loader(..., num_workers=k)``: ``k`` threads of this process gather
    the next ``k * prefetch`` batches while one is used; batches come in the sampler's order.

    A gather (``numpy.take`` from the maps) runs without the GIL, so the threads gather side
    by side and beside the training step, each into tensors the consuming thread chose
    (:class:`Buffers`)."""

    def __init__(self, ds: Any, sampler: Batches, workers: int, prefetch: int,
                 pin_memory: bool) -> None:
        self.dataset, self.sampler = ds, sampler
        self.workers, self.prefetch, self.pin_memory = workers, max(1, prefetch), pin_memory

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self) -> Iterator[Any]:
        ds, order = self.dataset, iter(self.sampler)  # the epoch's permutation, drawn here
        for name in ds.names:  # each site's row table made here, not by two threads at once
            ds._caps.row_count(name, 2 if ds.rows == "tokens" else 1)
        buffers = None if self.pin_memory else shared_buffers(  # pinned: torch's own allocator
            ds, self.sampler.batch_size, self.workers * self.prefetch + 2)

        def gather(idx: np.ndarray, into: dict[str, torch.Tensor]) -> Any:
            batch = ds._pack(ds._read(idx, into))
            return _pinned(batch) if self.pin_memory else batch

        ahead: collections.deque[Future[Any]] = collections.deque()
        with ThreadPoolExecutor(self.workers, thread_name_prefix="fxprobe-rows") as pool:
            def submit() -> None:
                idx = next(order, None)
                if idx is not None:
                    into = ds._empty(len(idx), True) if buffers is None else buffers.get(len(idx))
                    ahead.append(pool.submit(gather, idx, into))

            try:
                for _ in range(self.workers * self.prefetch):
                    submit()
                while ahead:
                    batch = ahead.popleft().result()
                    submit()
                    yield batch
            finally:  # the consumer stopped early: gathers not started are not run
                for f in ahead:
                    f.cancel()


def _pinned(batch: Any) -> Any:
    if isinstance(batch, Mapping):
        return {k: _pinned(v) for k, v in batch.items()}
    return batch if batch.is_pinned() else batch.pin_memory()
