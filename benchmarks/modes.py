"""The capture modes, as a table: what ``fxprobe.tap`` is given, and what a hook does instead.

Each :class:`Mode` names the keyword arguments of ``fxprobe.tap`` that select it and the work
an equivalent forward hook does, so that taps and hooks are compared doing the same thing. A mode
whose arguments this build of fxprobe does not accept is reported as unavailable, not skipped.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import fxprobe

Store = list[Any]
Hook = Callable[[nn.Module, Any, Any], Any]


def _stats_function() -> Callable[[torch.Tensor], torch.Tensor]:
    """fxprobe's own on-device statistics, so that hooks compute exactly what taps compute."""
    found = getattr(fxprobe, "stats_vector", None)
    if found is not None:
        return found  # type: ignore[no-any-return]

    def stats_vector(t: torch.Tensor) -> torch.Tensor:
        # An fxprobe without statistics: the obvious on-device equivalent.
        x = t.detach().float().reshape(-1)
        std, mean = torch.std_mean(x)
        lo, hi = torch.aminmax(x)
        return torch.stack([mean, std, lo, hi])
    return stats_vector


def _reference(store: Store, detach: bool) -> Hook:
    if detach:
        def hook(m: nn.Module, args: Any, out: Any) -> None:
            store.append(out.detach())
    else:
        def hook(m: nn.Module, args: Any, out: Any) -> None:
            store.append(out)
    return hook


def _clone(store: Store, detach: bool) -> Hook:
    def hook(m: nn.Module, args: Any, out: Any) -> None:
        store.append(out.detach().clone())
    return hook


def _stats(store: Store, detach: bool) -> Hook:
    stats = _stats_function()

    def hook(m: nn.Module, args: Any, out: Any) -> None:
        store.append(stats(out))
    return hook


def _offload(store: Store, detach: bool) -> Hook:
    def hook(m: nn.Module, args: Any, out: Any) -> None:
        if out.device.type == "cpu":
            store.append(out.detach())  # already in host memory, as fxprobe keeps it
        else:
            host = torch.empty(out.shape, dtype=out.dtype, pin_memory=True)
            store.append(host.copy_(out.detach(), non_blocking=True))
    return hook


def _intervene(store: Store, detach: bool) -> Hook:
    def hook(m: nn.Module, args: Any, out: Any) -> Any:
        store.append(out.detach() if detach else out)
        return out.view_as(out)  # a replacement that costs no device time
    return hook


def _replace(site: Any, value: Any) -> Any:
    """The benchmark's intervention: replace each value by a view of itself (no device work)."""
    return value.view_as(value) if isinstance(value, torch.Tensor) else None


@dataclass(frozen=True)
class Mode:
    """One capture mode."""

    name: str
    """Name in the results (``reference``, ``clone``, ...)."""
    description: str
    """What is kept, one line."""
    tap_kwargs: Callable[[torch.device], dict[str, Any]]
    """Keyword arguments of ``fxprobe.tap`` for this mode, on a device."""
    hook: Callable[[Store, bool], Hook]
    """``(store, detach)`` -> a forward hook doing the same work (appending to ``store``)."""


MODES: dict[str, Mode] = {
    m.name: m
    for m in (
        Mode("reference", "the value itself (fxprobe copies only where an in-place op follows)",
             lambda dev: {}, _reference),
        Mode("clone", "a copy of every value (copy='always')",
             lambda dev: {"copy": "always"}, _clone),
        Mode("stats", "statistics computed on the device (reduce='stats')",
             lambda dev: {"reduce": "stats"}, _stats),
        Mode("offload", "a copy in host memory (to='cpu', non-blocking)",
             lambda dev: {"to": "cpu"}, _offload),
        Mode("intervention", "a callback that returns a replacement (fn=...), here a view",
             lambda dev: {"fn": _replace}, _intervene),
    )
}


def availability(mode: Mode, device: torch.device) -> str | None:
    """None when this fxprobe build accepts ``mode``; otherwise why not (reported as is)."""
    probe = nn.Sequential(nn.Linear(2, 2), nn.ReLU()).to(device)
    try:
        tapped = fxprobe.tap(probe, ops=nn.ReLU, **mode.tap_kwargs(device))
        with torch.no_grad():
            tapped(torch.zeros(1, 2, device=device))
        dict(tapped.taps)
        tapped.remove()
    except (TypeError, fxprobe.ConfigError) as e:
        return f"unavailable in this build: {type(e).__name__}: {str(e).splitlines()[0]}"
    return None
