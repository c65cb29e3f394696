"""Review of the vision round (features, layout, fx call names, export): silent wrong answers
found by comparing with independent references (forward hooks that clone on an untapped copy,
eager outputs), each pinned here with plain torch."""

from __future__ import annotations

import copy

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
