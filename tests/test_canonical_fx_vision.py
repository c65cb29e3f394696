"""Canonical transformer names on vision transformers torch.fx traces whole (torchvision's
ViT, timm's ViT), in the venv with torchvision and timm: the value read by a canonical name
equals the site it stands for and forward hooks that clone on an untapped copy, across calls
and batch sizes, in ``tap``, ``extractor`` and ``features``."""

from __future__ import annotations

from tv_venv import TvJob, run_tv, uses_tv

TORCHVISION = r"""
import copy, torch, torchvision, fxprobe
torch.manual_seed(0)
model = torchvision.models.vision_transformer.VisionTransformer(
    image_size=32, patch_size=8, num_layers=3, num_heads=2, hidden_dim=16, mlp_dim=32).eval()
reference = copy.deepcopy(model)
ref = {}
def keep(name):
    return lambda m, a, o: ref.__setitem__(name, (o[0] if isinstance(o, tuple) else o).clone())
for i, b in enumerate(reference.encoder.layers):
    b.register_forward_pre_hook(lambda m, a, i=i: ref.__setitem__(f"blocks.{i}.resid_pre",
                                                                  a[0].clone()))
    b.register_forward_hook(keep(f"blocks.{i}.resid_post"))
    b.self_attention.register_forward_hook(keep(f"blocks.{i}.attn_out"))
    b.mlp[0].register_forward_hook(keep(f"blocks.{i}.mlp.pre"))
    b.mlp[3].register_forward_hook(keep(f"blocks.{i}.mlp_out"))
reference.encoder.ln.register_forward_hook(keep("ln_final"))
names = ["blocks.*.resid_pre", "blocks.*.resid_post", "blocks.*.attn_out", "blocks.*.mlp.pre",
         "blocks.*.mlp_out", "ln_final"]
tapped = fxprobe.tap(model, ops=names, tracer="fx")
ex = fxprobe.extractor(model, return_nodes={"blocks.1.resid_post": "b1", "ln_final": "ln"})
feats = fxprobe.features(model, ["blocks.0.resid_post", "blocks.2.resid_post"])
by_path = fxprobe.features(model, ["encoder.layers.encoder_layer_0",
                                   "encoder.layers.encoder_layer_2"])
site = {c: s.name for s in tapped.sites for c in s.canonical}
assert site["blocks.1.resid_post"] == "encoder.layers.encoder_layer_1.add_1", site
assert "blocks.0.attn.q" not in site  # inside nn.MultiheadAttention: no value of the graph
for batch in (2, 3, 1):
    x = torch.randn(batch, 3, 32, 32)
    ref.clear()
    with torch.no_grad():
        out = tapped(x)
        expected = reference(x)
        body = ex(x)
        maps, paths = feats(x), by_path(x)
    assert torch.equal(out, expected)
    assert len(ref) == 16, sorted(ref)
    for name, value in ref.items():
        assert torch.equal(tapped.taps[name], value), name
        assert torch.equal(tapped.taps[name], tapped.taps[site[name]]), name
    assert torch.equal(body["b1"], ref["blocks.1.resid_post"])
    assert torch.equal(body["ln"], ref["ln_final"])
    for m, p, i in zip(maps, paths, (0, 2)):
        assert torch.equal(m, p)
        grid = ref[f"blocks.{i}.resid_post"][:, 1:].reshape(batch, 4, 4, 16).permute(0, 3, 1, 2)
        assert torch.equal(m, grid)
try:
    fxprobe.tap(model, ops="blocks.0.attn.pattern", tracer="fx")
    raise AssertionError("no pattern under fx")
except fxprobe.SelectorError as e:
    assert "matches no site" in str(e)
print("ok")
"""


@uses_tv(TvJob(TORCHVISION))
def test_torchvision_vit_canonical_names_equal_hooks() -> None:
    assert run_tv(TvJob(TORCHVISION)).strip().endswith("ok")


TIMM = r"""
import copy, torch, timm, fxprobe
torch.manual_seed(0)
model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, depth=3).eval()
reference = copy.deepcopy(model)
ref = {}
for i, b in enumerate(reference.blocks):
    b.register_forward_hook(lambda m, a, o, i=i: ref.__setitem__(f"blocks.{i}.resid_post",
                                                                 o.clone()))
    b.attn.qkv.register_forward_hook(lambda m, a, o, i=i: ref.__setitem__(f"qkv{i}", o.clone()))
    b.mlp.fc2.register_forward_pre_hook(
        lambda m, a, i=i: ref.__setitem__(f"blocks.{i}.mlp.post", a[0].clone()))
tapped = fxprobe.tap(model, ops=["blocks.*.resid_post", "blocks.*.attn.q", "blocks.*.mlp.post"],
                     tracer="fx")
ex = fxprobe.extractor(model, ops="blocks.1.attn.v")
for batch in (2, 5):
    x = torch.randn(batch, 3, 32, 32)
    ref.clear()
    with torch.no_grad():
        assert torch.equal(tapped(x), reference(x))
        _, values = ex(x)
    for i in range(3):
        B, N, _ = ref[f"qkv{i}"].shape
        q, k, v = ref[f"qkv{i}"].reshape(B, N, 3, 3, 64).permute(2, 0, 3, 1, 4)
        assert torch.equal(tapped.taps[f"blocks.{i}.attn.q"], q)
        assert torch.equal(tapped.taps[f"blocks.{i}.resid_post"], ref[f"blocks.{i}.resid_post"])
        assert torch.equal(tapped.taps[f"blocks.{i}.mlp.post"], ref[f"blocks.{i}.mlp.post"])
        if i == 1:
            (value,) = values.values()
            assert torch.equal(value, v)
print("ok")
"""


@uses_tv(TvJob(TIMM))
def test_timm_vit_canonical_names_equal_hooks() -> None:
    assert run_tv(TvJob(TIMM)).strip().endswith("ok")
