"""``fxprobe.features``: the outputs of chosen blocks, in the layout timm's
``forward_intermediates`` gives (``NCHW`` maps for ViT tokens, prefix tokens dropped or kept).

It is a thin layer over :func:`fxprobe.extractor` with ``return_nodes``: the graph stops after
the last chosen block, and each block's output is then laid out the way timm users expect.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Literal

import torch
from torch import fx, nn

from ..core.errors import ConfigError
from .extract import extractor

OutputFormat = Literal["NCHW", "NHWC", "NLC"]


class Features(nn.Module):
    """What :func:`features` returns: ``forward(*args)`` gives a list, one entry per block."""

    def __init__(self, body: fx.GraphModule, names: Sequence[str], output_fmt: OutputFormat,
                 prefix_tokens: int | None, grid: tuple[int, int] | None,
                 return_prefix_tokens: bool) -> None:
        super().__init__()
        self.body = body
        self.names = list(names)
        """The site names of the chosen blocks, in the order of the list returned."""
        self.output_fmt = output_fmt
        self.prefix_tokens = prefix_tokens
        self.grid = grid
        self.return_prefix_tokens = return_prefix_tokens

    def forward(self, *args: Any, **kwargs: Any) -> list[Any]:
        values = self.body(*args, **kwargs)
        return [self._layout(name, values[name]) for name in self.names]

    def _layout(self, name: str, t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or t.dim() not in (3, 4):
            raise ConfigError(
                f"block {name!r} returned {type(t).__name__}"
                f"{' of ' + str(t.dim()) + ' dims' if isinstance(t, torch.Tensor) else ''}; "
                "features() lays out NCHW maps and (B, tokens, C) sequences only; use "
                "fxprobe.extractor(model, return_nodes=...) for other values")
        if t.dim() == 4:  # a feature map, NCHW as CNNs make it
            if self.return_prefix_tokens:
                raise ConfigError(
                    f"return_prefix_tokens=True, but block {name!r} gives a feature map "
                    f"{tuple(t.shape)}, which has no tokens")
            return t.permute(0, 2, 3, 1) if self.output_fmt == "NHWC" else t
        b, n, c = t.shape
        p = self._prefix(name, n)
        prefix, tokens = t[:, :p], t[:, p:]
        if self.output_fmt == "NLC":
            spatial = tokens
        else:
            h, w = self._grid(name, n - p)
            spatial = tokens.reshape(b, h, w, c)
            if self.output_fmt == "NCHW":
                spatial = spatial.permute(0, 3, 1, 2)
        return (spatial, prefix) if self.return_prefix_tokens else spatial

    def _prefix(self, name: str, n: int) -> int:
        if self.prefix_tokens is not None:
            return self.prefix_tokens
        if self.grid is not None:
            return n - self.grid[0] * self.grid[1]
        for p in (0, 1):  # no class token, or one
            if math.isqrt(n - p) ** 2 == n - p:
                return p
        raise ConfigError(
            f"block {name!r} gives {n} tokens, which is no square grid with 0 or 1 prefix "
            "tokens: pass prefix_tokens= (class and register tokens) and/or grid=(H, W)")

    def _grid(self, name: str, n: int) -> tuple[int, int]:
        if self.grid is not None:
            h, w = self.grid
        else:
            h = w = math.isqrt(n)
        if h * w != n:
            raise ConfigError(
                f"block {name!r} gives {n} tokens after the prefix, which do not fill a "
                f"{h}x{w} grid; pass grid=(H, W) and prefix_tokens= as the model has them")
        return h, w


def features(model: nn.Module, indices: int | Sequence[int] | Sequence[str] | None = None, *,
             blocks: str = "blocks", output_fmt: OutputFormat = "NCHW",
             prefix_tokens: int | None = None, grid: tuple[int, int] | None = None,
             return_prefix_tokens: bool = False, leaf_modules: Sequence[Any] = (),
             train: bool = False) -> Features:
    """A module returning the outputs of chosen blocks as a list, laid out like timm's
    ``forward_intermediates(x, indices, intermediates_only=True)``.

    Token sequences ``(B, N, C)`` lose their prefix (class, register) tokens and become maps:
    ``NCHW`` ``(B, C, H, W)``, ``NHWC``, or ``NLC`` ``(B, H*W, C)``; with
    ``return_prefix_tokens`` each entry is ``(map, prefix tokens (B, p, C))``. Feature maps
    ``(B, C, H, W)`` of CNNs are kept (``NHWC`` permutes them). Nothing after the last chosen
    block runs (see ``extractor(return_nodes=...)``).

    Args:
        model: a module fx can trace whole (timm's and torchvision's models are).
        indices: which blocks: ``None`` (all children of ``blocks``), an int ``n`` (the last
            ``n``), block indices (``[2, 5, -1]``), or site names and module paths
            (``["layer1", "layer2"]`` for a ResNet; ``blocks`` is then not used).
        blocks: the path of the module holding the blocks in order (timm: ``"blocks"``;
            torchvision's ViT: ``"encoder.layers"``).
        output_fmt: ``"NCHW"`` (timm's default), ``"NHWC"`` or ``"NLC"``.
        prefix_tokens: how many leading tokens are not patches; default: the model's
            ``num_prefix_tokens`` (timm), else inferred (0 or 1, whichever leaves a square).
        grid: ``(H, W)`` of the patch grid; default: ``model.patch_embed.grid_size`` (timm),
            else the square root of the token count.
        return_prefix_tokens: return ``(map, prefix)`` pairs.
        leaf_modules: as in :func:`fxprobe.extractor`.
        train: trace the training-mode forward.

    Returns:
        A :class:`Features` module sharing the model's parameters.

    Raises:
        ConfigError: ``blocks`` is no module of the model or holds no blocks, an index out of
            range, an unknown ``output_fmt``, or a value that cannot be laid out.
        SelectorError: a site name that is no site.

    Example:
        >>> feats = fxprobe.features(vit, indices=[3, 7, 11])(images)  # 3 x (B, C, H, W)
    """
    if output_fmt not in ("NCHW", "NHWC", "NLC"):
        raise ConfigError(f"output_fmt={output_fmt!r}: use 'NCHW', 'NHWC' or 'NLC'")
    names = _block_names(model, indices, blocks)
    if prefix_tokens is None:
        found = getattr(model, "num_prefix_tokens", None)
        prefix_tokens = found if isinstance(found, int) else None
    if grid is None:
        size = getattr(getattr(model, "patch_embed", None), "grid_size", None)
        if isinstance(size, (tuple, list)) and len(size) == 2:
            grid = (int(size[0]), int(size[1]))
    body = extractor(model, return_nodes=list(dict.fromkeys(names)),
                     leaf_modules=leaf_modules, train=train)
    return Features(body, names, output_fmt, prefix_tokens, grid, return_prefix_tokens)


def _block_names(model: nn.Module, indices: Any, blocks: str) -> list[str]:
    if isinstance(indices, (list, tuple)) and indices and all(isinstance(i, str)
                                                              for i in indices):
        return list(indices)
    try:
        holder = model.get_submodule(blocks)
    except AttributeError:
        holders = [p for p, m in model.named_modules()
                   if p and isinstance(m, (nn.ModuleList, nn.Sequential))][:8]
        raise ConfigError(
            f"blocks={blocks!r} is no module of {type(model).__name__}; pass the path of the "
            f"module that holds the blocks (candidates: {', '.join(holders) or 'none'}), or "
            "site names as indices") from None
    children = [f"{blocks}.{name}" for name, _ in holder.named_children()]
    if not children:
        raise ConfigError(f"{blocks!r} ({type(holder).__name__}) has no child blocks")
    if indices is None:
        return children
    if isinstance(indices, int) and not isinstance(indices, bool):
        if not 1 <= indices <= len(children):
            raise ConfigError(
                f"indices={indices}: an int takes the last n blocks, 1 to {len(children)}")
        return children[-indices:]
    if isinstance(indices, (list, tuple)) and indices and all(
            isinstance(i, int) and not isinstance(i, bool) for i in indices):
        out = []
        for i in indices:
            if not -len(children) <= i < len(children):
                raise ConfigError(
                    f"block index {i} is out of range: {blocks!r} holds {len(children)} blocks")
            out.append(children[i])
        return out
    raise ConfigError(
        f"indices={indices!r}: pass None, an int (the last n blocks), a list of block indices "
        "or a list of site names")
