"""``fxprobe.ActivationStream``: shuffled batches of activation rows straight from a tapped model.

SAELens's ``ActivationsStore`` in fxprobe's terms: a mixing buffer holds the rows of about
``buffer`` forwards; when fewer than ``refill`` of it remain, the model runs on the next inputs
until it is full again, the buffer is shuffled, and batches are handed out from it until it is
low again. Rows of one forward therefore reach the trainer mixed with those of up to ``buffer``
others, without being written anywhere first; tap the model with ``to=fxprobe.Disk(path)`` to
keep them on disk as well (the tapped module's sink writes each forward as usual).

The buffer lives on the device the values are computed on; a batch is a copy (the buffer is
overwritten by later forwards). Which rows a forward gives and how they are scaled is
``sinks/rows.py``, shared with the Disk dataset: the same options read the same rows.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Unpack

import torch

from ..core.errors import ConfigError, DiskError, SiteNotRunError
from ..sinks.dataset import Layout, RowOptions, Rows
from ..sinks.rows import RowFilter, Scale, check_stackable
from .trail import InputTrail


def _call(model: Any, item: Any) -> Any:
    """Run ``model`` on one item of ``inputs``: a dict is keywords, a tuple or list positional
    arguments, anything else the one argument."""
    if isinstance(item, Mapping):
        return model(**item)
    if isinstance(item, (tuple, list)):
        return model(*item)
    return model(item)


class ActivationStream:
    """Shuffled batches of rows of captured sites, from a tapped model run on ``inputs``.

    Args:
        tapped: ``fxprobe.tap(model, ops=[...])`` selecting ``names`` (and the ``mask=`` and
            ``tokens=`` sites, when used); with ``to=fxprobe.Disk(path)`` every forward is
            written to disk as well.
        names: a site name (batches are tensors) or several (dicts by name, or with
            ``layout="stack"`` tensors ``(batch, n_sites, *row)``); canonical names
            (``"blocks.6.resid_post"``) work as ``tapped.taps`` reads them.
        inputs: what to run the model on, one forward per item (a dict: keywords; a tuple:
            positional arguments; else the one argument); iterated once per epoch.
        batch_size: rows per batch.
        buffer: forwards' worth of rows held for mixing (SAELens's ``n_batches_in_buffer``).
        refill: the fraction of the buffer below which it is refilled (the rows kept for
            mixing with the next forwards).
        seed: the shuffle's seed; epoch ``e`` shuffles with ``seed + e``.
        rows: ``"tokens"`` (one row per ``[batch, pos]``) or ``"samples"`` (per batch element).
        mask: a site holding a ``[batch, pos]`` mask (the model's ``attention_mask``, tapped
            with the rest): padded positions give no rows.
        drop_last: leave out the epoch's last batch when it is short.
        **options: ``positions=``, ``exclude_token_ids=``, ``tokens=``, ``normalize=``,
            ``layout=``, as ``Captures.dataset`` takes them (the normalization factor is
            estimated on the first full buffer).

    ``state_dict()`` between batches holds where the epoch stands (the inputs consumed, the
    rows in the buffer, the shuffle's generator, the factors); ``load_state_dict`` on a new
    stream over the same inputs continues with the same batches. Inputs with a
    ``state_dict()`` of their own (torchdata's ``StatefulDataLoader``) are restored to theirs;
    other inputs are iterated again and the inputs the epoch had run skipped, after checking
    that they are the same ones in the same order (a ``DataLoader(shuffle=True)`` draws a new
    order each time: ``ConfigError``, never some inputs twice and others not at all).

    Example:
        >>> tapped = fxprobe.tap(model, ops=["blocks.6.resid_post", "attention_mask"])
        >>> for batch in fxprobe.ActivationStream(tapped, "blocks.6.resid_post", loader,
        ...                                       mask="attention_mask", batch_size=4096):
        ...     sae_step(batch)
    """

    def __init__(self, tapped: Any, names: str | Sequence[str], inputs: Iterable[Any], *,
                 batch_size: int = 4096, buffer: int = 16, refill: float = 0.5, seed: int = 0,
                 rows: Rows = "tokens", mask: str | None = None, drop_last: bool = False,
                 **options: Unpack[RowOptions]) -> None:
        for what, v in (("batch_size", batch_size), ("buffer", buffer)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"ActivationStream({what}={v!r}) must be a positive int")
        if isinstance(refill, bool) or not isinstance(refill, (int, float)) or \
                not 0 <= refill < 1:
            raise ConfigError(f"ActivationStream(refill={refill!r}) must be in [0, 1): the "
                              "fraction of the buffer kept to mix with the next forwards")
        if rows not in ("tokens", "samples"):
            raise ConfigError(f"ActivationStream(rows={rows!r}): 'tokens' or 'samples'")
        if not hasattr(tapped, "taps") or not callable(tapped):
            raise ConfigError("ActivationStream needs a tapped module: "
                              "fxprobe.tap(model, ops=[...the sites, the mask...])")
        wanted = (names,) if isinstance(names, str) else tuple(names)
        if not wanted or not all(isinstance(n, str) for n in wanted):
            raise ConfigError(f"ActivationStream(names={names!r}): a site name or a list")
        unknown = set(options) - set(RowOptions.__annotations__)
        if unknown:
            raise ConfigError(f"ActivationStream got unknown options {sorted(unknown)}")
        self.filter = RowFilter.make(mask, options.get("tokens", "input_ids"),
                                     options.get("exclude_token_ids"),
                                     options.get("positions"))
        if self.filter.active and rows != "tokens":
            raise ConfigError("mask=, exclude_token_ids=, positions= leave out [batch, pos] "
                              "positions: they need rows='tokens'")
        layout: Layout = options.get("layout", "dict")
        if layout not in ("dict", "stack"):
            raise ConfigError(f"ActivationStream(layout={layout!r}): 'dict' or 'stack'")
        self.tapped = tapped
        self.names = wanted
        self.inputs = inputs
        self.batch_size = batch_size
        self.buffer = buffer
        self.refill = float(refill)
        self.seed = seed
        self.rows: Rows = rows
        self.drop_last = bool(drop_last)
        self.layout: Layout = layout
        self._single = isinstance(names, str) and layout == "dict"
        normalize = options.get("normalize", False)
        self._estimate = normalize is True
        self.scale: Scale | None = Scale.given(wanted, normalize)
        """Each site's normalization factor (batches are multiplied by it), or None."""
        self.epoch = 0
        self._resume: dict[str, Any] | None = None
        self._loaded: dict[str, Any] | None = None  # a state loaded, not yet iterated from
        self._state: dict[str, Any] = self._fresh()
        self._store: dict[str, torch.Tensor] = {}
        self._gen: torch.Generator | None = None
        self._run: object = None
        self._spent: object = None  # the iterator given as inputs, once an epoch began on it
        self._trail = InputTrail()  # the inputs this epoch ran, in order

    # -- one epoch --------------------------------------------------------------------------
    def _fresh(self) -> dict[str, Any]:
        return {"consumed": 0, "count": 0, "forwards": 0, "rows_seen": 0, "done": False,
                "phase": "fill"}

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` from its beginning at the next iteration; after
        :meth:`load_state_dict`, ``set_epoch`` of the restored epoch keeps its place (the
        ``DistributedSampler`` loop calls it before each epoch, the resumed one too)."""
        if int(epoch) != self.epoch:
            self._resume = self._loaded = None
        self.epoch = int(epoch)

    def __iter__(self) -> Iterator[Any]:
        resume, self._resume, self._loaded = self._resume, None, None
        st = self._fresh()
        store: dict[str, torch.Tensor] = {}
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        trail = InputTrail()
        if resume is not None:
            st.update(resume["progress"])
            store = {n: t.clone() for n, t in resume["buffer"].items()}
            g.set_state(resume["rng"])
            if resume["inputs"] is not None:  # the inputs resume themselves
                self.inputs.load_state_dict(resume["inputs"])  # type: ignore[attr-defined]
                trail = InputTrail(resume["trail"])
        self._state, self._store, self._gen, self._trail = st, store, g, trail
        token = self._run = object()  # a later iteration takes the buffer over
        items = iter(self.inputs)
        if items is self.inputs:  # an iterator (a generator): one pass over it, ever
            if self._spent is items:
                raise ConfigError(
                    "ActivationStream(inputs=...) is an iterator that an earlier epoch ran "
                    "through: this epoch would have no rows. Pass inputs that can be iterated "
                    "again (a list, a DataLoader), or set stream.inputs to a new iterator")
            self._spent = items
        if resume is not None and resume["inputs"] is None:
            self._skip(items, st["consumed"], resume["trail"])
        while True:
            if st["phase"] == "fill":
                target = self._target()
                while not st["done"] and (st["count"] < target or not st["forwards"]):
                    item = next(items, _END)
                    if item is _END:
                        st["done"] = True
                        break
                    trail.add(item)
                    self._add(item)
                    st["consumed"] += 1
                    if not st["forwards"] and st["consumed"] >= _NO_SITE_LIMIT:
                        self._none_ran()  # inputs may never end: say so early
                    target = self._target()
                if st["count"] == 0:
                    break
                self._shuffle()
                st["phase"] = "yield"
            floor = 0 if st["done"] else int(self.refill * self._cap())
            while st["count"] - self.batch_size >= floor or (st["done"] and st["count"]):
                if st["done"] and st["count"] < self.batch_size and self.drop_last:
                    st["count"] = 0
                    break
                yield self._take()
                if self._run is not token:
                    raise ConfigError(
                        "this ActivationStream was iterated again while an earlier iteration "
                        "was still running: they share one buffer, so the earlier one stops "
                        "here. Iterate one at a time (or make a stream per consumer)")
            st["phase"] = "fill"
            if st["done"] and not st["count"]:
                break
        if st["consumed"] and not st["forwards"]:
            self._none_ran()
        self.epoch += 1
        self._state, self._store, self._trail = self._fresh(), {}, InputTrail()

    def _skip(self, items: Iterator[Any], consumed: int, saved: list[int] | None) -> None:
        """Skip the ``consumed`` inputs a resumed epoch already ran, checking they are the
        ones the saved epoch ran (``saved``: its :class:`InputTrail`; None in a state saved
        before fxprobe kept one)."""
        for _ in range(consumed):
            item = next(items, _END)
            if item is _END:
                raise ConfigError(f"load_state_dict: the state consumed {consumed} "
                                  "inputs of this epoch; these inputs have fewer")
            self._trail.add(item)
        if saved is not None and self._trail.opaque:
            raise ConfigError(
                f"load_state_dict: the inputs hold {self._trail.opaque} objects, which fxprobe "
                "cannot compare by value, so it cannot check that the inputs it would skip are "
                "the ones the saved stream ran. Pass inputs of tensors (in dicts, lists, "
                "tuples, dataclasses), or inputs that resume themselves (torchdata's "
                "StatefulDataLoader: the stream saves and restores its state_dict())")
        if saved is not None and self._trail.state() != list(saved):
            raise ConfigError(
                f"load_state_dict: the first {consumed} inputs of this epoch are not the ones "
                "the saved stream ran (other items, or another order: a DataLoader with "
                "shuffle=True draws a new order each time it is iterated), so skipping them "
                "would run some inputs twice in the epoch and others never. Pass inputs that "
                "come in the same order each time (a list; a DataLoader whose sampler is "
                "seeded per epoch), or inputs that resume themselves (torchdata's "
                "StatefulDataLoader: the stream saves and restores its state_dict())")

    def _none_ran(self) -> None:
        raise ConfigError(f"ActivationStream: none of the {self._state['consumed']} forwards "
                          f"of epoch {self.epoch} gave the sites {list(self.names)} a value (a "
                          "branch not taken; tapped.taps after a forward shows what ran): "
                          "there are no rows to give")

    def _cap(self) -> int:
        """Rows in a full buffer: ``buffer`` forwards of the mean size seen so far."""
        st = self._state
        return max(1, round(self.buffer * st["rows_seen"] / max(st["forwards"], 1)))

    def _target(self) -> int:
        cap = self._cap()
        return max(cap, int(self.refill * cap) + self.batch_size)

    def _add(self, item: Any) -> None:
        """Run one forward and append the rows it gives."""
        with torch.no_grad():
            _call(self.tapped, item)
        taps = self.tapped.taps
        st = self._state
        values: dict[str, torch.Tensor] = {}
        ran = [n for n in self.names if not _not_run(taps, n)]
        if not ran:  # a forward that did not reach the sites gives no rows (as on Disk)
            return
        if len(ran) != len(self.names):
            raise DiskError(f"forward {st['consumed']} of epoch {self.epoch} ran {ran} but "
                            f"not {[n for n in self.names if n not in ran]}: rows of several "
                            "sites need every one of them in every forward")
        for n in (*self.names, *self.filter.sites()):
            try:
                v = taps[n]
            except LookupError as e:
                raise ConfigError(f"ActivationStream: {e}. Tap it with the rest: "
                                  f"fxprobe.tap(model, ops=[..., {n!r}])") from None
            if not isinstance(v, torch.Tensor):
                raise DiskError(f"site {n!r} holds {type(v).__name__} values: a stream reads "
                                "tensors (reference capture, no reduce=)")
            values[n] = v
        lead_dims = 2 if self.rows == "tokens" else 1
        first = values[self.names[0]]
        lead = tuple(first.shape[:lead_dims])
        where = f"forward {st['consumed']} of epoch {self.epoch}"
        for n in self.names:
            v = values[n]
            if v.dim() < lead_dims or tuple(v.shape[:lead_dims]) != lead:
                raise DiskError(f"site {n!r} has shape {tuple(v.shape)} in {where}; rows="
                                f"{self.rows!r} needs every site to share its leading dims "
                                f"{list(lead)}")
        kept = self.filter.kept(values, lead, where)
        flat = {n: values[n].detach().flatten(0, lead_dims - 1) for n in self.names}
        if kept is not None:
            kept = kept.to(first.device)
        r = int(kept.numel()) if kept is not None else int(flat[self.names[0]].shape[0])
        st["forwards"] += 1
        st["rows_seen"] += r
        count = st["count"]
        need = count + r
        for n, v in flat.items():
            s = self._store.get(n)
            if s is not None and (s.shape[1:] != v.shape[1:] or s.dtype != v.dtype):
                raise DiskError(f"site {n!r}: rows of {v.dtype} {tuple(v.shape[1:])} in "
                                f"{where} but {s.dtype} {tuple(s.shape[1:])} before")
            if s is None or s.shape[0] < need:
                grown = torch.empty((max(need, self._target() + r, 2 * count), *v.shape[1:]),
                                    dtype=v.dtype, device=v.device)
                if s is not None:
                    grown[:count] = s[:count]
                self._store[n] = s = grown
            if kept is None:
                s[count:need] = v
            else:
                torch.index_select(v, 0, kept, out=s[count:need])
        if self.layout == "stack":
            check_stackable({n: tuple(s.shape[1:]) for n, s in self._store.items()},
                            {n: s.dtype for n, s in self._store.items()})
        st["count"] = need

    def _shuffle(self) -> None:
        count = self._state["count"]
        assert self._gen is not None
        perm = torch.randperm(count, generator=self._gen)
        for s in self._store.values():
            s[:count] = s[:count][perm.to(s.device)]
        if self._estimate and self.scale is None:  # the first full buffer is the sample
            self.scale = Scale.estimate({n: s[:count] for n, s in self._store.items()})

    def _take(self) -> Any:
        st = self._state
        count = st["count"]
        begin = max(0, count - self.batch_size)
        batch = {n: s[begin:count].clone() for n, s in self._store.items()}
        st["count"] = begin
        if self.scale is not None:
            batch = self.scale.apply(batch)
        if self.layout == "stack":
            return torch.stack([batch[n] for n in self.names], dim=1)
        return batch[self.names[0]] if self._single else batch

    # -- state ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Where the stream stands: epoch, inputs consumed in it, the buffer's rows (on the
        CPU), the shuffle's generator and the normalization factors."""
        if self._loaded is not None:  # loaded, not iterated yet: still that place
            return dict(self._loaded)
        st = self._state
        store = self._store
        rng = self._gen.get_state() if self._gen is not None else None
        return {"epoch": self.epoch, "seed": self.seed, "names": list(self.names),
                "batch_size": self.batch_size, "buffer": self.buffer, "refill": self.refill,
                "progress": dict(st),
                "rows": {n: s[:st["count"]].cpu().clone() for n, s in store.items()},
                "rng": rng,
                "scale": dict(self.scale.factors) if self.scale is not None else None,
                "trail": self._trail.state(),
                "inputs": self.inputs.state_dict()  # type: ignore[attr-defined]
                if _resumable(self.inputs) else None}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state`` at the next iteration (``ConfigError`` if it is of other
        sites or settings)."""
        for key in ("seed", "names", "batch_size", "buffer", "refill"):
            mine = list(self.names) if key == "names" else getattr(self, key)
            if state.get(key) != mine:
                raise ConfigError(f"ActivationStream.load_state_dict: the state has {key}="
                                  f"{state.get(key)!r} where this stream has {mine!r}")
        self.epoch = int(state["epoch"])
        scale = state.get("scale")
        self.scale = Scale({str(k): float(v) for k, v in scale.items()}) if scale else \
            (None if self._estimate else self.scale)
        progress = dict(state["progress"])
        if state["rng"] is None or not progress["consumed"]:
            self._resume = None  # at an epoch's start
            self._loaded = dict(state)  # what state_dict() gives until the next iteration
            return
        # Even after the epoch's last batch: the next iteration then ends that epoch (no
        # batch, as the original's would) and the one after is the next epoch.
        device = self._device()
        inputs = state.get("inputs")
        if inputs is not None and not _resumable(self.inputs):
            raise ConfigError("load_state_dict: the state holds its inputs' state_dict() (a "
                              "StatefulDataLoader's) but this stream's inputs have none: pass "
                              "the same kind of inputs")
        self._resume = {"progress": progress, "rng": state["rng"], "inputs": inputs,
                        "trail": state.get("trail"),
                        "buffer": {n: t.to(device) for n, t in state["rows"].items()}}
        self._loaded = dict(state)

    def _device(self) -> torch.device:
        p = next(iter(getattr(self.tapped, "parameters", lambda: iter(()))()), None)
        return p.device if p is not None else torch.device("cpu")

    def __repr__(self) -> str:
        what = self.names[0] if self._single else list(self.names)
        return (f"ActivationStream({what!r}, batch_size={self.batch_size}, buffer="
                f"{self.buffer}, refill={self.refill}, epoch={self.epoch})")


def _not_run(taps: Any, name: str) -> bool:
    """Whether the selected site ``name`` did not run in the last forward (a branch)."""
    try:
        taps[name]
    except SiteNotRunError:
        return True
    except LookupError:
        return False  # not a site: reported as such where it is read
    return False


_END = object()
_NO_SITE_LIMIT = 256
"""Forwards run without a value at the sites before a stream says so (inputs may be endless)."""


def _resumable(inputs: Any) -> bool:
    """Whether ``inputs`` save and restore their own place (torchdata's
    ``StatefulDataLoader``, Hugging Face's ``IterableDataset``): a ``state_dict`` and a
    ``load_state_dict`` on an object with its own ``__iter__``. One without (a map-style
    dataset, ``CaptureDataset`` among them) is iterated by index from its first item each
    time: its state_dict is its settings, not a place; nor is a module's. accelerate's
    ``DataLoaderShard`` has the methods, which raise unless ``use_stateful_dataloader``."""
    return callable(getattr(inputs, "state_dict", None)) and \
        callable(getattr(inputs, "load_state_dict", None)) and \
        hasattr(type(inputs), "__iter__") and not isinstance(inputs, torch.nn.Module) and \
        getattr(inputs, "use_stateful_dataloader", True) is not False
