"""``Captures.dataset``: captured values as a map-style ``torch.utils.data.Dataset``.

Rows are slices of memory-mapped values, so a dataset larger than memory can be shuffled
row by row. ``rows="samples"`` makes one row per batch element (dim 0), ``rows="tokens"`` one
per position of the first two dims (``[batch, pos, ...]`` -> ``batch * pos`` rows), optionally
only where a recorded mask is non-zero (the padding of a batch left out).

The dataset holds the index of the committed shards it was made from (no open file), so it
pickles into ``DataLoader`` workers, where each opens its own maps at the first row it reads.
``__getitems__`` (which ``DataLoader`` calls with a whole batch of indices) reads a batch with
one gather per shard (``Captures.rows``) instead of one Python call per row; ``ds.loader(...)``
hands whole batches to ``ds[rows]`` and skips the row-by-row collation as well (the fast path).
"""

from __future__ import annotations

import operator
import os
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, Protocol, TypedDict

import numpy as np
import torch
from torch.utils.data import Dataset

from ..core.errors import ConfigError, DiskError
from .rows import RowFilter, Scale, check_stackable
from .sampler import Batches, BufferedRows, ThreadedBatches, shared_buffers

Rows = Literal["tokens", "samples"]
Layout = Literal["dict", "stack"]


class RowOptions(TypedDict, total=False):
    """What an SAE trainer chooses of the rows (``Captures.dataset``; ``ActivationStream``)."""

    positions: slice | None
    """Sequence positions kept (``slice(1, None)``: not the first); ``rows="tokens"``."""
    exclude_token_ids: Iterable[int] | None
    """Token ids whose rows are left out (BOS, EOS, pad): reads the ``tokens`` site."""
    tokens: str
    """The site of the token ids (default ``"input_ids"``, the model's input)."""
    normalize: bool | float | Mapping[str, float]
    """True: scale each site's rows to a mean norm of sqrt(d), the factor estimated on a
    sample of 8192 rows; a number (or ``{site: number}``): that factor."""
    layout: Layout
    """Several sites: ``"dict"`` (by name) or ``"stack"`` (``(batch, n_sites, *row)``)."""


NORM_SAMPLE = 8192
"""Rows a normalization factor is estimated on (a seeded sample)."""


class Source(Protocol):
    """What a dataset reads: forwards by number (``Captures`` is one)."""

    def __len__(self) -> int: ...

    def forward(self, i: int) -> Mapping[str, Any]: ...

    def rows(self, site: str, indices: Any, lead: int = 2, *, out: Any = None
             ) -> torch.Tensor: ...

    def row_count(self, site: str, lead: int = 2) -> int: ...


