"""``fxprobe.features``: the outputs of chosen blocks, in the layout timm's
``forward_intermediates`` gives (``NCHW`` maps for ViT tokens, prefix tokens dropped or kept).

It is a thin layer over :func:`fxprobe.extractor` with ``return_nodes``: the graph stops after
the last chosen block, and each block's output is then laid out the way timm users expect.
"""

from __future__ import annotations

import difflib
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
                 return_prefix_tokens: bool,
                 info: Sequence[dict[str, Any]] | None = None) -> None:
        super().__init__()
        self.body = body
        self.names = list(names)
        """The site names of the chosen blocks, in the order of the list returned."""
        self.feature_info: list[dict[str, Any]] = [
            dict(d) for d in info] if info is not None else [{"module": n} for n in names]
        """One dict per output, as timm's ``feature_info``: ``module``, ``num_chs`` (channels)
        and ``reduction`` (the input's size over the map's). From the model's ``feature_info``
        when it has one, else measured at the first call."""
        self.output_fmt = output_fmt
        self.prefix_tokens = prefix_tokens
        self.grid = grid
        self.return_prefix_tokens = return_prefix_tokens

    def forward(self, *args: Any, **kwargs: Any) -> list[Any]:
        values = self.body(*args, **kwargs)
        out = [self._layout(name, values[name]) for name in self.names]
        if any("num_chs" not in d for d in self.feature_info):
            self._measure(args[0] if args else None, out)
        return out

    def channels(self) -> list[int | None]:
        """The channels of each output (timm's ``feature_info.channels()``)."""
        return [d.get("num_chs") for d in self.feature_info]

    def reduction(self) -> list[int | None]:
        """The stride of each output against the input (timm's ``feature_info.reduction()``);
        None where it was not measured yet or the input is no image."""
        return [d.get("reduction") for d in self.feature_info]

    def _measure(self, x: Any, out: list[Any]) -> None:
        for d, value in zip(self.feature_info, out, strict=True):
            m = value[0] if isinstance(value, tuple) else value
            if self.output_fmt == "NLC":  # (B, H*W, C): the grid is not in the shape
                d["num_chs"], d["reduction"] = int(m.shape[-1]), None
                continue
            c, h = (m.shape[1], m.shape[2]) if self.output_fmt == "NCHW" else (
                m.shape[3], m.shape[1])
            d["num_chs"] = int(c)
            d["reduction"] = (x.shape[-2] // h if isinstance(x, torch.Tensor) and x.dim() == 4
                              and h and x.shape[-2] % h == 0 else None)

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
             blocks: str | None = None, output_fmt: OutputFormat = "NCHW",
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
        indices: which blocks: ``None`` (all of them), an int ``n`` (the last ``n``), block
            indices (``[2, 5, -1]``), or site names and module paths (``["layer1", "layer2"]``
            for a ResNet; ``blocks`` is then not used). On a model with timm's
            ``feature_info`` the indices count its entries, as ``forward_intermediates`` does
            (in the model's order, each once).
        blocks: the path of the module holding the blocks in order (torchvision's ViT:
            ``"encoder.layers"``). Default: the model's ``feature_info`` (timm's models), else
            ``"blocks"``.
        output_fmt: ``"NCHW"`` (timm's default), ``"NHWC"`` or ``"NLC"``.
        prefix_tokens: how many leading tokens are not patches; default: the model's
            ``num_prefix_tokens`` (timm), else inferred (0 or 1, whichever leaves a square).
        grid: ``(H, W)`` of the patch grid; default: ``model.patch_embed.grid_size`` (timm),
            else the square root of the token count.
        return_prefix_tokens: return ``(map, prefix)`` pairs.
        leaf_modules: as in :func:`fxprobe.extractor`.
        train: trace the training-mode forward.

    Returns:
        A :class:`Features` module sharing the model's parameters, with timm's per-output
        ``feature_info`` (``module``, ``num_chs``, ``reduction``).

    Raises:
        ConfigError: ``blocks`` is no module of the model or holds no blocks, an index out of
            range, a ``feature_info`` entry that names no module of the model, an unknown
            ``output_fmt``, or a value that cannot be laid out.
        SelectorError: a site name that is no site.

    Example:
        >>> feats = fxprobe.features(vit, indices=[3, 7, 11])(images)  # 3 x (B, C, H, W)
    """
    if output_fmt not in ("NCHW", "NHWC", "NLC"):
        raise ConfigError(f"output_fmt={output_fmt!r}: use 'NCHW', 'NHWC' or 'NLC'")
    info = _feature_info(model) if blocks is None and not _named(indices) else None
    if info is not None:
        info = [info[i] for i in sorted(set(_take(indices, len(info), "feature_info lists")))]
        names = [d["module"] for d in info]
    else:
        names = _block_names(model, indices, blocks or "blocks")
    if prefix_tokens is None:
        found = getattr(model, "num_prefix_tokens", None)
        prefix_tokens = found if isinstance(found, int) else None
    if grid is None:
        size = getattr(getattr(model, "patch_embed", None), "grid_size", None)
        if isinstance(size, (tuple, list)) and len(size) == 2:
            grid = (int(size[0]), int(size[1]))
    body = extractor(model, return_nodes=list(dict.fromkeys(names)),
                     leaf_modules=leaf_modules, train=train)
    return Features(body, names, output_fmt, prefix_tokens, grid, return_prefix_tokens, info)


def _named(indices: Any) -> bool:
    return isinstance(indices, (list, tuple)) and bool(indices) and all(
        isinstance(i, str) for i in indices)


def _feature_info(model: nn.Module) -> list[dict[str, Any]] | None:
    """timm's ``feature_info`` of the model as dicts (module, num_chs, reduction), or None when
    it has none; ConfigError when an entry names no module of the model."""
    found = getattr(model, "feature_info", None)
    if found is None:
        return None
    if callable(getattr(found, "get_dicts", None)):  # timm's FeatureInfo (features_only)
        found = found.get_dicts()
    if (not isinstance(found, (list, tuple)) or not found
            or not all(isinstance(d, dict) and isinstance(d.get("module"), str) for d in found)):
        raise ConfigError(
            f"{type(model).__name__}.feature_info is not timm's list of dicts with a 'module' "
            "path; pass blocks= (the module holding the blocks) or site names as indices")
    modules = dict(model.named_modules())
    out = []
    for d in found:
        if d["module"] not in modules:
            close = difflib.get_close_matches(d["module"], [p for p in modules if p], n=3)
            raise ConfigError(
                f"{type(model).__name__}.feature_info names module {d['module']!r}, which is "
                f"no module of the model (close: {', '.join(close) or 'none'}); a timm "
                "features_only model returns its features itself; else pass blocks= or site "
                "names as indices")
        out.append({k: d[k] for k in ("module", "num_chs", "reduction") if k in d})
    return out


def _take(indices: Any, n: int, what: str) -> list[int]:
    """Positions among ``n`` blocks: None (all), an int (the last n) or a list of indices."""
    if indices is None:
        return list(range(n))
    if isinstance(indices, int) and not isinstance(indices, bool):
        if not 1 <= indices <= n:
            raise ConfigError(f"indices={indices}: an int takes the last n blocks, 1 to {n}")
        return list(range(n - indices, n))
    if isinstance(indices, (list, tuple)) and indices and all(
            isinstance(i, int) and not isinstance(i, bool) for i in indices):
        for i in indices:
            if not -n <= i < n:
                raise ConfigError(f"block index {i} is out of range: {what} {n} blocks")
        return [i % n for i in indices]
    raise ConfigError(
        f"indices={indices!r}: pass None, an int (the last n blocks), a list of block indices "
        "or a list of site names")


def _block_names(model: nn.Module, indices: Any, blocks: str) -> list[str]:
    if _named(indices):
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
    return [children[i] for i in _take(indices, len(children), f"{blocks!r} holds")]
