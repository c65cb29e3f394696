"""``fxprobe.features``: the outputs of chosen blocks, in the layout timm's
``forward_intermediates`` gives (``NCHW`` maps for ViT tokens, prefix tokens dropped or kept,
and for Swin's ``NHWC`` maps).

It is a thin layer over :func:`fxprobe.extractor` with ``return_nodes``: the graph stops after
the last chosen block, and each block's output is then laid out the way timm users expect. A
4-d map is read in the layout the model declares (timm's ``output_fmt``, or ``block_fmt=``) and
checked against what else is known (``feature_info`` channels, the input image's size), so
that a map in the other layout is refused rather than scrambled.
"""

from __future__ import annotations

import math
import reprlib
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
from torch import fx, nn

from ..core.errors import ConfigError, UnsupportedModelError
from ..core.names import did_you_mean
from .extract import build_extractor
from .layout import BlockFormat, contradiction, declared_format, reading, stride, token_grid
from .program import check_model

OutputFormat = Literal["NCHW", "NHWC", "NLC"]


class Features(nn.Module):
    """What :func:`features` returns: ``forward(*args)`` gives a list, one entry per block."""

    def __init__(self, body: fx.GraphModule, names: Sequence[str], output_fmt: OutputFormat,
                 prefix_tokens: int | None, grid: tuple[int, int] | None,
                 return_prefix_tokens: bool,
                 info: Sequence[dict[str, Any]] | None = None,
                 block_fmt: BlockFormat = "NCHW", declared_prefix: int | None = None) -> None:
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
        self.block_fmt = block_fmt
        """How the blocks lay out their 4-d outputs: ``NCHW``, or ``NHWC`` (Swin's)."""
        self.prefix_tokens = prefix_tokens
        self.declared_prefix = declared_prefix
        """The model's ``num_prefix_tokens`` (timm), used where ``prefix_tokens`` is None."""
        self.grid = grid
        self.return_prefix_tokens = return_prefix_tokens

    def forward(self, *args: Any, **kwargs: Any) -> list[Any]:
        values = self.body(*args, **kwargs)
        x = args[0] if args else None
        image = x if isinstance(x, torch.Tensor) and x.dim() == 4 else None
        out = []
        for name, d in zip(self.names, self.feature_info, strict=True):
            value, measured = self._layout(name, values[name], image, d.get("num_chs"))
            d.setdefault("num_chs", measured[0])
            d.setdefault("reduction", measured[1])
            out.append(value)
        return out

    def channels(self) -> list[int | None]:
        """The channels of each output (timm's ``feature_info.channels()``): the model's
        ``feature_info`` where it has one, else measured at the first call (None before)."""
        return [d.get("num_chs") for d in self.feature_info]

    def reduction(self) -> list[int | None]:
        """The stride of each output against the input (timm's ``feature_info.reduction()``);
        None where it was not measured yet, the input is no image, the output is ``NLC``
        tokens (no grid in the shape) or the input's height is no multiple of the map's."""
        return [d.get("reduction") for d in self.feature_info]

    def _layout(self, name: str, t: Any, image: torch.Tensor | None,
                num_chs: int | None) -> tuple[Any, tuple[int, int | None]]:
        """The value laid out as ``output_fmt`` asks, and its (channels, reduction)."""
        if not isinstance(t, torch.Tensor) or t.dim() not in (3, 4):
            raise ConfigError(
                f"block {name!r} returned {type(t).__name__}"
                f"{' of ' + str(t.dim()) + ' dims' if isinstance(t, torch.Tensor) else ''}; "
                "features() lays out NCHW or NHWC maps and (B, tokens, C) sequences only; use "
                "fxprobe.extractor(model, return_nodes=...) for other values")
        if t.dim() == 4:  # a feature map, laid out as the model declares (block_fmt)
            if self.return_prefix_tokens:
                raise ConfigError(
                    f"return_prefix_tokens=True, but block {name!r} gives a feature map "
                    f"{tuple(t.shape)}, which has no tokens")
            check_map(name, t, self.block_fmt, image, num_chs)
            nchw = t if self.block_fmt == "NCHW" else t.permute(0, 3, 1, 2)
            measured = (int(nchw.shape[1]), stride(image, int(nchw.shape[2])))
            if self.output_fmt == "NLC":
                return nchw.flatten(2).transpose(1, 2), measured
            return (nchw.permute(0, 2, 3, 1) if self.output_fmt == "NHWC" else nchw), measured
        b, n, c = t.shape
        p = self._prefix(name, n, image)
        prefix, tokens = t[:, :p], t[:, p:]
        if self.output_fmt == "NLC":  # (B, H*W, C): the grid is not in the shape
            spatial, measured = tokens, (int(c), None)
        else:
            h, w = self._grid(name, n - p, image)
            spatial = tokens.reshape(b, h, w, c)
            measured = (int(c), stride(image, h))
            if self.output_fmt == "NCHW":
                spatial = spatial.permute(0, 3, 1, 2)
        return ((spatial, prefix) if self.return_prefix_tokens else spatial), measured

    def _prefix(self, name: str, n: int, image: torch.Tensor | None) -> int:
        if self.prefix_tokens is not None:
            return self.prefix_tokens
        if self.grid is not None and n == self.grid[0] * self.grid[1]:
            return 0  # all patches: CaiT's and XCiT's blocks, before the class token joins
        if self.declared_prefix is not None:
            return self.declared_prefix
        if self.grid is not None:
            return n - self.grid[0] * self.grid[1]
        if image is not None and image.shape[-2] != image.shape[-1]:
            for p in (0, 1):  # no class token, or one: whichever leaves the image's grid
                if token_grid(image, n - p) is not None:
                    return p
        for p in (0, 1):  # no class token, or one
            if math.isqrt(n - p) ** 2 == n - p:
                return p
        raise ConfigError(
            f"block {name!r} gives {n} tokens, which is no square grid with 0 or 1 prefix "
            "tokens: pass prefix_tokens= (class and register tokens) and/or grid=(H, W)")

    def _grid(self, name: str, n: int, image: torch.Tensor | None) -> tuple[int, int]:
        if self.grid is not None:
            h, w = self.grid
        elif image is not None and image.shape[-2] != image.shape[-1]:
            # A non-square image: its grid, not the square root (which a count like LeViT's
            # 16x4 = 64 tokens of a 256x64 input would pass as 8x8).
            h, w = token_grid(image, n) or (0, 0)
        else:
            h = w = math.isqrt(n)
        if h * w != n:
            what = f"a {h}x{w} grid" if h else (
                f"the grid of any one stride of the {image.shape[-2]}x{image.shape[-1]} input"
                if image is not None else "a grid")
            raise ConfigError(
                f"block {name!r} gives {n} tokens after the prefix, which do not fill {what}; "
                "pass grid=(H, W) and prefix_tokens= as the model has them")
        return h, w


