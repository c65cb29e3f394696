"""A tiny token model for the SAE reader and streaming tests, and its reference rows: forward
hooks on an untapped copy, cloned, with the masks and token ids it was called with."""

from __future__ import annotations

import torch
from torch import nn

D = 8
VOCAB = 50


class Tiny(nn.Module):
    """``input_ids``, ``attention_mask`` -> ``emb`` and ``lin`` ([batch, pos, 8] each)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.lin = nn.Linear(D, D)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        h = self.emb(input_ids)
        return self.lin(h) * attention_mask[..., None]


def tiny() -> Tiny:
    torch.manual_seed(0)
    return Tiny().eval()


def batches(n: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """``n`` batches of 2 to 4 sequences of 3 to 7 tokens (shapes change between forwards),
    left-padded at random; token 1 plays BOS at position 0."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        b = int(torch.randint(2, 5, (1,), generator=g))
        p = int(torch.randint(3, 8, (1,), generator=g))
        ids = torch.randint(2, VOCAB, (b, p), generator=g)
        ids[:, 0] = 1
        mask = torch.ones(b, p, dtype=torch.long)
        for r in range(b):
            mask[r, :int(torch.randint(0, p - 1, (1,), generator=g))] = 0
        out.append({"input_ids": ids, "attention_mask": mask})
    return out


def hooked(inputs: list[dict[str, torch.Tensor]], site: str = "emb") -> list[torch.Tensor]:
    """Each batch's ``site`` output, by a forward hook on an untapped copy (cloned)."""
    model = tiny()
    seen: list[torch.Tensor] = []
    getattr(model, site).register_forward_hook(lambda m, a, o: seen.append(o.detach().clone()))
    with torch.no_grad():
        for kw in inputs:
            model(**kw)
    return seen


def reference_rows(inputs: list[dict[str, torch.Tensor]], site: str = "emb", *,
                   mask: bool = False, exclude: tuple[int, ...] = (),
                   positions: slice | None = None) -> torch.Tensor:
    """The rows a trainer should get, built by hand from the hooks' values (row-major)."""
    rows = []
    for kw, h in zip(inputs, hooked(inputs, site), strict=True):
        b, p = kw["input_ids"].shape
        keep = torch.ones(b, p, dtype=torch.bool)
        if positions is not None:
            inside = torch.zeros(p, dtype=torch.bool)
            inside[list(range(p))[positions]] = True
            keep &= inside
        if mask:
            keep &= kw["attention_mask"].bool()
        for t in exclude:
            keep &= kw["input_ids"] != t
        rows.append(h[keep])
    return torch.cat(rows)
