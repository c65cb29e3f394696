"""The extractor's two graphs (train/eval, switched by ``.train()``/``.eval()``) and its
timm-style ``feature_info``, against forward hooks on the eager model in the same mode, shapes
read off hooked values, the model's own ``feature_info``, and torchvision's
``create_feature_extractor`` (in the torchvision venv)."""

from __future__ import annotations

import copy
import textwrap

import pytest
import torch
import zoo
from torch import nn
from tv_venv import TvJob, run_tv, uses_tv

from fxprobe.core.errors import SelectorError
from fxprobe.runtime.extract import extractor
from fxprobe.runtime.features import features


class Branchy(nn.Module):
    """Its forward takes another path in training mode (and BatchNorm uses batch statistics)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.bn(self.fc1(x))
        h = h * 2.0 if self.training else torch.tanh(h)
        return self.fc2(h)


def _hooked(model: nn.Module, x: torch.Tensor, names: list[str]) -> dict[str, torch.Tensor]:
    got: dict[str, torch.Tensor] = {}
    handles = [model.get_submodule(n).register_forward_hook(
        lambda m, a, o, n=n: got.__setitem__(n, o.detach().clone())) for n in names]
    try:
        with torch.no_grad():
            model(x)
    finally:
        for h in handles:
            h.remove()
    return got


def test_one_extractor_switches_graphs_with_train_and_eval() -> None:
    torch.manual_seed(0)
    model = Branchy().eval()
    x = torch.randn(6, 8)
    ex = extractor(model, ops=[nn.Linear, nn.BatchNorm1d, "mul", "tanh"])
    assert not ex.training
    with torch.no_grad():
        out, v = ex(x)
    assert list(v) == ["fc1", "bn", "tanh", "fc2"]
    want = _hooked(model, x, ["fc1", "bn", "fc2"])
    assert all(torch.equal(v[k], want[k]) for k in want)
    assert torch.equal(out, model(x).detach())
    assert torch.equal(v["tanh"], torch.tanh(want["bn"]))

    ex.train()
    model.train()
    assert ex.training
    with torch.no_grad():
        out, v = ex(x)
    assert list(v) == ["fc1", "bn", "mul", "fc2"]  # the training branch, not tanh
    want = _hooked(model, x, ["fc1", "bn", "fc2"])
    assert all(torch.equal(v[k], want[k]) for k in want)
    assert torch.equal(v["mul"], want["bn"] * 2.0)
    with torch.no_grad():
        assert torch.equal(out, model(x))
    model.eval()
    ex.eval()  # and back
    with torch.no_grad():
        assert "tanh" in ex(x)[1]


def test_train_flag_picks_the_first_mode_and_model_is_untouched() -> None:
    model = Branchy().eval()
    ex = extractor(model, return_nodes=["fc2"], train=True)
    assert ex.training and not model.training
    assert not any(m.training for m in model.modules())
    ex.eval()
    assert not any(m.training for m in ex.modules())
    assert not any(m.training for m in model.modules())


def test_a_site_of_one_mode_only_fails_when_switched_to() -> None:
    model, (x,), _ = zoo.make("train_eval")
    ex = extractor(model, return_nodes=["sigmoid"])  # only the eval forward has it
    with torch.no_grad():
        assert torch.equal(ex(x)["sigmoid"], torch.sigmoid(model.fc1(x)))
    with pytest.raises(SelectorError, match="no train-mode graph.*'sigmoid'"):
        ex.train()
    assert not ex.training


def test_deepcopy_keeps_both_graphs() -> None:
    torch.manual_seed(0)
    model = Branchy().eval()
    x = torch.randn(6, 8)
    ex = copy.deepcopy(extractor(model, ops=["mul", "tanh"]))
    with torch.no_grad():
        assert list(ex(x)[1]) == ["tanh"]
        ex.train()
        model.train()
        assert torch.equal(ex(x)[1]["mul"], _hooked(model, x, ["bn"])["bn"] * 2.0)


def test_channels_and_reduction_measured_at_the_first_call() -> None:
    model, (x,), _ = zoo.make("resnet")
    ex = extractor(model, return_nodes={"layer1": "a", "layer2": "b", "fc": "logits"})
    assert ex.channels() == [None, None, None]
    with torch.no_grad():
        feats = ex(x)
    want = _hooked(model, x, ["layer1", "layer2", "fc"])
    assert ex.channels() == [want["layer1"].shape[1], want["layer2"].shape[1],
                             want["fc"].shape[1]]
    assert ex.reduction() == [x.shape[-2] // want["layer1"].shape[-2],
                              x.shape[-2] // want["layer2"].shape[-2], None]
    assert [d["module"] for d in ex.feature_info] == ["layer1", "layer2", "fc"]
    assert [d["name"] for d in ex.feature_info] == list(feats)


def test_channels_and_reduction_from_the_models_feature_info() -> None:
    model, (x,), _ = zoo.make("resnet")
    model = copy.copy(model)
    model.feature_info = [{"module": "layer1", "num_chs": 123, "reduction": 7}]  # stated, kept
    ex = extractor(model, return_nodes=["layer1", "layer2"])
    assert ex.channels() == [123, None]
    with torch.no_grad():
        ex(x)
    layer2 = _hooked(model, x, ["layer2"])["layer2"]
    assert ex.channels() == [123, layer2.shape[1]]
    assert ex.reduction() == [7, x.shape[-2] // layer2.shape[-2]]


def test_features_switch_modes_too() -> None:
    torch.manual_seed(0)
    model = Branchy().eval()
    x = torch.randn(6, 8)
    feats = features(model, ["fc2"])
    with torch.no_grad():
        # features() lays out maps and token sequences; fc2's (B, 3) is neither: compare the
        # body, which feats.train() switches with it.
        assert torch.equal(feats.body(x)["fc2"], model(x))
        feats.train()
        model.train()
        assert feats.body.training
        assert torch.equal(feats.body(x)["fc2"], model(x))


_TV_SCRIPT = textwrap.dedent("""
    import torch
    from torch import nn
    from torchvision.models.feature_extraction import create_feature_extractor
    import fxprobe

    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 8, 3, stride=2, padding=1)
            self.bn = nn.BatchNorm2d(8)
            self.head = nn.Conv2d(8, 4, 1)

        def forward(self, x):
            h = self.bn(self.conv(x))
            h = h * 2.0 if self.training else torch.tanh(h)
            return self.head(h)

    torch.manual_seed(0)
    model = Branchy().eval()
    x = torch.randn(2, 3, 16, 16)
    nodes = {"bn": "bn", "head": "head"}
    tv = create_feature_extractor(model, return_nodes=nodes)
    ours = fxprobe.extractor(model, return_nodes=nodes)
    for mode in (False, True, False):
        tv.train(mode); ours.train(mode); model.train(mode)
        got, want = {}, {}
        handles = [model.get_submodule(n).register_forward_hook(
            lambda m, a, o, n=n: want.__setitem__(n, o.detach().clone())) for n in nodes]
        with torch.no_grad():
            model(x)
            t, o = tv(x), ours(x)
        for h in handles:
            h.remove()
        for k in nodes:
            assert torch.equal(o[k], want[k]), (mode, k)
            assert torch.equal(o[k], t[k]), (mode, k)
        print("mode", mode, "equal", list(o))
    print("channels", ours.channels(), "reduction", ours.reduction())
""")


@uses_tv(TvJob(_TV_SCRIPT))
def test_switching_modes_equals_torchvision_dual_graph() -> None:
    stdout = run_tv(TvJob(_TV_SCRIPT))
    assert stdout.count("equal ['bn', 'head']") == 3, stdout
    assert "channels [8, 4] reduction [2, 2]" in stdout
