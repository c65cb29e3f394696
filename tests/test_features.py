"""Tests of fxprobe.features against hand computations and (in the torchvision venv) timm.

References: block outputs computed by running the model's own layers by hand, laid out with
indexing written independently of the implementation; forward hooks; timm's
``forward_intermediates`` on the same model.
"""

from __future__ import annotations

import textwrap

import pytest
import torch
import zoo
from torch import nn
from tv_venv import TvJob, run_tv, uses_tv

import fxprobe
from fxprobe.core.errors import ConfigError


class _Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class _ViT(nn.Module):
    """A ViT layout: patches, a class token, blocks; the head must not run for features."""

    def __init__(self, d: int = 8, depth: int = 4, prefix: int = 1) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, d, 4, stride=4)
        self.cls = nn.Parameter(torch.randn(1, prefix, d))
        self.blocks = nn.Sequential(*(_Block(d) for _ in range(depth)))
        self.head = nn.Linear(d, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1)
        return self.head(self.blocks(x)[:, 0])


def _by_hand(model: _ViT, x: torch.Tensor) -> list[torch.Tensor]:
    with torch.no_grad():
        p = model.patch(x)  # (B, C, H, W)
        b, c, h, w = p.shape
        tokens = torch.cat([model.cls.expand(b, -1, -1), p.flatten(2).transpose(1, 2)], 1)
        outs = []
        for blk in model.blocks:
            tokens = blk(tokens)
            outs.append(tokens)
    return outs


