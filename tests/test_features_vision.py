"""fxprobe.features on timm and torchvision models whose layouts the first round missed: Swin's
NHWC maps, LeViT (untraceable attention caches), HRNet (feature_info naming positions), and
the channels/strides reported for NHWC maps and ViT tokens.

References, in the venv with timm and torchvision (see tests/test_torchvision.py): timm's
``forward_intermediates`` and ``features_only`` models with the same weights, torchvision's
``create_feature_extractor``. Without that venv these tests skip and say why;
tests/test_features_layout.py checks the same rules on hand-written models.
"""

from __future__ import annotations

import textwrap

from tv_venv import TvJob, run_tv, uses_tv

_SCRIPT = textwrap.dedent("""
    import torch, timm, fxprobe
    from torchvision.models.feature_extraction import create_feature_extractor
    from torchvision.models.swin_transformer import SwinTransformer
    from torchvision.models.vision_transformer import VisionTransformer
    torch.set_num_threads(1)

    def same_weights(fo, m):  # features_only keys: flattened (layers_0), under model., as is
        sd = m.state_dict()
        pick = lambda k: next(c for c in (k, k.removeprefix("model."), k.replace("_", ".", 1))
                              if c in sd)
        fo.load_state_dict({k: sd[pick(k)] for k in fo.state_dict()})
        return fo.eval()

    def check(name, m, x, idxs, fo_kw=None):
        with torch.no_grad():
            for idx in idxs:
                want = m.forward_intermediates(x, indices=idx, intermediates_only=True)
                got = fxprobe.features(m, idx)(x)
                assert [w.shape for w in want] == [g.shape for g in got], (name, idx)
                assert all(torch.equal(a, b) for a, b in zip(want, got)), (name, idx)
            if fo_kw is None:
                return
            fo = same_weights(timm.create_model(name, features_only=True, **fo_kw), m)
            f = fxprobe.features(m, output_fmt=str(getattr(fo, "output_fmt", "NCHW").value
                                                   if hasattr(fo, "output_fmt") else "NCHW"))
            got, want = f(x), fo(x)
            assert [w.shape for w in want] == [g.shape for g in got], name
            assert all(torch.equal(a, b) for a, b in zip(want, got)), name
            assert f.channels() == fo.feature_info.channels(), (name, f.channels())
            assert f.reduction() == fo.feature_info.reduction(), (name, f.reduction())
            assert [d["module"] for d in f.feature_info] == fo.feature_info.module_name()
        print("equal", name, [tuple(g.shape) for g in got], f.channels(), f.reduction())

    swin_kw = dict(pretrained=False, img_size=64, window_size=4, embed_dim=24,
                   depths=(1, 1, 1, 1), num_heads=(1, 1, 2, 2))
    torch.manual_seed(0)
    swin = timm.create_model("swin_tiny_patch4_window7_224", **swin_kw).eval()
    check("swin_tiny_patch4_window7_224", swin, torch.randn(2, 3, 64, 64), (None, [1], 2),
          swin_kw)  # timm's features_only Swin gives NHWC maps: compared with output_fmt=NHWC
    torch.manual_seed(0)
    hrnet = timm.create_model("hrnet_w18_small", pretrained=False).eval()
    check("hrnet_w18_small", hrnet, torch.randn(1, 3, 64, 64), (None, [1, 3], 2),
          dict(pretrained=False))
    torch.manual_seed(0)
    levit = timm.create_model("levit_128s", pretrained=False).eval()
    check("levit_128s", levit, torch.randn(1, 3, 224, 224), (None, [1]), dict(pretrained=False))
    torch.manual_seed(0)  # a non-square input: 16x4 tokens, which the square root laid out 8x8
    levit = timm.create_model("levit_128s", pretrained=False, img_size=(256, 64)).eval()
    check("levit_128s", levit, torch.randn(1, 3, 256, 64), (None,),
          dict(pretrained=False, img_size=(256, 64)))

    torch.manual_seed(0)
    tv = SwinTransformer(patch_size=[4, 4], embed_dim=24, depths=[1, 1, 1, 1],
                         num_heads=[1, 1, 2, 2], window_size=[4, 4]).eval()
    x = torch.randn(2, 3, 64, 64)
    names = ["features.1", "features.3", "features.5", "features.7"]
    with torch.no_grad():
        ref = create_feature_extractor(tv, names)(x)  # (B, H, W, C)
        try:
            fxprobe.features(tv, names)(x)
            raise AssertionError("torchvision's NHWC maps were read as NCHW")
        except fxprobe.ConfigError as e:
            assert "block_fmt='NHWC'" in str(e), e
        f = fxprobe.features(tv, names, block_fmt="NHWC")
        got = f(x)
    assert all(torch.equal(g, ref[n].permute(0, 3, 1, 2)) for g, n in zip(got, names))
    print("tv swin", f.channels(), f.reduction())
    ex = fxprobe.extractor(tv, return_nodes=names)  # raw (B, H, W, C): undeclared, unknown
    with torch.no_grad():
        ex(x)
    print("tv swin extractor", ex.channels(), ex.reduction())

    vit = VisionTransformer(image_size=32, patch_size=8, num_layers=3, num_heads=2,
                            hidden_dim=16, mlp_dim=32).eval()
    x = torch.randn(2, 3, 32, 32)
    names = [f"encoder.layers.encoder_layer_{i}" for i in range(3)]
    with torch.no_grad():
        ref = create_feature_extractor(vit, names)(x)  # (B, 1 + 16, 16)
        f = fxprobe.features(vit, blocks="encoder.layers")
        got = f(x)
    for g, n in zip(got, names):
        assert torch.equal(g, ref[n][:, 1:].reshape(2, 4, 4, 16).permute(0, 3, 1, 2)), n
    print("tv vit", f.channels(), f.reduction())
    ex = fxprobe.extractor(vit, return_nodes=names)  # raw (B, 17, C) tokens
    with torch.no_grad():
        ex(x)
    print("tv vit extractor", ex.channels(), ex.reduction())
""")


@uses_tv(TvJob(_SCRIPT))
def test_swin_levit_hrnet_and_torchvision_layouts() -> None:
    out = run_tv(TvJob(_SCRIPT))
    assert "equal swin_tiny_patch4_window7_224 [(2, 16, 16, 24), (2, 8, 8, 48)" in out, out
    assert "[24, 48, 96, 192] [4, 8, 16, 32]" in out, out
    assert "equal hrnet_w18_small" in out and "equal levit_128s" in out, out
    assert "equal levit_128s [(1, 128, 16, 4), (1, 256, 8, 2), (1, 384, 4, 1)]" in out, out
    assert "tv swin [24, 48, 96, 192] [4, 8, 16, 32]" in out, out
    assert "tv vit [16, 16, 16] [8, 8, 8]" in out, out
    # The extractor returns the raw values: heights and token counts were reported as channels
    assert "tv swin extractor [None, None, None, None] [None, None, None, None]" in out, out
    assert "tv vit extractor [None, None, None] [None, None, None]" in out, out
