"""Fixed-size samples of captured tensors (``reduce="sample"``), drawn without a generator when
seeded, so that ``torch.compile`` sees tensor ops only."""

from __future__ import annotations

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
