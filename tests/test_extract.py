"""Tests of fxprobe.extractor against independent references.

References: the eager model's output; forward hooks on the user's model that clone each module's
output; a stock ``torch.fx.symbolic_trace`` run by an ``Interpreter`` that clones every node's
value as it is produced; values computed by hand.
"""


from __future__ import annotations

import copy
import io
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import zoo
from extract_support import TRACEABLE, _clone, assert_same, node_values
from torch import nn

from fxprobe.core.errors import ConfigError, SelectorError, TraceError, UnsupportedModelError
from fxprobe.core.select import where
from fxprobe.runtime.extract import extractor

# torch 2.13's Dynamo refuses nn.LSTM (the plain model too) unless allow_rnn=True.
COMPILABLE = [n for n in TRACEABLE if n != "lstm"]


def hooked_module_outputs(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
                          ) -> dict[str, Any]:
    """Module outputs captured by forward hooks that clone, named like sites (``fc``, ``fc_1``)."""
    seen: dict[str, list[Any]] = {}
    handles = []

    def make(path: str) -> Any:
        def hook(mod: nn.Module, inputs: Any, output: Any) -> None:
            seen.setdefault(path, []).append(_clone(output))
            return None
        return hook

    try:
        for path, m in model.named_modules():
            if path and not list(m.children()):
                handles.append(m.register_forward_hook(make(path)))
        with torch.no_grad():
            model(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    return {(p if i == 0 else f"{p}_{i}"): v
            for p, outs in seen.items() for i, v in enumerate(outs)}


@pytest.mark.parametrize("name", TRACEABLE)
def test_outputs_and_values_match_references(name: str) -> None:
    model, args, kwargs = zoo.make(name)
    with torch.no_grad():
        expected_out = model(*args, **kwargs)
    by_node = node_values(model, args, kwargs)
    by_hook = hooked_module_outputs(model, args, kwargs)

    ex = extractor(model)
    with torch.no_grad():
        out, values = ex(*args, **kwargs)
    assert_same(out, expected_out)
    assert len(values) == len(by_node)
    for (site, got), want in zip(values.items(), by_node, strict=True):
        try:
            assert_same(got, want)
        except AssertionError as e:
            raise AssertionError(f"site {site!r} differs from the node value") from e
    hooked = {k: v for k, v in by_hook.items() if k in values}
    assert hooked and set(hooked) == set(by_hook)  # every leaf-module call is a site
    for site, want in hooked.items():
        assert_same(values[site], want)


def test_inplace_model_values_by_hand() -> None:
    model, (x,), _ = zoo.make("inplace")
    _, v = extractor(model)(x)
    with torch.no_grad():
        bn = model.bn(model.lin(x))
        act = torch.relu(bn)
        mul = act * 2
        relu_ = torch.relu(mul)
        add_ = relu_ + 1
        sigmoid = torch.sigmoid(add_.view(-1))
    assert bool((bn < 0).any())  # the ReLU(inplace=True) after it has something to overwrite
    for site, want in {"bn": bn, "act": act, "mul": mul, "relu_": relu_,
                       "view": relu_.view(-1), "add_": add_, "sigmoid": sigmoid,
                       "relu": torch.relu(sigmoid)}.items():
        assert torch.equal(v[site], want), site


def test_resnet_bn1_is_the_value_before_the_inplace_relu() -> None:
    model, args, _ = zoo.make("resnet")
    captured = {}
    handle = model.bn1.register_forward_hook(
        lambda m, i, o: captured.__setitem__("bn1", o.clone()))
    try:
        with torch.no_grad():
            model(*args)
    finally:
        handle.remove()
    ex = extractor(model, ops=[nn.BatchNorm2d, nn.ReLU])
    _, v = ex(*args)
    assert torch.equal(v["bn1"], captured["bn1"]) and bool((v["bn1"] < 0).any())
    assert torch.equal(v["relu"], torch.relu(captured["bn1"]))
    bns = [p for p, m in model.named_modules() if isinstance(m, nn.BatchNorm2d)]
    relus = [p for p, m in model.named_modules() if isinstance(m, nn.ReLU)]
    assert set(v) == {*bns, *relus, *(f"{p}_1" for p in relus if p != "relu")}
    assert "clone()" in ex.code  # a method call (scriptable), not a Python helper


def _snapshot(model: nn.Module) -> dict[str, Any]:
    return {
        path: (type(m), m.training, dict(m.__dict__.get("_forward_hooks", {})),
               dict(m._forward_pre_hooks), sorted(m.__dict__), dict(m._parameters),
               dict(m._buffers), dict(m._modules))
        for path, m in model.named_modules()
    }


def test_shares_parameters_and_leaves_model_untouched() -> None:
    model, args, _ = zoo.make("resnet")
    before = _snapshot(model)
    ex = extractor(model, ops="layer1.*", train=True)
    assert ex.training and not model.training
    assert _snapshot(model) == before
    params = dict(model.named_parameters())
    ex_params = dict(ex.named_parameters())
    assert ex_params and all(p is params[k] for k, p in ex_params.items())
    buffers = dict(model.named_buffers())
    assert all(b is buffers[k] for k, b in ex.named_buffers())
    with torch.no_grad():
        ex.get_parameter("fc.weight").add_(1.0)  # training the extractor trains the model
    assert torch.equal(params["fc.weight"], ex.get_parameter("fc.weight"))
    ex.eval()
    assert all(not m.training for m in ex.modules())
    assert _snapshot(model) == before
    assert not any(m.training for m in model.modules())


def test_train_mode_traces_the_training_forward() -> None:
    model, args, _ = zoo.make("train_eval")
    names = list(extractor(model, train=True)(*args)[1])
    assert "dropout" in names and "sigmoid" not in names
    assert "sigmoid" in extractor(model)(*args)[1]
    assert not model.training


def test_selection() -> None:
    model, args, _ = zoo.make("resnet")
    _, v = extractor(model, ops=nn.Conv2d)(*args)
    assert list(v) == ["conv1", "layer1.0.conv1", "layer1.0.conv2", "layer1.1.conv1",
                       "layer1.1.conv2", "layer2.0.conv1", "layer2.0.conv2",
                       "layer2.0.downsample.0", "layer2.1.conv1", "layer2.1.conv2"]
    _, v = extractor(model, ops=[torch.flatten, "fc"])(*args)
    assert list(v) == ["flatten", "fc"]
    with pytest.raises(SelectorError, match="conv9"):
        extractor(model, ops="conv9")


def test_untraceable_submodule_is_named_and_leaf_modules_fixes_it() -> None:
    model, args, _ = zoo.make("data_dependent")
    with pytest.raises(TraceError) as info:
        extractor(model)
    msg = str(info.value)
    assert "'gate' (Gate)" in msg and "leaf_modules=['gate']" in msg and "fxprobe.tap" in msg
    assert "if x.sum() > 0" in msg  # where it failed
    ex = extractor(model, leaf_modules=["gate"])
    out, v = ex(*args)
    assert_same(out, model(*args))
    assert list(v) == ["x", "stem", "gate", "head", "relu"]


def test_untraceable_top_level() -> None:
    model, _, _ = zoo.make("untraceable_top")
    with pytest.raises(TraceError, match="top-level forward of UntraceableTop") as info:
        extractor(model)
    assert "leaf_modules cannot help" in str(info.value)


class _Counter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros(()))
        self.register_buffer("offset", torch.ones(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1  # fx would run this once, while tracing, and leave it out of the graph
        return x + self.offset


class _Counted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.count = _Counter()
        self.lin = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(self.count(x))


def test_inplace_writes_to_buffers_are_refused_before_they_happen() -> None:
    model = _Counted()
    with pytest.raises(TraceError) as info:
        extractor(model)
    assert "'count' (_Counter)" in str(info.value) and "'count.calls'" in str(info.value)
    assert "self.calls += 1" in str(info.value)
    assert model.count.calls.item() == 0  # tracing did not write into the model
    ex = extractor(model, leaf_modules=[_Counter])  # runs as written: counts every forward
    x = torch.randn(2, 3)
    for _ in range(3):
        out, v = ex(x)
    assert model.count.calls.item() == 3
    assert torch.equal(out, model.lin(x + 1)) and torch.equal(v["count"], x + 1)
    with pytest.raises(TraceError, match="top-level forward of _Counter"):
        extractor(_Counter())


def test_bad_arguments() -> None:
    model, _, _ = zoo.make("shared")
    with pytest.raises(ConfigError, match="tracer='fx'"):
        extractor(model, tracer="auto")
    with pytest.raises(UnsupportedModelError):
        extractor(nn.ModuleList([nn.Linear(2, 2)]))
    with pytest.raises(UnsupportedModelError):
        extractor(lambda x: x)  # type: ignore[arg-type]


class _Pair(nn.Module):
    def forward(self, x):  # unannotated: fxprobe cannot know what comes in or out
        return x, x * 2


class _TupleAtRisk(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pair = _Pair()

    def forward(self, x):
        p = self.pair(x)
        a = p[0]
        a.add_(1)  # writes into x, p[0] and the tuple p through them
        return a + p[1]


def test_values_of_unknown_type_are_copied_whole() -> None:
    x = torch.randn(5)
    ex = extractor(_TupleAtRisk(), leaf_modules=[_Pair])
    out, v = ex(x.clone())
    assert torch.equal(v["x"], x) and torch.equal(v["getitem"], x)
    assert isinstance(v["pair"], tuple)
    assert_same(v["pair"], (x, x * 2))
    assert torch.equal(out, (x + 1) + x * 2)
    assert "copy_tree" in ex.code and "getitem.clone()" in ex.code


def test_pickle_and_deepcopy_keep_the_copies() -> None:
    # Unpickling a GraphModule traces its code again; the Python copy helper must survive that.
    ex = extractor(_TupleAtRisk(), leaf_modules=[_Pair])
    buf = io.BytesIO()
    torch.save(ex, buf)
    buf.seek(0)
    for again in (torch.load(buf, weights_only=False), copy.deepcopy(ex)):
        x = torch.randn(4)
        _, v = again(x.clone())
        assert torch.equal(v["x"], x) and torch.equal(v["pair"][0], x)
        assert "copy_tree" in again.code


def test_torch_compile_fullgraph_has_no_graph_breaks() -> None:
    for name in COMPILABLE:
        model, args, kwargs = zoo.make(name)
        torch._dynamo.reset()
        explained = torch._dynamo.explain(extractor(model))(*args, **kwargs)
        assert (explained.graph_count, explained.graph_break_count) == (1, 0), name
    # With autograd on: the copies keep the joint graph valid around ReLU(inplace=True).
    model, args, _ = zoo.make("resnet")
    ex = extractor(model, ops=[nn.BatchNorm2d, "layer1.0.add"])
    want_out, want = ex(*args)
    torch._dynamo.reset()
    out, got = torch.compile(ex, fullgraph=True, backend="aot_eager")(*args)
    torch._dynamo.reset()
    torch.testing.assert_close((out, got), (want_out, want), rtol=0, atol=1e-6)
    (out.sum() + got["bn1"].sum()).backward()
    assert model.conv1.weight.grad is not None


def test_torch_compile_inductor() -> None:
    model, args, _ = zoo.make("inplace")  # not differentiable (nor is the model): no_grad
    ex = extractor(model)
    with torch.no_grad():
        want_out, want = ex(*args)
        torch._dynamo.reset()
        out, got = torch.compile(ex, fullgraph=True)(*args)
        torch._dynamo.reset()
    torch.testing.assert_close(out, want_out)
    assert list(got) == list(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k])


@pytest.mark.parametrize("name", TRACEABLE)
def test_export(name: str) -> None:
    model, args, kwargs = zoo.make(name)
    ex = extractor(model)
    exported = torch.export.export(ex, args, kwargs)
    assert_same(exported.module()(*args, **kwargs), ex(*args, **kwargs))


@pytest.mark.parametrize("name", TRACEABLE)
def test_script(name: str) -> None:
    model, args, kwargs = zoo.make(name)
    # Only tensors (LSTM returns a tuple): the dict is then typed Dict[str, Tensor].
    tensor_sites = where(lambda s: s.op_key in ("add", "mul", "relu", "sigmoid", "softmax") or (
        s.kind == "call_module" and s.module_type is not nn.LSTM))
    ex = extractor(model, ops=tensor_sites)
    scripted = torch.jit.script(ex)
    assert "Dict(str, Tensor)" in str(scripted.forward.schema)
    assert_same(scripted(*args, **kwargs), ex(*args, **kwargs))


def test_script_with_non_tensor_values_types_a_union() -> None:
    model, args, _ = zoo.make("encoder")
    ex = extractor(model)  # sites include x.shape (a list of ints) and B, T, C (ints)
    scripted = torch.jit.script(ex)
    assert "Dict(str, Union(" in str(scripted.forward.schema)
    assert_same(scripted(*args)[1]["attn.softmax"], ex(*args)[1]["attn.softmax"])


def test_script_fails_with_a_python_copy_helper() -> None:
    with pytest.raises(Exception, match="copy_tree|[Ll]ambda"):
        torch.jit.script(extractor(_TupleAtRisk(), leaf_modules=[_Pair]))


def test_functional_inplace_and_annotated_inputs() -> None:
    class M(nn.Module):
        def forward(self, x: torch.Tensor, scale: float = 2.0) -> torch.Tensor:
            y = x * scale
            F.relu(y, inplace=True)
            x.mul_(3)
            return y + x

    x = torch.randn(6)
    out, v = extractor(M())(x.clone(), 0.5)
    assert torch.equal(v["x"], x) and torch.equal(v["mul"], x * 0.5)
    assert torch.equal(out, torch.relu(x * 0.5) + x * 3)
    scripted = torch.jit.script(extractor(M(), ops=["x", "mul"]))
    assert_same(scripted(x.clone(), 0.5)[1], {"x": x, "mul": x * 0.5})