def features(model: nn.Module, indices: int | Sequence[int] | Sequence[str] | None = None, *,
             blocks: str | None = None, output_fmt: OutputFormat = "NCHW",
             prefix_tokens: int | None = None, grid: tuple[int, int] | None = None,
             return_prefix_tokens: bool = False, leaf_modules: Sequence[Any] = (),
             train: bool = False, block_fmt: BlockFormat | None = None) -> Features:
    """A module returning the outputs of chosen blocks as a list, laid out like timm's
    ``forward_intermediates(x, indices, intermediates_only=True)``.

    Token sequences ``(B, N, C)`` lose their prefix (class, register) tokens and become maps:
    ``NCHW`` ``(B, C, H, W)``, ``NHWC``, or ``NLC`` ``(B, H*W, C)``; with
    ``return_prefix_tokens`` each entry is ``(map, prefix tokens (B, p, C))``. Feature maps
    (4-d, laid out as ``block_fmt`` says) are permuted to ``output_fmt``. Nothing after the
    last chosen block runs (see ``extractor(return_nodes=...)``).

    Args:
        model: a module fx can trace (timm's and torchvision's models are); a module fx cannot
            trace is kept as one call, as if in ``leaf_modules`` (LeViT's attention).
        indices: which blocks: ``None`` (all of them), an int ``n`` (the last ``n``), block
            indices (``[2, 5, -1]``), or site names and module paths (``["layer1", "layer2"]``
            for a ResNet; ``blocks`` is then not used). On a model with timm's
            ``feature_info`` the indices count its entries, as ``forward_intermediates`` does
            (in the model's order, each once).
        blocks: the path of the module holding the blocks in order (torchvision's ViT:
            ``"encoder.layers"``). Default: the model's ``feature_info`` (timm's models), else
            ``"blocks"``.
        output_fmt: ``"NCHW"`` (timm's default), ``"NHWC"`` or ``"NLC"``.
        prefix_tokens: how many leading tokens are not patches; default: none where the
            tokens fill the patch grid (CaiT's and XCiT's blocks, before their class token
            joins), else the model's ``num_prefix_tokens`` (timm), else inferred (0 or 1,
            whichever leaves a square).
        grid: ``(H, W)`` of the patch grid; default: ``model.patch_embed.grid_size`` (timm),
            else, for a non-square input image, the grid one stride makes of it, else the
            square root of the token count.
        return_prefix_tokens: return ``(map, prefix)`` pairs.
        leaf_modules: as in :func:`fxprobe.extractor`.
        train: trace the training-mode forward.
        block_fmt: how the blocks lay out their 4-d maps: ``"NCHW"`` or ``"NHWC"`` (Swin's).
            Default: the model's ``output_fmt`` (timm declares it), else ``"NCHW"``. A map
            whose shape contradicts it (against the model's ``feature_info`` channels or the
            input image's size) raises ConfigError rather than being laid out wrong.

    Returns:
        A :class:`Features` module sharing the model's parameters, with timm's per-output
        ``feature_info`` (``module``, ``num_chs``, ``reduction``).

    Raises:
        ConfigError: ``blocks`` is no module of the model or holds no blocks, an index out of
            range, a ``feature_info`` entry that names no module of the model, an unknown
            ``output_fmt`` or ``block_fmt``, or a value that cannot be laid out.
        SelectorError: a site name that is no site.
        UnsupportedModelError: ``model`` is no ``nn.Module``.

    Example:
        >>> feats = fxprobe.features(vit, indices=[3, 7, 11])(images)  # 3 x (B, C, H, W)
    """
    if not isinstance(model, nn.Module):
        raise UnsupportedModelError(
            f"fxprobe.features takes the model, a torch.nn.Module (a timm or torchvision model, "
            f"or your own); got {type(model).__name__} {reprlib.repr(model)}")
    model = check_model(model, "fxprobe.features")
    if output_fmt not in ("NCHW", "NHWC", "NLC"):
        raise ConfigError(f"output_fmt={output_fmt!r}: use 'NCHW', 'NHWC' or 'NLC'")
    if block_fmt is None:
        block_fmt = declared_format(model)
    elif block_fmt not in ("NCHW", "NHWC"):
        raise ConfigError(f"block_fmt={block_fmt!r}: use 'NCHW' or 'NHWC' (the layout of the "
                          "blocks' 4-d maps), or None for the model's own output_fmt")
    info = _feature_info(model) if blocks is None and not _named(indices) else None
    if info is not None:
        info = [info[i] for i in sorted(set(_take(indices, len(info), "feature_info lists")))]
        names = [d.pop("site") for d in info]
    else:
        names = _block_names(model, indices, blocks or "blocks")
    found = getattr(model, "num_prefix_tokens", None)
    declared = found if isinstance(found, int) else None
    if grid is None:
        size = getattr(getattr(model, "patch_embed", None), "grid_size", None)
        if isinstance(size, (tuple, list)) and len(size) == 2:
            grid = (int(size[0]), int(size[1]))
    body = build_extractor(model, None, "fx", leaf_modules, (), train,
                           list(dict.fromkeys(names)), untraceable_as_leaves=True)
    return Features(body, names, output_fmt, prefix_tokens, grid, return_prefix_tokens, info,
                    block_fmt, declared)


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
    where = _POSITIONS.get(type(model).__name__) if _is_timm(model) else None
    out = []
    for d in found:
        if d.get("hook_type") == "forward_pre":
            raise ConfigError(
                f"{type(model).__name__}.feature_info entry {d['module']!r} is that module's "
                "input (hook_type='forward_pre', timm's feature_location='expansion'), which "
                "features() does not take (it returns module outputs); create the model with "
                "the default feature_location, or pass site names as indices")
        site = where(model, d["module"]) if where is not None else d["module"]
        if site not in modules:
            raise ConfigError(
                f"{type(model).__name__}.feature_info names module {d['module']!r}, which is "
                "no module of the model: a timm features_only model returns its features "
                "itself; else pass blocks= or site names as indices."
                f"{did_you_mean(d['module'], [p for p in modules if p])}")
        out.append({"site": site, **{k: d[k] for k in ("module", "num_chs", "reduction")
                                     if k in d}})
    return out


