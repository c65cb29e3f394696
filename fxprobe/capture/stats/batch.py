"""The statistics of one forward, kept on the device and brought to the host in one transfer."""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from .math import Stats, stats_vectors


class StatsBatch(Mapping[str, Stats]):
    """The stats of several tensors of one forward: one device tensor, fetched once.

    The vectors stay on the device, stacked into one ``(k, 8)`` tensor (one per device if the
    values live on several); shapes and dtypes are kept on the host. The first read of any site
    (or :meth:`fetch`) copies the stack to the host in one transfer and caches the result.

    Example:
        >>> batch = StatsBatch.from_tensors({"a": a, "b": b})  # no synchronisation here
        >>> batch["a"].mean                                    # one transfer, for both
    """

    def __init__(self, names: Sequence[str], vectors: Sequence[torch.Tensor],
                 shapes: Sequence[tuple[int, ...]], dtypes: Sequence[str]) -> None:
        if not len(names) == len(vectors) == len(shapes) == len(dtypes):
            raise ValueError(
                f"StatsBatch needs as many names ({len(names)}), vectors ({len(vectors)}), "
                f"shapes ({len(shapes)}) and dtypes ({len(dtypes)})"
            )
        self._names = tuple(names)
        self._shapes = tuple(tuple(s) for s in shapes)
        self._dtypes = tuple(dtypes)
        groups: dict[torch.device, list[int]] = {}
        for i, v in enumerate(vectors):
            groups.setdefault(v.device, []).append(i)
        self._stacks: list[tuple[list[int], torch.Tensor]] = []
        for rows in groups.values():
            vecs = [vectors[i] for i in rows]
            wide = any(v.dtype == torch.float64 for v in vecs)  # host-side metadata only
            dtype = torch.float64 if wide else torch.float32
            self._stacks.append((rows, torch.stack([v.to(dtype) for v in vecs])))
        self._fetched: dict[str, Stats] | None = None

    @classmethod
    def from_tensors(cls, values: Mapping[str, torch.Tensor]) -> StatsBatch:
        """The stats of each tensor (:func:`stats_vectors`, per device), without synchronising."""
        names = list(values)
        tensors = [values[n] for n in names]
        by_device: dict[torch.device, list[int]] = {}
        for i, t in enumerate(tensors):
            by_device.setdefault(t.device, []).append(i)
        vectors: list[torch.Tensor] = [torch.empty(0)] * len(tensors)
        for members in by_device.values():
            rows = stats_vectors([tensors[i] for i in members])
            for i, row in zip(members, rows.unbind(0), strict=True):
                vectors[i] = row
        return cls(names, vectors, [tuple(t.shape) for t in tensors],
                   [str(t.dtype) for t in tensors])

    @property
    def stacked(self) -> torch.Tensor:
        """The ``(k, 8)`` device tensor, rows in name order (all values on one device)."""
        if len(self._stacks) != 1:
            raise ValueError(
                f"this batch spans {len(self._stacks)} devices, so it has no single stack; "
                "use fetch()"
            )
        return self._stacks[0][1]

    def fetch(self) -> dict[str, Stats]:
        """Copy the stack to the host (once, then cached) and return ``{name: Stats}``."""
        if self._fetched is None:
            rows: list[list[float]] = [[] for _ in self._names]
            for indices, stack in self._stacks:
                host = stack.cpu().tolist()  # the one synchronisation (per device)
                for i, row in zip(indices, host, strict=True):
                    rows[i] = row
            self._fetched = {
                name: _make_stats(shape, dtype, row)
                for name, shape, dtype, row in zip(self._names, self._shapes, self._dtypes, rows,
                                                   strict=True)
            }
        return self._fetched

    def __getitem__(self, name: str) -> Stats:
        if name not in self._names:
            raise KeyError(name)
        return self.fetch()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def __contains__(self, name: object) -> bool:
        return name in self._names

    def __repr__(self) -> str:
        state = "fetched" if self._fetched is not None else "on device"
        return f"StatsBatch({len(self._names)} sites, {state})"


def _make_stats(shape: tuple[int, ...], dtype: str, row: Sequence[float]) -> Stats:
    mean, std, lo, hi, absmax, zero_frac, nan_count, inf_count = row
    return Stats(shape=shape, dtype=dtype, numel=math.prod(shape), mean=mean, std=std, min=lo,
                 max=hi, absmax=absmax, zero_frac=zero_frac, nan_count=int(nan_count),
                 inf_count=int(inf_count))


def collect(values: Mapping[str, Any]) -> Mapping[str, Stats]:
    """``{name: Stats}`` from a mapping of Stats and/or tensors (others dropped), one transfer."""
    ready: dict[str, Stats] = {}
    tensors: dict[str, torch.Tensor] = {}
    order = []
    for name, v in values.items():
        if isinstance(v, Stats):
            ready[name] = v
        elif isinstance(v, torch.Tensor) and not v.is_complex():
            tensors[name] = v
        else:
            continue
        order.append(name)
    if not tensors:
        return ready
    fetched = StatsBatch.from_tensors(tensors).fetch()
    return {name: ready[name] if name in ready else fetched[name] for name in order}
