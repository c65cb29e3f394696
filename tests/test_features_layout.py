"""fxprobe.features on layouts beyond NCHW CNNs and ViT tokens: blocks that make NHWC maps
(Swin's), what ``channels()``/``reduction()`` report for them, untraceable modules kept as
leaves, and what it refuses.

References: forward hooks that clone each block's output on the model itself, laid out with
indexing written here; the model's own forward for the leaf case.
"""

from __future__ import annotations

import collections

import pytest
import torch
from torch import nn

import fxprobe
from fxprobe.core.errors import ConfigError, TraceError, UnsupportedModelError


class _Stage(nn.Module):
    """A Swin-like stage on NHWC maps: optional 2x2 patch merging, then a norm and a linear."""

    def __init__(self, cin: int, cout: int, merge: bool) -> None:
        super().__init__()
        self.merge = merge
        self.reduce = nn.Linear(4 * cin if merge else cin, cout)
        self.norm = nn.LayerNorm(cout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.merge:  # (B, H, W, C) -> (B, H/2, W/2, 4C)
            x = torch.cat([x[:, 0::2, 0::2], x[:, 1::2, 0::2], x[:, 0::2, 1::2],
                           x[:, 1::2, 1::2]], dim=-1)
        return self.norm(self.reduce(x))


class _NHWCNet(nn.Module):
    """Blocks whose outputs are ``(B, H, W, C)``, as timm's and torchvision's Swin make them."""

    def __init__(self) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, 6, 4, stride=4)
        self.layers = nn.Sequential(_Stage(6, 6, False), _Stage(6, 10, True))
        self.head = nn.Linear(10, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layers(self.patch(x).permute(0, 2, 3, 1)).mean((1, 2)))


class _Declared(_NHWCNet):
    """timm's declaration of the layout (``output_fmt``) and of each feature (``feature_info``)."""

    output_fmt = "NHWC"

    def __init__(self) -> None:
        super().__init__()
        self.feature_info = [{"module": "layers.0", "num_chs": 6, "reduction": 4},
                             {"module": "layers.1", "num_chs": 10, "reduction": 8}]


def _hooked(model: nn.Module, x: torch.Tensor, paths: list[str]) -> list[torch.Tensor]:
    seen: dict[str, torch.Tensor] = {}
    handles = [model.get_submodule(p).register_forward_hook(
        lambda m, i, o, p=p: seen.__setitem__(p, o.clone())) for p in paths]
    try:
        with torch.no_grad():
            model(x)
    finally:
        for h in handles:
            h.remove()
    return [seen[p] for p in paths]


def _nchw(t: torch.Tensor) -> torch.Tensor:
    """(B, H, W, C) -> (B, C, H, W), element by element."""
    b, h, w, c = t.shape
    out = torch.empty(b, c, h, w)
    for i in range(h):
        for j in range(w):
            out[:, :, i, j] = t[:, i, j, :]
    return out


X = torch.randn(2, 3, 32, 48)  # an 8x12 map after the patch: no side equals a channel count
PATHS = ["layers.0", "layers.1"]


def test_declared_nhwc_blocks_come_out_nchw_nhwc_and_nlc() -> None:
    torch.manual_seed(0)
    model = _Declared().eval()
    want = _hooked(model, X, PATHS)
    f = fxprobe.features(model)
    got = f(X)
    assert [tuple(g.shape) for g in got] == [(2, 6, 8, 12), (2, 10, 4, 6)]
    assert all(torch.equal(g, _nchw(w)) for g, w in zip(got, want, strict=True))
    assert f.channels() == [6, 10] and f.reduction() == [4, 8]
    nhwc = fxprobe.features(model, output_fmt="NHWC")(X)
    assert all(torch.equal(g, w) for g, w in zip(nhwc, want, strict=True))
    nlc = fxprobe.features(model, [1], output_fmt="NLC")(X)[0]  # pixel (i, j) is token i*W+j
    assert nlc.shape == (2, 24, 10)
    for i in range(4):
        for j in range(6):
            assert torch.equal(nlc[:, i * 6 + j], want[1][:, i, j])


