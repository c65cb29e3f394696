"""Which inputs a stream's epoch ran, in order: what a resumed epoch checks before it skips them.

``ActivationStream.load_state_dict`` continues an epoch by iterating the inputs again and
skipping as many as the saved epoch had run. That is right only if the inputs come in the same
order again; a ``DataLoader(shuffle=True)`` draws a new order each time it is iterated, so the
skipped inputs would be other ones: some run twice in the epoch, others never, and nothing
would say so. :class:`InputTrail` is an order-sensitive checksum of the items run: the state
keeps it, and the resumed stream computes it over the items it skips and compares.

The checksum reads every tensor's bits (floating point reinterpreted as integers, so it is
exact) in order (inputs holding the same values in other places, as one-hot or permuted
inputs do, differ): a CPU tensor's by the CRC-32 of its bytes, any other's with each element
mixed with its index, reduced on the tensor's own device without reading the result back: one
read when the state is saved and one when a resumed epoch has skipped its inputs, never per
forward. Mappings of any kind (a tokenizer's ``BatchEncoding``), sequences,
dataclasses and NumPy arrays are walked into; other objects cannot be compared by value
(:attr:`InputTrail.opaque` names them, and a resumed epoch refuses to skip them).
"""

from __future__ import annotations

import dataclasses
import enum
import zlib
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch.utils._pytree import SUPPORTED_NODES, tree_flatten

_MOD = 2_147_483_647  # 2**31 - 1: every product below stays below 2**63
_MUL = 1_000_003
_A, _B, _C, _D = 48_271, 69_621, 40_692, 16_807
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_PLAIN = (str, bytes, int, float, complex, bool, type(None), torch.dtype, torch.device,
          slice, range, enum.Enum)


def _real(t: torch.Tensor) -> torch.Tensor:
    """``t`` with its conjugate and negative bits resolved, complex as pairs of reals."""
    t = t.resolve_conj().resolve_neg()
    return torch.view_as_real(t) if t.is_complex() else t


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements as int64 (its bits where it is not integer), flat, in order."""
    if t.layout != torch.strided:
        t = t.to_dense()
    t = _real(t)
    if t.dtype == torch.bool:
        t = t.to(torch.uint8)
    elif t.is_floating_point():
        t = t.contiguous().view(_BITS[t.element_size()])
    return t.reshape(-1).to(torch.int64)


def _tensor_sum(t: torch.Tensor) -> torch.Tensor:
    """A checksum of ``t``'s elements and their places, mod ``_MOD``: a 0-d int64 tensor on
    ``t``'s device (each element mixed with its index, not multiplied: values equal in other
    places, or sums equal in other values, differ)."""
    v = _bits(t).remainder(_MOD)
    j = torch.arange(v.numel(), device=v.device, dtype=torch.int64).mul_(_B).remainder_(_MOD)
    z = (v * _A + j + _C).remainder_(_MOD)
    z = (z * z).remainder_(_MOD).mul_(_D).add_(v).remainder_(_MOD)
    return z.sum().remainder(_MOD)


def _crc(t: torch.Tensor) -> int:
    """The CRC-32 of a CPU tensor's bytes in order (its bits where it is not integer)."""
    return zlib.crc32(_real(t).contiguous().reshape(-1).view(torch.uint8).numpy().data)


class InputTrail:
    """An order-sensitive checksum of the items given to :meth:`add`."""

    def __init__(self, state: list[int] | None = None) -> None:
        self._py, saved = (state[0], state[1]) if state else (0, 0)
        self._acc: torch.Tensor | int = saved  # a 0-d tensor on the inputs' device, or an int
        self.opaque: str | None = None
        """The type of the first input part not compared by value (not a tensor, mapping,
        sequence, dataclass, array or plain value), if any."""

    def add(self, item: Any) -> None:
        desc: list[str] = []
        tensors: list[torch.Tensor] = []
        try:
            self._walk(item, desc, tensors)
        except Exception:  # an input part that cannot be read: never fail a forward
            desc.append("unreadable")
            self.opaque = self.opaque or type(item).__qualname__
        self._py = (self._py * _MUL + zlib.crc32("\x1f".join(desc).encode())) % _MOD
        for x in tensors:
            if x.device.type == "cpu" and x.layout == torch.strided:
                try:  # on the host: the CRC-32 of its bytes (about 4 GB/s, no temporaries)
                    self._py = (self._py * _MUL + _crc(x.detach())) % _MOD
                    continue
                except Exception:  # a dtype numpy cannot view as bytes: the sum below
                    pass
            try:
                s = _tensor_sum(x.detach())
            except Exception:  # a layout or dtype without these ops: never fail a forward
                self.opaque = self.opaque or f"{x.layout} {x.dtype} tensor"
                continue
            acc = self._acc
            if isinstance(acc, torch.Tensor) and acc.device != s.device:
                if s.device.type == "cpu":  # host to device: staged before the call returns
                    s = s.to(acc.device, non_blocking=True)
                else:  # never a non-blocking copy to the host read before it lands
                    acc = acc.to(s.device, non_blocking=True)
            self._acc = (acc * _MUL + s).remainder(_MOD)

    def _walk(self, x: Any, desc: list[str], tensors: list[torch.Tensor]) -> None:
        if isinstance(x, torch.Tensor):
            if x.is_nested:
                desc.append(f"nested {x.dtype} {x.size(0)}")
                for part in x.unbind():
                    self._walk(part, desc, tensors)
                return
            if x.layout == torch.sparse_coo:
                x = x.detach().coalesce()
                desc.append(f"coo {x.dtype} {tuple(x.shape)}")
                tensors.extend((x.indices(), x.values()))
                return
            desc.append(f"{x.layout} {x.dtype} {tuple(x.shape)}")
            if x.numel():
                tensors.append(x)
        elif isinstance(x, _PLAIN):
            desc.append(f"{type(x).__name__} {x!r}")
        elif isinstance(x, np.ndarray) and x.dtype.kind in "biufc":
            native = x.astype(x.dtype.newbyteorder("="), copy=False)
            desc.append(f"ndarray {native.dtype}")
            self._walk(torch.from_numpy(np.ascontiguousarray(native)), desc, tensors)
        elif isinstance(x, (np.ndarray, np.generic)):
            desc.append(f"numpy {x.dtype}")
            self._walk(x.tolist(), desc, tensors)
        elif isinstance(x, Mapping):
            desc.append(f"{type(x).__name__} {len(x)}")
            for k, v in x.items():
                self._walk(k, desc, tensors)
                self._walk(v, desc, tensors)
        elif isinstance(x, (list, tuple)):
            desc.append(f"{type(x).__name__} {len(x)}")
            for v in x:
                self._walk(v, desc, tensors)
        elif dataclasses.is_dataclass(x) and not isinstance(x, type):
            desc.append(type(x).__qualname__)
            for f in dataclasses.fields(x):
                self._walk(f.name, desc, tensors)
                self._walk(getattr(x, f.name), desc, tensors)
        elif type(x) in SUPPORTED_NODES:  # a pytree node torch knows (a model output, ...)
            leaves, spec = tree_flatten(x)
            desc.append(str(spec))
            for v in leaves:
                self._walk(v, desc, tensors)
        else:
            desc.append(f"opaque {type(x).__qualname__}")
            self.opaque = self.opaque or type(x).__qualname__

    def state(self) -> list[int]:
        """The checksum as two ints (reads the tensors' part back: one device sync)."""
        return [self._py, int(self._acc)]