def _is_timm(model: nn.Module) -> bool:
    return type(model).__module__.startswith("timm.")


def _hrnet(model: nn.Module, module: str) -> str:
    """timm's HRNet names positions: the stem's activation and the branches of the last
    stage after the head's channel-increase modules (as its ``forward_intermediates``)."""
    if module == "stem":
        return "act1"
    incre = getattr(model, "incre_modules", None)
    if module.startswith("stage") and module[5:].isdigit() and incre is not None:
        return f"incre_modules.{int(module[5:]) - 1}"
    raise ConfigError(
        f"{type(model).__name__}.feature_info entry {module!r} is a branch of the last "
        "stage's list output (this HRNet has no incre_modules), which features() cannot "
        "name; pass site names as indices (fxprobe.sites(model))")


# timm models whose feature_info names positions in the forward rather than modules: the site
# of each position. Others name the module whose output is the feature.
_POSITIONS: dict[str, Callable[[nn.Module, str], str]] = {"HighResolutionNet": _hrnet}


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



def check_map(name: str, t: torch.Tensor, block_fmt: BlockFormat, image: torch.Tensor | None,
              num_chs: int | None) -> None:
    """ConfigError when the 4-d value ``t`` contradicts ``block_fmt`` and fits the other
    layout (:func:`~fxprobe.runtime.layout.contradiction`)."""
    why = contradiction(t, block_fmt, image, num_chs)
    if why is not None:
        c, h, w = reading(t, block_fmt)
        other = "NHWC" if block_fmt == "NCHW" else "NCHW"
        raise ConfigError(
            f"block {name!r} gives {tuple(t.shape)}: read as {block_fmt} (what the model "
            f"declares, or the default) it is a {h}x{w} map of {c} channels, but {why}: it "
            f"looks {other}. Pass block_fmt={other!r} if the model lays its maps out so "
            "(torchvision's Swin makes NHWC maps; timm models declare it in output_fmt)")