def test_measured_channels_and_reduction_of_nhwc_maps() -> None:
    torch.manual_seed(1)
    model = _NHWCNet().eval()
    want = _hooked(model, X, PATHS)
    f = fxprobe.features(model, PATHS, block_fmt="NHWC")
    assert f.channels() == [None, None] and f.reduction() == [None, None]  # not measured yet
    got = f(X)
    assert all(torch.equal(g, _nchw(w)) for g, w in zip(got, want, strict=True))
    assert f.channels() == [6, 10] and f.reduction() == [4, 8]
    nlc = fxprobe.features(model, PATHS, block_fmt="NHWC", output_fmt="NLC")
    nlc(X)
    assert nlc.channels() == [6, 10] and nlc.reduction() == [4, 8]


def test_undeclared_nhwc_maps_are_refused_not_misread() -> None:
    model = _NHWCNet().eval()
    f = fxprobe.features(model, PATHS)  # NCHW assumed: (2, 8, 12, 6) would be 8 channels
    with pytest.raises(ConfigError, match=r"'layers.0' gives \(2, 8, 12, 6\).*block_fmt='NHWC'"):
        f(X)
    declared = _Declared().eval()  # feature_info's channels contradict a wrong declaration
    with pytest.raises(ConfigError, match="feature_info gives it 6 channels.*block_fmt='NHWC'"):
        fxprobe.features(declared, block_fmt="NCHW")(X)
    with pytest.raises(ConfigError, match="block_fmt='NLC'"):
        fxprobe.features(model, PATHS, block_fmt="NLC")  # type: ignore[arg-type]


def test_cnn_maps_as_nlc_and_their_stride() -> None:
    torch.manual_seed(2)
    model = nn.Sequential(nn.Conv2d(3, 5, 3, stride=2, padding=1), nn.ReLU(),
                          nn.Conv2d(5, 7, 3, stride=2, padding=1)).eval()
    (want,) = _hooked(model, X, ["2"])  # (2, 7, 8, 12)
    f = fxprobe.features(model, ["2"], output_fmt="NLC")
    (got,) = f(X)
    assert got.shape == (2, 96, 7)
    for i in range(8):
        for j in range(12):
            assert torch.equal(got[:, i * 12 + j], want[:, :, i, j])
    assert f.channels() == [7] and f.reduction() == [4]


