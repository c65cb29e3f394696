"""Review of the vision round (features, layout, fx call names, export): silent wrong answers
found by comparing with independent references (forward hooks that clone on an untapped copy,
eager outputs), each pinned here with plain torch."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fxprobe


class _Lin(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


class _TwoCalls(nn.Module):
    """A child named ``layer_0`` called twice, beside a child ``layer`` (called twice too)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer_0, self.layer = _Lin(), _Lin()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layer_0(x)
        x = self.layer_0(x) * 2
        x = self.layer(x)
        return self.layer(x) + 1


def _hooked(model: nn.Module, paths: list[str], x: torch.Tensor) -> dict[str, list[torch.Tensor]]:
    ref: dict[str, list[torch.Tensor]] = {}
    untapped = copy.deepcopy(model)
    for path in paths:
        untapped.get_submodule(path).register_forward_hook(
            lambda m, i, o, path=path: ref.setdefault(path, []).append(o.detach().clone()))
    untapped(x)
    return ref


def test_fx_call_of_layer_is_named_layer_beside_a_layer_0():
    # The first call of `layer_0` kept its own _0 but counted as a call of `layer`: the first
    # call of module `layer` was named layer_1 (no site `layer`), its second layer_2.
    torch.manual_seed(0)
    m, x = _TwoCalls().eval(), torch.randn(2, 4)
    ref = _hooked(m, ["layer_0", "layer"], x)
    names = [s.name for s in fxprobe.sites(m).modules]
    assert names == ["layer_0", "layer_0_1", "layer", "layer_1"]
    got = fxprobe.extractor(m, return_nodes=names)(x)
    want = [ref["layer_0"][0], ref["layer_0"][1], ref["layer"][0], ref["layer"][1]]
    for name, w in zip(names, want, strict=True):
        torch.testing.assert_close(got[name], w, rtol=0, atol=0)


class _Tokens(nn.Module):
    """Patch tokens with no class token and no declared grid (LeViT's blocks are so)."""

    def __init__(self) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, 8, 4, stride=4)
        self.blocks = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(self.patch(x).flatten(2).transpose(1, 2))


def test_features_tokens_of_a_non_square_image_take_its_grid():
    # A 32x8 image makes a 8x2 grid of 16 tokens: the square root laid them out 4x4, silently
    # (timm's LeViT at 256x64 gave (B, 128, 8, 8) where forward_intermediates gives 16x4).
    torch.manual_seed(0)
    m = _Tokens().eval()
    for shape, grid in (((32, 8), (8, 2)), ((8, 32), (2, 8)), ((28, 20), (7, 5))):
        x = torch.randn(2, 3, *shape)
        tokens = m.blocks[0](m.patch(x).flatten(2).transpose(1, 2))
        want = tokens.transpose(1, 2).reshape(2, 8, *grid)
        got, = fxprobe.features(m, [0])(x)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        nhwc, = fxprobe.features(m, [0], output_fmt="NHWC")(x)
        torch.testing.assert_close(nhwc, want.permute(0, 2, 3, 1), rtol=0, atol=0)


class _PreHooked(nn.Module):
    """feature_info as timm's feature_location='expansion' writes it: the input of ``pw``
    (hook_type='forward_pre', 12 channels), whose output has 4."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 12, 3, stride=2, padding=1)
        self.pw = nn.Conv2d(12, 4, 1)
        self.feature_info = [
            {"module": "pw", "hook_type": "forward_pre", "num_chs": 12, "reduction": 2}]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pw(self.stem(x))


def test_extractor_channels_not_taken_from_a_forward_pre_feature_info():
    # The extractor returns pw's output (4 channels) and reported the entry's 12.
    m, x = _PreHooked().eval(), torch.randn(1, 3, 16, 12)
    ex = fxprobe.extractor(m, return_nodes=["pw"])
    out = ex(x)
    assert out["pw"].shape[1] == 4
    assert ex.channels() == [4] and ex.reduction() == [2]


def test_features_refuses_a_forward_pre_feature_info():
    # It took pw's output (4 channels) where the entry means pw's input (12).
    m = _PreHooked().eval()
    with pytest.raises(fxprobe.ConfigError, match="forward_pre"):
        fxprobe.features(m)
