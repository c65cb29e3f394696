"""Fixed-size samples of captured tensors (``reduce="sample"``), drawn without a generator when
seeded, so that ``torch.compile`` sees tensor ops only."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ...core.errors import ConfigError


def sample_vector(t: torch.Tensor, k: int, seed: int | torch.Generator | None = None
                  ) -> torch.Tensor:
    """A fixed-size uniform random sample of ``t``'s elements, as a new 1-D tensor.

    Elements are drawn independently, with replacement (O(k) work and memory however large
    ``t`` is); when ``t`` has at most ``k`` elements, all of them are kept, in order. Nothing
    synchronises with the device.

    Args:
        t: any tensor.
        k: the sample size, at least 1.
        seed: an int picks the positions by hashing ``(seed, position in the sample)``: the
            same positions for every tensor of the same size, drawn with tensor ops only, so
            ``torch.compile`` sees no generator and makes no graph break. A
            ``torch.Generator`` (on ``t``'s device) draws with ``torch.randint``; None uses
            the global generator.

    Returns:
        A detached 1-D tensor of ``min(k, t.numel())`` elements, of ``t``'s dtype and device.

    Raises:
        ConfigError: ``k`` is not a positive int.

    Example:
        >>> sample_vector(torch.arange(1000), 4, seed=0).shape
        torch.Size([4])
    """
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ConfigError(f"sample_vector(k={k!r}): k must be a positive int")
    flat = t.detach().reshape(-1)
    numel = flat.numel()
    if numel <= k:
        return flat.clone()
    if isinstance(seed, int):
        idx = hashed_positions(numel, k, seed, t.device)
    else:
        idx = torch.randint(numel, (k,), generator=seed, device=t.device)
    return flat[idx]


_MASK32 = 0xFFFFFFFF


def _hash32(x: torch.Tensor) -> torch.Tensor:
    # A 32-bit integer mixer (xor-shift-multiply); int64 arithmetic never overflows here.
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _MASK32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _MASK32
    return (x >> 16) ^ x


def hashed_positions(numel: int, k: int, seed: int, device: torch.device) -> torch.Tensor:
    """``k`` pseudo-random positions in ``[0, numel)``, a pure function of ``(numel, k, seed)``."""
    i = torch.arange(k, device=device, dtype=torch.int64)
    base = (seed * 2 + 1) & _MASK32
    hi = _hash32((i * 2 + base) & _MASK32)
    lo = _hash32((i * 2 + 1 + base * 3) & _MASK32)
    return ((hi << 31) | (lo >> 1)) % numel


@dataclass(frozen=True)
class Sample:
    """How ``reduce=fxprobe.Sample(...)`` subsamples each captured tensor (a callable record).

    ``reduce="sample"`` (with ``sample_size``/``seed``) is ``Sample(sample_size, replace=True,
    fresh=False, seed=seed)``: elements drawn with replacement at hashed positions, the same
    every forward. A ``Sample`` states the other choices.

    Example:
        >>> fxprobe.tap(model, ops=nn.Linear, reduce=fxprobe.Sample(64, dim=-1))  # 64 columns
    """

    k: int
    """How many elements (``dim=None``) or slices along ``dim`` to keep."""
    replace: bool = False
    """Draw with replacement (a position may come twice; O(k) work) or without (k distinct
    positions; O(size) work to draw: a permutation of the positions)."""
    fresh: bool = True
    """New positions at every call (every tensor of every forward), from a generator seeded
    with ``seed``; ``False``: the same positions for every tensor of the same size."""
    dim: int | None = None
    """``None``: elements of the flattened tensor, returned 1-D. An int: whole slices along it
    (``dim=-1``: columns), the tensor's other dims kept, ``k`` entries along ``dim``."""
    seed: int | None = 0
    """Seeds the draws (reproducible); ``None`` with ``fresh=True``: torch's global generator."""
    _generators: dict[Any, torch.Generator] = field(
        default_factory=dict, init=False, compare=False, repr=False)
    _fixed: dict[Any, torch.Tensor] = field(
        default_factory=dict, init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 1:
            raise ConfigError(f"Sample(k={self.k!r}): k must be a positive int")
        for name in ("replace", "fresh"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"Sample({name}={getattr(self, name)!r}): use True or False")
        if self.dim is not None and (isinstance(self.dim, bool) or not isinstance(self.dim, int)):
            raise ConfigError(f"Sample(dim={self.dim!r}): use None (elements) or an int")
        if self.seed is None and not self.fresh:
            raise ConfigError("Sample(fresh=False, seed=None): fixed positions need an int seed")
        if self.seed is not None and (isinstance(self.seed, bool)
                                      or not isinstance(self.seed, int)):
            raise ConfigError(f"Sample(seed={self.seed!r}) must be an int or None")

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        t = t.detach()
        if self.dim is None:
            flat = t.reshape(-1)
            return flat[self.positions(flat.numel(), t.device)]
        if t.dim() == 0:
            raise ConfigError(f"{self!r}: a 0-dim tensor has no dim {self.dim}")
        dim = self.dim if -t.dim() <= self.dim < t.dim() else None
        if dim is None:
            raise ConfigError(
                f"{self!r}: dim={self.dim} is out of range for a tensor of shape "
                f"{tuple(t.shape)}")
        return t.index_select(dim, self.positions(t.shape[dim], t.device))

    def positions(self, n: int, device: torch.device) -> torch.Tensor:
        """The indices in ``[0, n)`` to keep at this call (all of them, in order, if n <= k
        without replacement or if n <= k with it, as ``reduce="sample"`` does)."""
        if n <= self.k:
            return torch.arange(n, device=device)
        if not self.fresh:
            key = (n, str(device))
            idx = self._fixed.get(key)
            if idx is None:
                if self.replace:
                    assert self.seed is not None
                    idx = hashed_positions(n, self.k, self.seed, device)
                else:
                    fixed = torch.Generator().manual_seed(self.seed or 0)
                    idx = torch.randperm(n, generator=fixed)[:self.k].to(device)
                self._fixed[key] = idx
            return idx
        g = self._generator(device)
        if self.replace:
            return torch.randint(n, (self.k,), generator=g, device=device)
        return torch.randperm(n, generator=g, device=device)[:self.k]

    def _generator(self, device: torch.device) -> torch.Generator | None:
        if self.seed is None:
            return None
        key = str(device)
        g: torch.Generator | None = self._generators.get(key)
        if g is None:
            g = torch.Generator(device=device).manual_seed(self.seed)
            self._generators[key] = g
        return g