class _Cached(nn.Module):
    """timm LeViT's attention: in eval mode its forward fills a dict cache, which fx cannot
    record, so it cannot be traced; as one call it runs as written."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.cache: dict[str, torch.Tensor] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            self.cache[str(x.device)] = self.fc.weight.t()
            return x @ self.cache[str(x.device)] + self.fc.bias
        return self.fc(x)


class _CachedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(nn.Sequential(_Cached(4), nn.GELU()) for _ in range(3)))
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x.flatten(2).transpose(1, 2)))


def test_untraceable_modules_are_kept_whole() -> None:
    torch.manual_seed(3)
    model, x = _CachedNet().eval(), torch.randn(2, 4, 3, 3)  # 9 tokens: a 3x3 grid
    with pytest.raises(TraceError, match="blocks.0.0"):
        fxprobe.extractor(model, return_nodes=["blocks.1"])  # the extractor keeps refusing
    want = _hooked(model, x, ["blocks.0", "blocks.2"])
    got = fxprobe.features(model, [0, 2])(x)
    for g, w in zip(got, want, strict=True):
        assert g.shape == (2, 4, 3, 3)
        for i in range(9):
            assert torch.equal(g[:, :, i // 3, i % 3], w[:, i])
    with pytest.raises(TraceError, match="leaf_modules="):  # a site inside one: the reason
        fxprobe.features(model, ["blocks.0.0.fc"])
    train = fxprobe.features(model, [1], train=True)  # traced through where it can be
    model.train()  # the reference runs the training-mode forward too
    try:
        with torch.no_grad():
            ref = model.blocks[1](model.blocks[0](x.flatten(2).transpose(1, 2)))
    finally:
        model.eval()
    assert torch.equal(train(x)[0].flatten(2).transpose(1, 2), ref)


@pytest.mark.parametrize("bad", ["notamodel", None, torch.zeros(2)])
def test_not_a_module(bad: object) -> None:
    with pytest.raises(UnsupportedModelError, match=r"fxprobe.features takes the model.*got "):
        fxprobe.features(bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError):  # the builtin it also is
        fxprobe.features(bad)  # type: ignore[arg-type]


def test_blocks_whose_names_end_in_a_number() -> None:
    # torchvision's ViT names its blocks encoder_layer_0, encoder_layer_1...: a module path's
    # own _N is no repeat count (it was dropped, so block 0 was no site).
    torch.manual_seed(4)
    model = _CachedNet().train()  # traceable in training mode
    model.blocks = nn.Sequential(collections.OrderedDict(
        (f"layer_{i}", nn.Sequential(nn.Linear(4, 4), nn.GELU())) for i in range(2)))
    x = torch.randn(2, 4, 2, 2)
    assert "blocks.layer_0" in {s.name for s in fxprobe.sites(model).modules}
    want = _hooked(model, x, ["blocks.layer_0", "blocks.layer_1"])
    got = fxprobe.features(model, blocks="blocks", train=True)(x)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g.flatten(2).transpose(1, 2), w)


class _LateClassToken(nn.Module):
    """CaiT's layout: the blocks see patches only; the class token (timm's
    ``num_prefix_tokens=1``) joins after them."""

    num_prefix_tokens = 1

    def __init__(self) -> None:
        super().__init__()
        self.patch_embed = nn.Conv2d(3, 4, 4, stride=4)
        self.patch_embed.grid_size = (2, 3)  # type: ignore[assignment]
        self.blocks = nn.Sequential(nn.Linear(4, 4), nn.GELU())
        self.cls = nn.Parameter(torch.randn(1, 1, 4))
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self.blocks(self.patch_embed(x).flatten(2).transpose(1, 2))
        return self.head(torch.cat([self.cls.expand(t.shape[0], -1, -1), t], 1)[:, 0])


def test_blocks_before_the_class_token_joins_have_no_prefix() -> None:
    torch.manual_seed(5)
    model, x = _LateClassToken().eval(), torch.randn(2, 3, 8, 12)
    (want,) = _hooked(model, x, ["blocks.1"])  # (2, 6, 4): patches only
    (got,) = fxprobe.features(model, [1])(x)
    assert got.shape == (2, 4, 2, 3)
    for i in range(6):
        assert torch.equal(got[:, :, i // 3, i % 3], want[:, i])


class _DeclaredOnly(_NHWCNet):
    output_fmt = "NHWC"  # timm's declaration, no feature_info: measured


def test_extractor_channels_follow_the_declared_layout_or_are_none() -> None:
    torch.manual_seed(6)
    declared = fxprobe.extractor(_DeclaredOnly().eval(), return_nodes=PATHS + ["head"])
    declared(X)
    assert declared.channels() == [6, 10, 3] and declared.reduction() == [4, 8, None]
    plain = fxprobe.extractor(_NHWCNet().eval(), return_nodes=PATHS)  # NHWC, undeclared
    plain(X)
    assert plain.channels() == [None, None] and plain.reduction() == [None, None]
    tokens = fxprobe.extractor(_LateClassToken().eval(), return_nodes=["blocks.1"])
    tokens(torch.randn(2, 3, 8, 12))  # (2, 6, 4): tokens or a (B, C, L) signal, unknown
    assert tokens.channels() == [None] and tokens.reduction() == [None]
