"""How a 4-d value lays out its map, for ``features`` and the extractor's ``feature_info``.

A model declares the layout of its maps (timm's ``output_fmt``: ``"NHWC"`` on Swin), else
they are taken as ``NCHW``. A value whose shape contradicts that layout and fits the other
one — against the channels the model's ``feature_info`` states, or against the input image's
height and width (a power-of-two stride) — is not read in either: ``features`` refuses it,
the extractor reports ``None`` for its channels and stride.
"""

from __future__ import annotations

from typing import Any, Literal

import torch

BlockFormat = Literal["NCHW", "NHWC"]


def declared_format(model: Any) -> BlockFormat:
    """The layout the model declares for its maps (timm's ``output_fmt``), else NCHW."""
    found = getattr(model, "output_fmt", None)  # a str, or timm's Format enum
    return "NHWC" if str(getattr(found, "value", found)) == "NHWC" else "NCHW"


def reading(t: torch.Tensor, fmt: str) -> tuple[int, int, int]:
    """``(channels, height, width)`` of the 4-d ``t`` read as ``fmt``."""
    if fmt == "NCHW":
        return int(t.shape[1]), int(t.shape[2]), int(t.shape[3])
    return int(t.shape[3]), int(t.shape[1]), int(t.shape[2])


def stride(image: torch.Tensor | None, h: int) -> int | None:
    """The input's height over the map's, when the input is an image and it divides."""
    if image is None or not h or image.shape[-2] % h:
        return None
    return int(image.shape[-2]) // h


def fits(image: torch.Tensor, h: int, w: int) -> bool:
    """Whether an ``h x w`` map comes out of the image by one power-of-two stride in both
    directions (1 to 64, rounded down or up), or by a power-of-two upsampling (2 to 8): the
    strides of CNN stages and Swin's. Any other stride counts as no fit, so that a square map
    from a small input is not taken to fit by some odd stride."""
    hin, win = int(image.shape[-2]), int(image.shape[-1])
    for k in range(7):
        s = 2 ** k
        if h in (hin // s, -(-hin // s)) and w in (win // s, -(-win // s)):
            return True
    return any(h == hin * 2 ** k and w == win * 2 ** k for k in range(1, 4))


def contradiction(t: torch.Tensor, fmt: BlockFormat, image: torch.Tensor | None,
                  num_chs: int | None) -> str | None:
    """Why the 4-d ``t`` is not laid out as ``fmt`` but as the other layout, or None when
    nothing says so (the declared layout then stands)."""
    other = "NHWC" if fmt == "NCHW" else "NCHW"
    (c, h, w), (c2, h2, w2) = reading(t, fmt), reading(t, other)
    if num_chs is not None:
        if c != num_chs and c2 == num_chs:
            return f"the model's feature_info gives it {num_chs} channels"
        return None
    if image is not None and not fits(image, h, w) and fits(image, h2, w2):
        return (f"no power-of-two stride makes a {h}x{w} map of a "
                f"{image.shape[-2]}x{image.shape[-1]} input, and one makes a {h2}x{w2} map")
    return None


def token_grid(image: torch.Tensor | None, n: int) -> tuple[int, int] | None:
    """The ``(H, W)`` grid of ``n`` patch tokens of a non-square image: the one ``h x w == n``
    that one integer stride makes of the image (rounded down or up in each direction), or
    None where the image is square or absent (the square root stands) or no single grid fits.
    LeViT's 256x64 input makes 16x4 tokens, which the square root read as 8x8."""
    if image is None or n <= 0:
        return None
    hin, win = int(image.shape[-2]), int(image.shape[-1])
    if hin == win:
        return None
    found = {(h, w) for s in range(1, max(hin, win) + 1)
             for h in {hin // s, -(-hin // s)} for w in {win // s, -(-win // s)}
             if h * w == n}
    return found.pop() if len(found) == 1 else None
