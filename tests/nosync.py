"""A test helper that fails on anything that would make the host wait for an accelerator.

There is no GPU in CI, so a real synchronisation cannot be observed. Instead,
:func:`forbid_sync` intercepts, through a ``TorchFunctionMode``, every tensor operation that
*would* block the host on a device: reading values into Python (``.item()``, ``.tolist()``,
``bool(t)``, ``float(t)``, ``print(t)``), copies to the host (``.cpu()``, ``.numpy()``,
``.to("cpu")``), and ops whose output shape depends on values (``nonzero``, boolean-mask
indexing, ``unique``). On a CUDA machine it also turns on ``torch.cuda.set_sync_debug_mode``.

Example:
    >>> with forbid_sync():
    ...     v = stats_vector(t)      # raises SyncError if it synchronises
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

# Tensor methods and torch functions that read device values on the host.
_READS = frozenset({
    "item", "tolist", "numpy", "cpu", "__bool__", "__float__", "__int__", "__index__",
    "__complex__", "__repr__", "__str__", "__format__", "is_nonzero", "equal", "allclose",
    "__array__",
})
# Ops whose output size depends on the values, so the host must wait to allocate it.
_DATA_DEPENDENT = frozenset({
    "nonzero", "argwhere", "masked_select", "unique", "unique_consecutive", "bincount",
})


class SyncError(AssertionError):
    """A tensor operation that would synchronise with the device ran under forbid_sync()."""


def _is_cpu_target(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    for a in (*args[1:], kwargs.get("device")):
        if isinstance(a, (str, torch.device)) and torch.device(a).type == "cpu":
            return True
    return False


def _has_bool_index(args: tuple[Any, ...]) -> bool:
    index = args[1] if len(args) > 1 else None
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


class _ForbidSync(TorchFunctionMode):
    def __init__(self, forbid: bool = True) -> None:
        super().__init__()
        self.forbid = forbid
        self.calls: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        self.calls.append(name)
        why = None
        if name in _READS:
            why = "reads tensor values on the host"
        elif name in _DATA_DEPENDENT:
            why = "has an output shape that depends on tensor values"
        elif name == "to" and _is_cpu_target(args, kwargs):
            why = "copies to the host"
        elif name in ("__getitem__", "__setitem__") and _has_bool_index(args):
            why = "indexes with a boolean mask (data-dependent shape)"
        if why is not None and self.forbid:
            raise SyncError(f"torch op {name!r} {why}: it would block the host on a GPU")
        return func(*args, **kwargs)


@contextlib.contextmanager
def record_ops() -> Iterator[list[str]]:
    """Forbid nothing; yield the list of the names of the torch ops that run (for counting)."""
    mode = _ForbidSync(forbid=False)
    with mode:
        yield mode.calls


@contextlib.contextmanager
def forbid_sync() -> Iterator[list[str]]:
    """Raise :class:`SyncError` on any op that would synchronise; yields the op names seen.

    On a CPU, fxprobe's statistics read values on the host (free there, see
    ``fxprobe.capture.stats.cpu.CPU_HOST_READS``); inside this context that path is off, so the code
    that runs on a CPU is the code a GPU runs, and that is what gets checked."""
    from fxprobe.capture.stats import cpu as _stats_cpu

    mode = _ForbidSync()
    cuda = torch.cuda.is_available()
    old = torch.cuda.get_sync_debug_mode() if cuda else 0
    if cuda:
        torch.cuda.set_sync_debug_mode("error")
    host_reads, _stats_cpu.CPU_HOST_READS = _stats_cpu.CPU_HOST_READS, False
    try:
        with mode:
            yield mode.calls
    finally:
        _stats_cpu.CPU_HOST_READS = host_reads
        if cuda:
            torch.cuda.set_sync_debug_mode(old)
