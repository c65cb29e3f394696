"""Which rows of a forward an SAE trainer gets, and how they are scaled: shared by the Disk
dataset (:mod:`.dataset`) and the streaming buffer (``runtime/stream.py``).

A forward's values ``[batch, pos, d]`` become ``batch * pos`` rows, row-major; these keep the
ones a trainer wants (real tokens, not BOS or padding, a slice of positions) as flat indices,
and scale rows to a fixed mean norm (``sqrt(d)``, as SAELens does).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..core.errors import ConfigError, DiskError


@dataclass(frozen=True)
class RowFilter:
    """What rows of a ``[batch, pos, ...]`` forward to keep (``rows="tokens"``)."""

    mask: str | None = None
    """A site holding a ``[batch, pos]`` mask (the model's ``attention_mask``): zeros dropped."""
    tokens: str = "input_ids"
    """The site holding the ``[batch, pos]`` token ids, read for ``exclude_token_ids``."""
    exclude_token_ids: tuple[int, ...] = ()
    """Token ids whose rows are dropped (BOS, EOS, padding ...)."""
    positions: slice | None = None
    """The sequence positions kept (``slice(1, None)`` drops the first of each sequence)."""

    @staticmethod
    def make(mask: str | None, tokens: str, exclude_token_ids: Iterable[int] | None,
             positions: slice | None) -> RowFilter:
        """Validated options (``ConfigError`` naming the one that is wrong)."""
        if mask is not None and not isinstance(mask, str):
            raise ConfigError(f"mask={mask!r}: name the site holding the [batch, pos] mask, "
                              "e.g. mask='attention_mask' (tapped with the rest)")
        if not isinstance(tokens, str):
            raise ConfigError(f"tokens={tokens!r}: name the site holding the token ids, "
                              "e.g. 'input_ids'")
        ids: tuple[int, ...] = ()
        if exclude_token_ids is not None:
            if isinstance(exclude_token_ids, (int, str, bytes)):
                raise ConfigError(f"exclude_token_ids={exclude_token_ids!r}: give a list of "
                                  "token ids, e.g. [tokenizer.bos_token_id]")
            try:
                ids = tuple(sorted({int(i) for i in exclude_token_ids}))
            except (TypeError, ValueError):
                raise ConfigError(f"exclude_token_ids={exclude_token_ids!r}: token ids are "
                                  "ints") from None
        if positions is not None and (not isinstance(positions, slice) or not (
                positions.step is None or isinstance(positions.step, int)
                and positions.step > 0)):
            raise ConfigError(f"positions={positions!r}: give a slice of sequence positions, "
                              "e.g. slice(1, None) or slice(0, 128)")
        return RowFilter(mask, tokens, ids, positions)

    @property
    def active(self) -> bool:
        return self.mask is not None or bool(self.exclude_token_ids) or \
            self.positions is not None

    def sites(self) -> list[str]:
        """The extra sites this filter reads."""
        return ([self.mask] if self.mask is not None else []) + \
            ([self.tokens] if self.exclude_token_ids else [])

    def kept(self, values: Mapping[str, Any], lead: tuple[int, ...], where: str
             ) -> torch.Tensor | None:
        """The flat indices (into ``batch * pos`` rows) to keep, or None for all of them.

        ``values`` holds the filter's sites; ``where`` names the forward in messages."""
        if not self.active:
            return None
        batch, pos = lead
        keep = torch.ones(batch, pos, dtype=torch.bool)
        if self.positions is not None:
            inside = torch.zeros(pos, dtype=torch.bool)
            inside[self.positions] = True
            keep &= inside
        if self.mask is not None:
            m = self._site(values, self.mask, lead, where, "mask")
            keep &= m.to("cpu", torch.bool)
        if self.exclude_token_ids:
            t = self._site(values, self.tokens, lead, where, "token ids")
            if t.is_floating_point() or t.dtype == torch.bool:
                raise DiskError(f"{self.tokens!r} in {where} holds {t.dtype} values, not token "
                                "ids; name the site of the model's input_ids with tokens=")
            bad = torch.tensor(self.exclude_token_ids, dtype=torch.long)
            keep &= ~torch.isin(t.to("cpu", torch.long), bad)
        return keep.reshape(-1).nonzero().reshape(-1)

    @staticmethod
    def _site(values: Mapping[str, Any], name: str, lead: tuple[int, ...], where: str,
              what: str) -> torch.Tensor:
        try:
            m = values[name]
        except KeyError:
            raise DiskError(f"{where} has no {what} {name!r}: tap it with the rest "
                            f"(ops=[..., {name!r}], an input site of the model)") from None
        if not isinstance(m, torch.Tensor) or tuple(m.shape) != lead:
            raise DiskError(f"{what} {name!r} in {where} has shape "
                            f"{tuple(getattr(m, 'shape', ()))}, expected the sites' "
                            f"[batch, pos] {list(lead)}")
        return m


@dataclass
class Scale:
    """Each site's factor that brings its rows to a mean norm of ``sqrt(d)``: rows are read
    multiplied by it; :meth:`undo` divides it out again."""

    factors: dict[str, float] = field(default_factory=dict)

    @staticmethod
    def estimate(rows: Mapping[str, torch.Tensor]) -> Scale:
        """The factors of a sample of rows (``{site: (n, *row_shape)}``); sites of integer
        values (token ids, masks) are not scaled."""
        factors = {}
        for name, r in rows.items():
            if not r.is_floating_point():
                continue
            flat = r.detach().reshape(r.shape[0], -1).to(torch.float64)
            if flat.shape[0] == 0:
                raise DiskError(f"site {name!r} has no rows to estimate its norm from")
            mean = float(flat.norm(dim=1).mean())
            if not math.isfinite(mean) or mean == 0.0:
                raise DiskError(f"site {name!r}: its rows' mean norm is {mean}, which cannot be "
                                "scaled to sqrt(d); pass normalize=False")
            factors[name] = math.sqrt(flat.shape[1]) / mean
        return Scale(factors)

    @staticmethod
    def given(names: tuple[str, ...], normalize: Any) -> Scale | None:
        """``normalize=`` as given: a float (one site), a dict by site, or None."""
        if isinstance(normalize, bool) or normalize is None:
            return None
        if isinstance(normalize, (int, float)):
            if len(names) != 1:
                raise ConfigError(f"normalize={normalize!r}: several sites need a factor each, "
                                  f"as a dict {{site: factor}} over {list(names)}")
            normalize = {names[0]: normalize}
        if not isinstance(normalize, Mapping) or set(normalize) != set(names) or not all(
                isinstance(v, (int, float)) and math.isfinite(v) and v > 0
                for v in normalize.values()):
            raise ConfigError(f"normalize={normalize!r}: pass True (estimate the factors), "
                              f"False, a positive factor, or {{site: factor}} for {list(names)}")
        return Scale({n: float(normalize[n]) for n in names})

    def apply(self, rows: dict[str, torch.Tensor], in_place: bool = False
              ) -> dict[str, torch.Tensor]:
        """Rows multiplied by their site's factor (new tensors: ``rows`` may be views of a
        capture's memory map, which must not change; ``in_place``: tensors of the caller's)."""
        for n, f in self.factors.items():
            if n in rows and rows[n].is_floating_point():
                rows[n] = rows[n].mul_(f) if in_place else rows[n] * f
        return rows

    def undo(self, rows: Any, name: str | None = None) -> Any:
        """Rows as they were captured (a tensor of site ``name``, or a dict by site)."""
        if isinstance(rows, Mapping):
            return {n: self.undo(v, n) if n in self.factors else v for n, v in rows.items()}
        if name is None:
            if len(self.factors) != 1:
                raise ConfigError("undo(rows) of several sites: pass name= or a dict by site")
            name = next(iter(self.factors))
        return rows / self.factors[name] if rows.is_floating_point() else rows


def stack_sites(values: Mapping[str, torch.Tensor], names: tuple[str, ...]) -> torch.Tensor:
    """``{site: (n, d)}`` -> ``(n, n_sites, d)``, in ``names``' order."""
    return torch.stack([values[n] for n in names], dim=1)


def check_stackable(shapes: Mapping[str, tuple[int, ...]],
                    dtypes: Mapping[str, torch.dtype]) -> None:
    if len(set(shapes.values())) > 1 or len(set(dtypes.values())) > 1:
        raise ConfigError(f"layout='stack' puts the sites side by side: they need one row "
                          f"shape and dtype, not {dict(shapes)} / {dict(dtypes)}; use "
                          "layout='dict'")