class CaptureDataset(Dataset[Any]):
    """Rows of captured values: see :meth:`Captures.dataset`."""

    def __init__(self, caps: Source, names: str | Sequence[str], rows: Rows = "tokens",
                 mask: str | None = None, *, positions: slice | None = None,
                 exclude_token_ids: Iterable[int] | None = None, tokens: str = "input_ids",
                 normalize: bool | float | Mapping[str, float] = False,
                 layout: Layout = "dict", keys: str | Sequence[str] | None = None) -> None:
        if rows not in ("tokens", "samples"):
            raise ConfigError(f"dataset(rows={rows!r}): expected 'tokens' (one row per "
                              "[batch, pos] position) or 'samples' (one row per batch element)")
        single = isinstance(names, str)
        wanted = (names,) if isinstance(names, str) else tuple(names)
        if not wanted or not all(isinstance(n, str) for n in wanted):
            raise ConfigError(f"dataset(names={names!r}): give a site name or a list of them")
        row_filter = RowFilter.make(mask, tokens, exclude_token_ids, positions)
        if row_filter.active and rows != "tokens":
            raise ConfigError("dataset(mask=, exclude_token_ids=, positions=) leave out "
                              "[batch, pos] positions: they need rows='tokens'")
        if layout not in ("dict", "stack"):
            raise ConfigError(f"dataset(layout={layout!r}): 'dict' (rows by site name) or "
                              "'stack' ((batch, n_sites, d))")
        self.names = wanted
        self.keys = wanted if keys is None else ((keys,) if isinstance(keys, str) else tuple(keys))
        """The names batches of several sites are keyed by: as given (canonical or not)."""
        self.rows: Rows = rows
        self.mask = mask
        self.filter = row_filter
        """The rows kept of each forward (mask, excluded tokens, positions)."""
        self.layout: Layout = layout
        self._single = single and layout == "dict"
        self._caps = caps
        self._forwards: list[int] = []
        self._starts: list[int] = []
        self._kept: list[torch.Tensor | None] = []
        self._raw_starts: list[int] = []
        raw_total = 0
        self.row_shapes: dict[str, tuple[int, ...]] = {}
        """Each name's shape of one row."""
        self.row_dtypes: dict[str, torch.dtype] = {}
        """Each name's dtype."""
        total = 0
        # Shapes only: the data (and its checksum) is read when rows are.
        peek = getattr(caps, "_forward", None)
        for f in range(len(caps)):
            values = peek(f, check_data=False) if peek is not None else caps.forward(f)
            present = [n for n in wanted if n in values]
            if not present:
                continue
            if len(present) != len(wanted):
                raise DiskError(f"forward {f} holds {present} but not "
                                f"{[n for n in wanted if n not in values]}: rows of several "
                                "sites need every one of them in every forward")
            lead = self._rows_of(f, {n: values[n] for n in wanted})
            count = int(torch.Size(lead).numel())
            kept = row_filter.kept(values, lead, f"forward {f}") if len(lead) == 2 else None
            if kept is not None:
                count = int(kept.numel())
            self._forwards.append(f)
            self._starts.append(total)
            self._kept.append(kept)
            self._raw_starts.append(raw_total)
            raw_total += int(torch.Size(lead).numel())
            total += count
        self._len = total
        self._raw_len = raw_total
        self._raw: np.ndarray | None = None
        if layout == "stack":
            check_stackable(self.row_shapes, self.row_dtypes)
        self.scale: Scale | None = Scale.given(self.names, normalize)
        """Each site's normalization factor (rows are read multiplied by it), or None."""
        if normalize is True and self._len:
            sample = torch.randperm(self._len, generator=torch.Generator().manual_seed(0))
            self.scale = Scale.estimate(self._gather(sample[:NORM_SAMPLE].sort().values))

    def _rows_of(self, f: int, values: dict[str, Any]) -> tuple[int, ...]:
        """The sites' leading (row) dims in forward ``f``; checks row shapes and dtypes."""
        lead = 2 if self.rows == "tokens" else 1
        count: tuple[int, ...] | None = None
        for n, v in values.items():
            if not isinstance(v, torch.Tensor):
                raise DiskError(f"site {n!r} holds {type(v).__name__} values in forward {f}; "
                                "a dataset reads tensors (reference capture)")
            if v.dim() < lead:
                raise DiskError(f"site {n!r} has shape {tuple(v.shape)} in forward {f}: "
                                f"rows={self.rows!r} needs at least {lead} dims "
                                f"({'[batch, pos, ...]' if lead == 2 else '[batch, ...]'})")
            here = tuple(v.shape[:lead])
            if count is not None and here != count:
                raise DiskError(
                    f"forward {f}: the sites' leading dims differ "
                    f"({ {k: tuple(t.shape[:lead]) for k, t in values.items()} }); rows of "
                    "several sites need the same batch (and positions)")
            count = here
            shape = tuple(v.shape[lead:])
            if self.row_shapes.setdefault(n, shape) != shape:
                raise DiskError(f"site {n!r}: rows of shape {shape} in forward {f} but "
                                f"{self.row_shapes[n]} before; a dataset's rows have one shape")
            if self.row_dtypes.setdefault(n, v.dtype) != v.dtype:
                raise DiskError(f"site {n!r}: {v.dtype} values in forward {f} but "
                                f"{self.row_dtypes[n]} before; a dataset's rows have one dtype")
        assert count is not None
        return count

    def __len__(self) -> int:
        return self._len

    def _raw_rows(self, idx: np.ndarray) -> np.ndarray:
        """Dataset rows -> rows of the sites' row spaces (``Captures.rows``)."""
        if all(k is None for k in self._kept):
            return idx
        if self._raw is None:  # where each kept row lies, once: 8 bytes a row
            ends = [*self._raw_starts[1:], self._raw_len]
            parts = [start + (k.numpy() if k is not None else np.arange(end - start))
                     for start, end, k in zip(self._raw_starts, ends, self._kept, strict=True)]
            self._raw = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        return self._raw[idx]

    def _gather(self, idx: Any, into: Mapping[str, torch.Tensor] | None = None
                ) -> dict[str, torch.Tensor]:
        """Rows ``idx`` (1-d integers) of every name, stacked in that order: one gather per
        shard from the memory maps (:meth:`Captures.rows`), into ``into``'s tensors if given."""
        idx = np.asarray(idx, dtype=np.int64).reshape(-1)
        n = self._len
        if idx.size and not (-n <= int(idx.min()) and int(idx.max()) < n):
            bad = idx[(idx < -n) | (idx >= n)][0]
            raise IndexError(f"row {int(bad)} out of range: the dataset has {n} rows")
        if idx.size and int(idx.min()) < 0:
            idx = np.where(idx < 0, idx + n, idx)
        raw = self._raw_rows(idx)
        lead = 2 if self.rows == "tokens" else 1
        out: dict[str, torch.Tensor] = {}
        for name in self.names:
            have = self._caps.row_count(name, lead)
            # After caps.refresh(): rows added after the dataset's are fine where forwards
            # only append (one directory); anything else would move its rows.
            if have != self._raw_len and not (
                    have > self._raw_len and getattr(self._caps, "appends_only", False)):
                raise DiskError(f"site {name!r} has {have} rows in the captures but "
                                f"{self._raw_len} in the forwards this dataset was made from "
                                "(caps.refresh() saw new forwards of several ranks); make "
                                "the dataset again")
            out[name] = self._caps.rows(name, raw, lead) if into is None else \
                self._caps.rows(name, raw, lead, out=into[name])
        return out

    def _read(self, idx: Any, into: Mapping[str, torch.Tensor] | None = None
              ) -> dict[str, torch.Tensor]:
        """Rows ``idx`` of every name, normalized: what every read returns (written into
        ``into``'s tensors, scaled in place, if given)."""
        got = self._gather(idx, into)
        if self.scale is None:
            return got
        return self.scale.apply(got, in_place=into is not None)

    def _empty(self, n: int, pinned: bool = False) -> dict[str, torch.Tensor]:
        """Tensors for ``n`` rows of every name (what :meth:`_read` may write into)."""
        return {name: torch.empty((n, *self.row_shapes[name]), dtype=self.row_dtypes[name],
                                  pin_memory=pinned) for name in self.names}

    def _pack(self, values: dict[str, torch.Tensor]) -> Any:
        if self.layout == "stack":
            dim = -1 - len(self.row_shapes[self.names[0]])
            return torch.stack([values[n] for n in self.names], dim=dim)
        if self._single:
            return values[self.names[0]]
        return {k: values[n] for k, n in zip(self.keys, self.names, strict=True)}

    def denormalize(self, rows: Any) -> Any:
        """Rows as they were captured: undoes ``normalize=`` (a tensor, a dict by site, or a
        ``layout="stack"`` batch)."""
        if self.scale is None:
            return rows
        if self.layout == "stack":
            if not rows.is_floating_point():  # integer sites are not scaled
                return rows
            trailing = len(self.row_shapes[self.names[0]])
            f = torch.tensor([self.scale.factors[n] for n in self.names], dtype=rows.dtype)
            return rows / f.reshape(-1, *([1] * trailing))
        if isinstance(rows, Mapping):
            by_key = dict(zip(self.keys, self.names, strict=True))
            return {k: self.scale.undo(v, by_key[k]) if k in by_key else v
                    for k, v in rows.items()}
        return self.scale.undo(rows, self.names[0])

    def to_arrow(self, path: str | os.PathLike[str], batch_size: int = 65536) -> Path:
        """Write every row, in order, to an Arrow file that Hugging Face ``datasets`` reads
        (``datasets.Dataset.from_file(path)``): one column per site (fixed-size lists), the
        normalization factors in its metadata. Needs ``pyarrow``."""
        from .arrow import export_arrow

        return export_arrow(self, path, batch_size)

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs to read the same rows the same way: the sites, the number
        of rows and the normalization factors (the position is the sampler's:
        :class:`~fxprobe.RowSampler`)."""
        return {"names": list(self.names), "rows": self._len,
                "scale": dict(self.scale.factors) if self.scale is not None else None}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Take a saved state's normalization factors, after checking that it is of these
        sites and rows (``ConfigError`` if not)."""
        if list(state.get("names", ())) != list(self.names) or state.get("rows") != self._len:
            raise ConfigError(
                f"load_state_dict: the state is of sites {state.get('names')} with "
                f"{state.get('rows')} rows, this dataset of {list(self.names)} with "
                f"{self._len} rows; it resumes only the same rows (same captures and options)")
        scale = state.get("scale")
        self.scale = Scale({str(k): float(v) for k, v in scale.items()}) if scale else None

    def __getitem__(self, i: Any) -> Any:
        """Row ``i``; a list or 1-d tensor of rows gives them stacked (one batch):
        ``DataLoader(ds, batch_size=None, sampler=BatchSampler(...))`` reads that way."""
        idx, scalar = _indices(i)
        got = self._read(idx)
        return self._pack({n: v[0] for n, v in got.items()} if scalar else got)

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        """Many rows at once, as ``DataLoader`` asks for a batch: one gather per forward."""
        got = self._read(_indices(indices)[0])
        if self._single:
            return list(got[self.names[0]].unbind(0))
        if self.layout == "stack":
            return list(self._pack(got).unbind(0))
        rows = {n: v.unbind(0) for n, v in got.items()}
        return [{k: rows[n][p] for k, n in zip(self.keys, self.names, strict=True)}
                for p in range(len(indices))]

    def loader(self, batch_size: int, shuffle: bool = True, drop_last: bool = False,
               generator: torch.Generator | None = None, num_workers: int = 0,
               **kwargs: Any) -> Any:
        """Batches of rows: the fast way to read.

        Each batch is ``ds[rows]``, one gather per shard, with no collation of single rows;
        the rows of a batch are drawn as ``shuffle=True`` draws them (a permutation per
        epoch) and read in file order (a batch holds the same rows in another order, which a
        training step does not see). Batches are gathered into memory the loaders of this
        dataset share and reuse once nothing holds a batch made from it (a batch kept, or a
        tensor made from it, is never written again), so reading adds about two batches to
        the pages of the files read.

        Args:
            batch_size: rows per batch.
            shuffle: a new random permutation per epoch (else rows in order).
            drop_last: leave out a last, smaller batch.
            generator: the ``torch.Generator`` the permutations are drawn from.
            num_workers: threads of this process that gather the next batches while one is
                used (a gather is a copy from the memory maps that releases the GIL, so the
                threads share the maps and no batch crosses a process boundary, as it would
                from ``DataLoader``'s worker processes); 0: each batch read when asked for.
            **kwargs: with ``num_workers=0``, passed to ``DataLoader`` (``pin_memory``, ...);
                with threads, ``pin_memory`` (batches gathered into pinned memory) and
                ``prefetch_factor`` (batches ahead per thread, 2).

        Returns:
            ``DataLoader(rows, batch_size=None, sampler=...)`` (``rows.dataset`` is this
            dataset), or with threads an iterable
            of the same batches (``len()`` is the number of batches): ``[batch_size,
            *row_shape]`` (dicts of them for several names).

        Example:
            >>> for batch in ds.loader(4096, num_workers=2):
            ...     loss = sae_step(batch)
        """
        from torch.utils.data import DataLoader

        for bad in ("batch_size", "sampler", "batch_sampler", "collate_fn"):
            if bad in kwargs:
                raise ConfigError(f"ds.loader({bad}=...) is set by the loader; pass "
                                  f"DataLoader(ds, ...) yourself to choose it")
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
            raise ConfigError(f"ds.loader(num_workers={num_workers!r}): 0 or more threads")
        sampler = Batches(len(self), batch_size, shuffle, drop_last, generator)
        if num_workers == 0:
            rows = BufferedRows(self, shared_buffers(self, batch_size, 3))
            return DataLoader(rows, batch_size=None, sampler=sampler, **kwargs)
        unknown = sorted(set(kwargs) - {"pin_memory", "prefetch_factor"})
        if unknown:
            raise ConfigError(f"ds.loader(num_workers={num_workers}) gathers in threads and "
                              f"takes pin_memory= and prefetch_factor=, not {unknown}; pass "
                              "DataLoader(ds, batch_size=None, sampler=...) for worker "
                              "processes")
        pin = bool(kwargs.get("pin_memory", False))
        if pin and not torch.accelerator.is_available():  # as DataLoader: a warning, unpinned
            warnings.warn("ds.loader(pin_memory=True): no accelerator is found, so batches are "
                          "not pinned", UserWarning, stacklevel=2)
            pin = False
        return ThreadedBatches(self, sampler, num_workers, int(kwargs.get("prefetch_factor", 2)),
                               pin)

    def __repr__(self) -> str:
        what = self.names[0] if self._single else list(self.names)
        masked = f", mask={self.mask!r}" if self.mask else ""
        masked += ", normalized" if self.scale is not None else ""
        return f"CaptureDataset({what!r}, rows={self.rows!r}{masked}, {self._len} rows)"


