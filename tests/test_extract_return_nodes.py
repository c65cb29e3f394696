"""extractor(return_nodes=...): torchvision's renaming dict, pruning after the last requested
value, and equality with create_feature_extractor."""

from __future__ import annotations

import textwrap
from typing import Any

import pytest
import torch
import zoo
from extract_support import TRACEABLE, assert_same, node_values
from torch import nn
from tv_venv import TvJob, run_tv, uses_tv

from fxprobe.core.errors import ConfigError, SelectorError
from fxprobe.runtime.extract import extractor


@pytest.mark.parametrize("name", TRACEABLE)
def test_return_nodes_every_site_renamed_in_the_order_given(name: str) -> None:
    model, args, kwargs = zoo.make(name)
    by_node = node_values(model, args, kwargs)
    names = list(extractor(model)(*args, **kwargs)[1])  # every node site, in graph order
    assert len(names) == len(by_node)
    renames = {n: f"out{i}" for i, n in reversed(list(enumerate(names)))}
    with torch.no_grad():
        got = extractor(model, return_nodes=renames)(*args, **kwargs)
    assert list(got) == list(renames.values())
    for i, n in enumerate(names):
        try:
            assert_same(got[f"out{i}"], by_node[i])
        except AssertionError as e:
            raise AssertionError(f"site {n!r} differs from the node value") from e


@pytest.mark.parametrize("name", ["resnet", "inplace"])
def test_return_nodes_each_site_alone_is_pruned_and_correct(name: str) -> None:
    # Each cut drops a different tail, in-place writes included: the value must not change.
    model, args, kwargs = zoo.make(name)
    by_node = node_values(model, args, kwargs)
    names = list(extractor(model)(*args, **kwargs)[1])
    for i, n in enumerate(names):
        with torch.no_grad():
            got = extractor(model, return_nodes=[n])(*args, **kwargs)
        assert list(got) == [n]
        try:
            assert_same(got[n], by_node[i])
        except AssertionError as e:
            raise AssertionError(f"site {n!r} differs from the node value") from e


def test_return_nodes_module_paths_are_module_outputs() -> None:
    model, args, _ = zoo.make("resnet")
    want: dict[str, torch.Tensor] = {}
    handles = [getattr(model, p).register_forward_hook(
        lambda m, i, o, p=p: want.__setitem__(p, o.clone())) for p in ("layer1", "layer2")]
    handles.append(model.layer2[0].register_forward_hook(
        lambda m, i, o: want.__setitem__("layer2.0", o.clone())))
    try:
        with torch.no_grad():
            model(*args)
    finally:
        for h in handles:
            h.remove()
    ex = extractor(model, return_nodes={"layer2.0": "block", "layer1": "feat1",
                                        "layer2": "feat2"})
    with torch.no_grad():
        got = ex(*args)
    assert list(got) == ["block", "feat1", "feat2"]
    for site, new in {"layer2.0": "block", "layer1": "feat1", "layer2": "feat2"}.items():
        assert torch.equal(got[new], want[site]), site
    assert len(model._forward_hooks) == 0 and len(model.layer1._forward_hooks) == 0