def _as_map(tokens: torch.Tensor, prefix: int, h: int, w: int) -> torch.Tensor:
    # Token i (after the prefix) is pixel (i // w, i % w), as flatten(2) made it.
    b, _, c = tokens.shape
    out = torch.empty(b, c, h, w)
    for i in range(h * w):
        out[:, :, i // w, i % w] = tokens[:, prefix + i]
    return out


def test_vit_blocks_as_nchw_maps_prefix_dropped() -> None:
    torch.manual_seed(0)
    model, x = _ViT().eval(), torch.randn(2, 3, 16, 12)  # a 4x3 grid: not square
    want = _by_hand(model, x)
    feats = fxprobe.features(model, [1, -1], grid=(4, 3))(x)
    assert [f.shape for f in feats] == [torch.Size([2, 8, 4, 3])] * 2
    assert torch.equal(feats[0], _as_map(want[1], 1, 4, 3))
    assert torch.equal(feats[1], _as_map(want[3], 1, 4, 3))


def test_vit_formats_prefix_tokens_and_last_n() -> None:
    torch.manual_seed(1)
    model, x = _ViT(prefix=1).eval(), torch.randn(2, 3, 16, 16)  # 4x4: inferred
    want = _by_hand(model, x)
    nhwc = fxprobe.features(model, 2, output_fmt="NHWC")(x)
    assert len(nhwc) == 2
    for got, ref in zip(nhwc, want[2:], strict=True):
        assert torch.equal(got, _as_map(ref, 1, 4, 4).permute(0, 2, 3, 1))
    nlc = fxprobe.features(model, [0], output_fmt="NLC")(x)[0]
    assert torch.equal(nlc, want[0][:, 1:])
    (spatial, prefix), = fxprobe.features(model, [3], return_prefix_tokens=True)(x)
    assert torch.equal(prefix, want[3][:, :1])
    assert torch.equal(spatial, _as_map(want[3], 1, 4, 4))
    everything = fxprobe.features(model)(x)
    assert len(everything) == 4 and torch.equal(everything[0], _as_map(want[0], 1, 4, 4))


def test_register_tokens_need_prefix_tokens() -> None:
    torch.manual_seed(2)
    model, x = _ViT(prefix=5).eval(), torch.randn(1, 3, 16, 16)  # 16 + 5 tokens
    with pytest.raises(ConfigError, match="prefix_tokens="):
        fxprobe.features(model, [0])(x)
    got = fxprobe.features(model, [0], prefix_tokens=5)(x)[0]
    assert torch.equal(got, _as_map(_by_hand(model, x)[0], 5, 4, 4))


def test_cnn_stages_by_name_equal_hooks() -> None:
    model, (x,), _ = zoo.make("resnet")
    seen: dict[str, torch.Tensor] = {}
    handles = [getattr(model, n).register_forward_hook(
        lambda m, i, o, n=n: seen.__setitem__(n, o.clone())) for n in ("layer1", "layer2")]
    try:
        with torch.no_grad():
            model(x)
    finally:
        for h in handles:
            h.remove()
    f = fxprobe.features(model, ["layer1", "layer2"])
    got = f(x)
    assert torch.equal(got[0], seen["layer1"]) and torch.equal(got[1], seen["layer2"])
    nhwc = fxprobe.features(model, ["layer2"], output_fmt="NHWC")(x)[0]
    assert torch.equal(nhwc, seen["layer2"].permute(0, 2, 3, 1))
    with pytest.raises(ConfigError, match="no tokens"):
        fxprobe.features(model, ["layer2"], return_prefix_tokens=True)(x)


def test_feature_info_chooses_blocks_and_channels_are_measured() -> None:
    model, (x,), _ = zoo.make("resnet")
    seen: dict[str, torch.Tensor] = {}
    handles = [getattr(model, n).register_forward_hook(
        lambda m, i, o, n=n: seen.__setitem__(n, o.clone())) for n in ("layer1", "layer2")]
    try:
        with torch.no_grad():
            model(x)
    finally:
        for h in handles:
            h.remove()
    named = fxprobe.features(model, ["layer1", "layer2"])
    assert named.channels() == [None, None]
    got = named(x)  # measured at the first call
    assert named.channels() == [seen[n].shape[1] for n in ("layer1", "layer2")]
    assert named.reduction() == [x.shape[-2] // seen[n].shape[-2] for n in ("layer1", "layer2")]
    info = [{"module": "layer1", "num_chs": 7, "reduction": 4},
            {"module": "layer2", "num_chs": 9, "reduction": 8}]
    model.feature_info = info  # timm's layout: indices count these entries
    f = fxprobe.features(model, [-1, 0, 0])  # in the model's order, each once, as timm
    assert f.feature_info == info and f.channels() == [7, 9] and f.reduction() == [4, 8]
    assert all(torch.equal(a, b) for a, b in zip(f(x), got, strict=True))
    assert torch.equal(fxprobe.features(model, 1)(x)[0], seen["layer2"])
    with pytest.raises(ConfigError, match="index 2 is out of range: feature_info lists 2"):
        fxprobe.features(model, [2])
    model.feature_info = [*info, {"module": "layer9"}]
    with pytest.raises(ConfigError, match="names module 'layer9'.*Did you mean .*'layer1'"):
        fxprobe.features(model)
    model.feature_info = "layer1"
    with pytest.raises(ConfigError, match="blocks="):
        fxprobe.features(model)
    assert torch.equal(fxprobe.features(model, ["layer1"])(x)[0], seen["layer1"])


@pytest.mark.parametrize("kwargs, match", [
    ({"indices": [0], "blocks": "layers"}, "blocks='layers' is no module.*candidates: blocks"),
    ({"indices": [7]}, "block index 7 is out of range: 'blocks' holds 4"),
    ({"indices": 0}, "last n blocks, 1 to 4"),
    ({"indices": [0], "output_fmt": "NCL"}, "output_fmt='NCL'"),
    ({"indices": "blocks.0"}, "pass None, an int"),
])
def test_bad_arguments(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        fxprobe.features(_ViT(), **kwargs)  # type: ignore[arg-type]


_TIMM_SCRIPT = textwrap.dedent("""
    import torch, timm, fxprobe
    torch.manual_seed(0)
    torch.set_num_threads(1)
    vit = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32,
                            patch_size=8, depth=4, num_classes=10, reg_tokens=2).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        for fmt in ("NCHW", "NLC"):
            want = vit.forward_intermediates(x, indices=[1, 3], output_fmt=fmt,
                                             intermediates_only=True)
            got = fxprobe.features(vit, [1, 3], output_fmt=fmt)(x)
            assert len(want) == len(got) == 2
            assert all(torch.equal(a, b) for a, b in zip(want, got)), fmt
        want = vit.forward_intermediates(x, indices=2, return_prefix_tokens=True,
                                         intermediates_only=True)
        got = fxprobe.features(vit, 2, return_prefix_tokens=True)(x)
        assert all(torch.equal(a, c) and torch.equal(b, d)
                   for (a, b), (c, d) in zip(want, got)), "prefix"
        print("vit equal", vit.num_prefix_tokens)
    from torchvision.models.vision_transformer import VisionTransformer
    from torchvision.models.feature_extraction import create_feature_extractor
    tv = VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=2,
                           hidden_dim=16, mlp_dim=32).eval()
    with torch.no_grad():
        tokens = create_feature_extractor(tv, ["encoder.layers.encoder_layer_1"])(x)
        t = tokens["encoder.layers.encoder_layer_1"]
        want = t[:, 1:].reshape(2, 4, 4, 16).permute(0, 3, 1, 2)
        got = fxprobe.features(tv, [1], blocks="encoder.layers")(x)[0]
    assert torch.equal(want, got)
    print("torchvision vit equal")

    def same_weights(fo, m):  # features_only keys: flattened (stages_0) or under model.
        sd = m.state_dict()
        pick = lambda k: next(c for c in (k, k.removeprefix("model."), k.replace("_", ".", 1))
                              if c in sd)
        fo.load_state_dict({k: sd[pick(k)] for k in fo.state_dict()})
        return fo.eval()

    for name, kw, fo_kw in [
            ("efficientnet_b0", {}, {}), ("resnet18", {}, {}), ("convnext_atto", {}, {}),
            ("vit_tiny_patch16_224", dict(img_size=32, patch_size=8, depth=4, embed_dim=32,
                                          num_heads=2), dict(out_indices=(0, 1, 2, 3)))]:
        torch.manual_seed(0)
        m = timm.create_model(name, pretrained=False, **kw).eval()
        x = torch.randn(2, 3, 32, 32) if "vit" in name else torch.randn(2, 3, 64, 64)
        n = len(m.feature_info)
        with torch.no_grad():
            for idx in (None, 2, [1, 3], [-1, 0]):
                want = m.forward_intermediates(x, indices=idx, intermediates_only=True)
                f = fxprobe.features(m, idx)
                got = f(x)
                assert len(got) == len(want), (name, idx, len(got), len(want))
                assert all(torch.equal(a, b) for a, b in zip(want, got)), (name, idx)
            fo = same_weights(timm.create_model(name, pretrained=False, features_only=True,
                                                **kw, **fo_kw), m)
            f = fxprobe.features(m, list(fo.feature_info.out_indices))
            got, want = f(x), fo(x)
            assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(want, got))
            assert f.channels() == fo.feature_info.channels(), name
            assert f.reduction() == fo.feature_info.reduction(), name
            assert [d["module"] for d in f.feature_info] == fo.feature_info.module_name()
            try:  # a features_only model: its feature_info names the full model's modules
                fxprobe.features(fo)
            except fxprobe.ConfigError as e:  # stages.0 is stages_0 there
                assert "features_only" in str(e) and name in ("convnext_atto",
                                                                "vit_tiny_patch16_224"), e
            except fxprobe.UnsupportedModelError as e:  # a ModuleDict
                assert "container" in str(e) and name == "resnet18", e
            else:
                assert name == "efficientnet_b0"  # its features model keeps blocks.N
        print("timm equal", name, n, f.feature_info[-1]["module"])
""")


@uses_tv(TvJob(_TIMM_SCRIPT, timeout=300))
def test_equals_timm_forward_intermediates_and_torchvision_tokens() -> None:
    stdout = run_tv(TvJob(_TIMM_SCRIPT, timeout=300))
    assert "vit equal 3" in stdout and "torchvision vit equal" in stdout
    for line in ("resnet18 5 layer4", "convnext_atto 4 stages.3", "efficientnet_b0 5 blocks.6",
                 "vit_tiny_patch16_224 4 blocks.3"):
        assert f"timm equal {line}" in stdout, stdout