def resolve_names(resolve: Callable[[str], str], names: str | Sequence[str], mask: str | None,
                  options: Any) -> tuple[str | list[str], str | None]:
    """The site names a dataset's arguments mean (canonical ones mapped by ``resolve``);
    ``options`` (``tokens=``, ``normalize={site: f}``) is updated in place."""
    def one(n: Any) -> Any:
        return resolve(n) if isinstance(n, str) else n

    if isinstance(options.get("tokens"), str):
        options["tokens"] = resolve(options["tokens"])
    scale = options.get("normalize")
    if isinstance(scale, Mapping):
        options["normalize"] = {one(k): v for k, v in scale.items()}
    return (one(names) if isinstance(names, str) else [one(n) for n in names]), one(mask)


def _indices(i: Any) -> tuple[torch.Tensor, bool]:
    """Row numbers as a 1-d long tensor, and whether ``i`` was one number.

    Integers only (Python, numpy or torch; scalars, sequences, 1-d arrays): a bool mask or
    float would be converted to other row numbers, a nested list flattened."""
    what = "dataset rows are read by an int or a 1-d sequence (list, tensor, array) of ints"
    if isinstance(i, (bool, str, bytes)):
        raise TypeError(f"{what}, not {i!r}")
    if not isinstance(i, torch.Tensor):
        try:
            return torch.tensor([operator.index(i)], dtype=torch.long), True
        except TypeError:
            pass
    try:
        t = torch.as_tensor(i) if isinstance(i, torch.Tensor) or len(i) else \
            torch.empty(0, dtype=torch.long)
    except (TypeError, ValueError, RuntimeError) as e:
        raise TypeError(f"{what}, not {type(i).__name__} ({e})") from None
    if t.dtype == torch.bool or t.is_floating_point() or t.is_complex():
        raise TypeError(f"{what}, not {t.dtype} indices (for a bool mask m pass "
                        "m.nonzero().flatten(); floats are not row numbers)")
    if t.dim() > 1:
        raise TypeError(f"{what}, not indices of shape {tuple(t.shape)}")
    return t.to(torch.long).reshape(-1), t.dim() == 0