class _CountingHead(nn.Module):
    """A leaf whose forward has a Python side effect: whether it ran is observable."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.lin(x)


class _Trunk(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
        self.head = _CountingHead()

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        feat = self.body(x)
        return {"logits": self.head(feat).softmax(-1), "feat": feat}


def test_return_nodes_stops_computing_after_the_last_requested_value() -> None:
    model = _Trunk().eval()
    x = torch.randn(3, 8)
    full = extractor(model, leaf_modules=[_CountingHead])
    body = extractor(model, return_nodes={"body": "f"}, leaf_modules=[_CountingHead])
    full(x)
    head_copy = full.get_submodule("head")
    assert head_copy.calls == 1  # the full graph runs the head...
    got = body(x)
    assert not hasattr(body, "head")  # ...the pruned one does not even hold it
    assert torch.equal(got["f"], model.body(x))
    assert model.head.calls == 0


class _Checked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch._assert(x.shape[1] == 4, "x must have 4 features")
        y = self.a(x)
        torch._assert(x.shape[0] < 100, "at most 99 rows")  # after the requested value
        return self.b(y)


def test_return_nodes_keeps_checks_before_the_last_requested_value() -> None:
    ex = extractor(_Checked(), return_nodes=["a"])
    assert torch.equal(ex(torch.ones(2, 4))["a"], ex.a(torch.ones(2, 4)))
    with pytest.raises(AssertionError, match="4 features"):
        ex(torch.ones(2, 5))
    ex(torch.ones(200, 4))  # the later check is pruned with what follows it


def test_return_nodes_keeps_an_inplace_write_a_kept_op_reads() -> None:
    # InplaceZoo: y.relu_() and y.add_(1.0) return nothing used, yet sigmoid(y.view(-1)) reads
    # what they wrote; a plain dead-code elimination would drop them.
    model, (x,), _ = zoo.make("inplace")
    with torch.no_grad():
        act = torch.relu(model.bn(model.lin(x)))
        y = torch.relu(act * 2) + 1
        want = {"mul": act * 2, "sigmoid": torch.sigmoid(y.view(-1))}
        got = extractor(model, return_nodes=["mul", "sigmoid"])(x)
    assert bool((y != act * 2).any())  # the writes matter
    assert_same(got, want)


def test_return_nodes_copies_only_what_a_kept_write_overwrites() -> None:
    class M(nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            a = x * 1.5
            a.relu_()
            b = a + 1
            return a, b

    x = torch.randn(20)
    early = extractor(M(), return_nodes=["mul"])  # the write runs after: dropped, no copy
    both = extractor(M(), return_nodes=["mul", "add"])  # the write is needed by add: copy mul
    assert torch.equal(early(x)["mul"], x * 1.5)
    assert_same(both(x), {"mul": x * 1.5, "add": torch.relu(x * 1.5) + 1})
    assert "relu_" not in early.code and "clone" not in early.code
    assert "relu_" in both.code and "clone" in both.code


def test_return_nodes_compiles_exports_and_shares_parameters() -> None:
    model, args, _ = zoo.make("resnet")
    ex = extractor(model, return_nodes={"layer1": "a", "layer2.0.bn1": "b"})
    want = ex(*args)
    assert_same(torch.compile(ex, fullgraph=True, backend="eager")(*args), want)
    assert_same(torch.export.export(ex, args).module()(*args), want)
    params = {id(p) for p in model.parameters()}
    assert {id(p) for p in ex.parameters()} <= params
    assert id(model.fc.weight) not in {id(p) for p in ex.parameters()}


@pytest.mark.parametrize("bad, error, match", [
    (["layer1", "layer9"], SelectorError, "'layer9'.*Closest site names:.*layer1"),
    ({"layer1": "f", "layer2": "f"}, ConfigError, "several sites to 'f'"),
    ("layer1", ConfigError, "list of site names"),
    ([], ConfigError, "empty"),
    ([("layer1", "layer2")], ConfigError, "pair of strings"),
])
def test_return_nodes_errors(bad: Any, error: type[Exception], match: str) -> None:
    model, _, _ = zoo.make("resnet")
    with pytest.raises(error, match=match):
        extractor(model, return_nodes=bad)


def test_return_nodes_with_ops_is_refused() -> None:
    model, _, _ = zoo.make("resnet")
    with pytest.raises(ConfigError, match="both ops= and return_nodes="):
        extractor(model, ops=nn.Conv2d, return_nodes=["layer1"])




_TV_SCRIPT = textwrap.dedent("""
    import torch
    from torchvision.models import resnet18
    from torchvision.models.vision_transformer import VisionTransformer
    from torchvision.models.feature_extraction import create_feature_extractor
    import fxprobe
    torch.manual_seed(0)
    torch.set_num_threads(1)
    vit = VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=2,
                            hidden_dim=16, mlp_dim=32)
    cases = [
        (resnet18().eval(), torch.randn(2, 3, 64, 64),
         {"layer1": "f1", "layer2.0.relu_1": "mid", "layer3": "f3"}),
        (vit.eval(), torch.randn(2, 3, 32, 32),
         ["encoder.layers.encoder_layer_0.add", "encoder.ln"]),
    ]
    for model, x, nodes in cases:
        with torch.no_grad():
            want = create_feature_extractor(model, return_nodes=nodes)(x)
            got = fxprobe.extractor(model, return_nodes=nodes)(x)
        assert list(want) == list(got), (list(want), list(got))
        for k in want:
            assert torch.equal(want[k], got[k]), k
        print(type(model).__name__, "equal", list(got))
""")


@uses_tv(TvJob(_TV_SCRIPT))
def test_return_nodes_equals_torchvision_create_feature_extractor() -> None:
    stdout = run_tv(TvJob(_TV_SCRIPT))
    assert "ResNet equal ['f1', 'mid', 'f3']" in stdout
    assert "VisionTransformer equal" in stdout

