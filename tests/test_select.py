"""Selectors: types, every spelling of a function, globs, regexes, where() and combinators."""

from __future__ import annotations

import operator
import re

import pytest
import torch
import torch.nn.functional as F
import zoo
from torch import nn

import fxprobe


class _Spellings(nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        a = torch.add(x, y)
        b = x + y
        c = x.add(y)
        c += a
        d = torch.flatten(b, 1) + c.flatten(1)
        return F.relu(d) + torch.relu(d) + d.relu()


def _names(model: nn.Module, ops: object) -> list[str]:
    return [s.name for s in fxprobe.tap(model, ops=ops).sites]


def test_function_selector_matches_every_spelling() -> None:
    m = _Spellings()
    assert _names(m, torch.add) == ["add", "add_1", "add_2", "add_3", "add_4", "add_5", "add_6"]
    assert _names(m, operator.add) == _names(m, torch.add)
    assert _names(m, torch.flatten) == ["flatten", "flatten_1"]
    assert _names(m, F.relu) == ["relu", "relu_1", "relu_2"]
    assert _names(m, torch.relu) == _names(m, F.relu)


def test_type_glob_regex_and_where() -> None:
    model, _, _ = zoo.make("resnet")
    convs = _names(model, nn.Conv2d)
    assert convs[0] == "conv1" and "layer2.0.downsample.0" in convs and len(convs) == 10
    assert _names(model, "layer1.*.add") == ["layer1.0.add", "layer1.1.add"]
    assert _names(model, re.compile(r"^layer2\.\d\.relu_1$")) == [
        "layer2.0.relu_1", "layer2.1.relu_1"]
    assert _names(model, fxprobe.where(lambda s: s.kind == "placeholder")) == ["x"]


def test_regex_matches_anywhere_in_the_name() -> None:
    """An unanchored regex selects every site whose name contains a match (``re.search``), not
    only names that start with one."""
    model, _, _ = zoo.make("resnet")
    assert set(_names(model, re.compile(r"bn1"))) == {
        "bn1", "layer1.0.bn1", "layer1.1.bn1", "layer2.0.bn1", "layer2.1.bn1"}
    assert set(_names(model, re.compile(r"\.0\.(bn2|down)"))) == {
        "layer1.0.bn2", "layer2.0.bn2", "layer2.0.downsample", "layer2.0.downsample.0",
        "layer2.0.downsample.1"}


def test_combinators_and_lists() -> None:
    model, _, _ = zoo.make("resnet")
    in_layer1 = fxprobe.where(lambda s: s.name.startswith("layer1."))
    assert _names(model, in_layer1 & nn.BatchNorm2d) == [
        "layer1.0.bn1", "layer1.0.bn2", "layer1.1.bn1", "layer1.1.bn2"]
    assert _names(model, nn.Linear | fxprobe.where(lambda s: s.name == "x")) == ["x", "fc"]
    assert "layer1.0.conv1" not in _names(model, ~in_layer1)
    assert _names(model, [nn.Linear, torch.flatten]) == ["flatten", "fc"]


def test_selector_matching_nothing_names_it_and_suggests() -> None:
    model, _, _ = zoo.make("resnet")
    with pytest.raises(fxprobe.SelectorError) as err:
        fxprobe.tap(model, ops=["fc", "layer1.*.relu2"])
    msg = str(err.value)
    assert "'layer1.*.relu2'" in msg and "layer1.0.relu" in msg and "fxprobe.sites" in msg
    assert isinstance(err.value, LookupError) and isinstance(err.value, fxprobe.FxProbeError)
    with pytest.raises(fxprobe.SelectorError, match="LSTM"):
        fxprobe.tap(model, ops=nn.LSTM)


@pytest.mark.parametrize("bad", [42, nn.Linear(2, 2), int, [], 3.5])
def test_unsupported_selector_types(bad: object) -> None:
    model, _, _ = zoo.make("shared")
    with pytest.raises(fxprobe.FxProbeError) as err:
        fxprobe.tap(model, ops=bad)
    assert "selector" in str(err.value) or "ops=" in str(err.value)


class _Modules(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.flat = nn.Flatten()
        self.act = nn.ReLU()
        self.soft = nn.Softmax(dim=-1)
        self.gelu = nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.act(self.flat(x)) + torch.flatten(x, 1).relu()
        return self.soft(self.gelu(y)) + F.softmax(F.gelu(y), -1)


def test_function_selectors_match_their_module_spellings() -> None:
    model = _Modules()
    assert _names(model, torch.flatten) == ["flat", "flatten"]
    assert _names(model, F.relu) == ["act", "relu"]
    assert _names(model, F.gelu) == ["gelu", "gelu_1"]
    assert _names(model, torch.softmax) == ["soft", "softmax"]


def test_in_a_list_a_type_or_function_may_match_nothing_but_a_pattern_may_not() -> None:
    model, _, _ = zoo.make("resnet")
    # One list for many models: the model has no GELU or LayerNorm, and that is fine.
    assert _names(model, [nn.Conv2d, nn.LayerNorm, F.gelu])[:2] == ["conv1", "layer1.0.conv1"]
    with pytest.raises(fxprobe.SelectorError, match="'layr1.*'"):
        fxprobe.tap(model, ops=[nn.Conv2d, "layr1.*"])
    with pytest.raises(fxprobe.SelectorError, match="LayerNorm"):
        fxprobe.tap(model, ops=[nn.LayerNorm, F.gelu])  # the union matches nothing
    with pytest.raises(fxprobe.SelectorError, match="LayerNorm"):
        fxprobe.tap(model, ops=nn.LayerNorm)


def test_no_match_says_which_fallback_hid_the_op(dynamo_fails: None) -> None:
    # tracer="auto" tries dynamo on the module fx cannot trace, so the check waits for the
    # first forward; with dynamo failing there too, the module runs as written.
    model, (x,), _ = zoo.make("data_dependent")
    tapped = fxprobe.tap(model, ops=torch.sum)
    with pytest.raises(fxprobe.SelectorError, match="first forward") as err:
        tapped(x)
    text = str(err.value)
    assert "run as written" in text and "gate" in text and "control flow" in text
    assert "torch dynamo failed too" in text


def test_an_op_inside_an_untraceable_module_is_reached_by_dynamo() -> None:
    model, (x,), _ = zoo.make("data_dependent")
    tapped = fxprobe.tap(model, ops=torch.sum)  # only the module fx cannot trace has one
    with torch.no_grad():
        tapped(x)
        h = model.stem(x)  # the Gate's input (zoo.DataDependent)
    assert [(s.name, s.how) for s in tapped.sites] == [("gate.sum", "dynamo")]
    assert torch.equal(tapped.taps["gate.sum"], h.sum())


class _Branchy(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x if x.sum() > 0 else -x  # data-dependent: runs as written


class _FlattenGate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pos = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.flatten(x, 1)
        return self.pos(y) if y.sum() > 0 else -y


class _ManyFallbacks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = _Branchy(), _Branchy(), _Branchy()
        self.gate = _FlattenGate()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gate(self.c(self.b(self.a(x))))


@pytest.mark.parametrize("ops", [torch.flatten, "gate.flatten", "gate.*.add"])
def test_no_match_names_the_fallback_that_hid_it_first(ops: object, dynamo_fails: None
                                                      ) -> None:
    # Four modules run as written (fx and then dynamo failed on them); the message lists
    # three, so the one that holds the op (its forward calls torch.flatten; the pattern is
    # under its path) must come first.
    tapped = fxprobe.tap(_ManyFallbacks(), ops=ops)
    with pytest.raises(fxprobe.SelectorError) as err:
        tapped(torch.randn(2, 4))
    text = str(err.value)
    assert "4 module(s) run as written" in text and "(and 1 more)" in text
    assert text.index("gate: TraceError") < text.index("a: TraceError")
    assert "is probably inside module 'gate' (_FlattenGate)" in text


def test_no_match_with_no_likely_fallback_guesses_none(dynamo_fails: None) -> None:
    tapped = fxprobe.tap(_ManyFallbacks(), ops=torch.tanh)
    with pytest.raises(fxprobe.SelectorError) as err:
        tapped(torch.randn(2, 4))
    assert "run as written" in str(err.value) and "probably inside" not in str(err.value)


def test_no_match_after_dynamo_captured_everything_is_raised_at_the_first_forward() -> None:
    tapped = fxprobe.tap(_ManyFallbacks(), ops=torch.tanh)  # no tanh anywhere
    x = torch.randn(2, 4)
    with pytest.raises(fxprobe.SelectorError, match="torch.tanh") as err:
        tapped(x)
    assert "first forward" in str(err.value) and "run as written" not in str(err.value)
    assert tapped.fallbacks == ()  # dynamo ran all four modules fx could not trace


class _SdpaAttn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.qkv, self.proj = nn.LayerNorm(8), nn.Linear(8, 24), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.norm(x)).chunk(3, -1)
        return x + self.proj(F.scaled_dot_product_attention(q, k, v))


@pytest.mark.parametrize("ops", ["softmax", "*.attn.softmax", torch.softmax, "*attn_probs*"])
def test_a_softmax_selector_on_sdpa_suggests_the_sdpa_sites_and_attention_probs(
        ops: object) -> None:
    model = nn.Sequential(_SdpaAttn(), _SdpaAttn())
    with pytest.raises(fxprobe.SelectorError) as info:
        fxprobe.tap(model, ops=ops)
    msg = str(info.value)
    assert "0.scaled_dot_product_attention, 1.scaled_dot_product_attention" in msg
    assert "fxprobe.attention_probs" in msg and "norm" not in msg.split("Ops present")[0]
    # What it suggests selects those sites, and their values are the op's own.
    x = torch.randn(2, 4, 8)
    for suggested in (F.scaled_dot_product_attention, "*.scaled_dot_product_attention"):
        tapped = fxprobe.tap(model, ops=suggested)
        with torch.no_grad():
            tapped(x)
            q, k, v = model[0].qkv(model[0].norm(x)).chunk(3, -1)
            assert torch.equal(tapped.taps["0.scaled_dot_product_attention"],
                               F.scaled_dot_product_attention(q, k, v))
    assert "tracer='dynamo'" in msg
    probs = fxprobe.tap(model, ops=fxprobe.attention_probs, tracer="dynamo")
    with torch.no_grad():
        probs(x)
        q, k, _ = model[0].qkv(model[0].norm(x)).chunk(3, -1)
        want = torch.softmax(q @ k.transpose(-2, -1) / 8 ** 0.5, -1)
    assert list(probs.taps) == ["0.attention_probs", "1.attention_probs"]
    torch.testing.assert_close(probs.taps["0.attention_probs"], want)


# -- a module of the model as a selector (ops=model.conv1) ------------------------------------

class _Twice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.out = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.lin(self.lin(x))))


@pytest.mark.parametrize("tracer", ["auto", "fx", "hooks", "dynamo"])
def test_a_module_of_the_model_selects_its_calls(tracer: str) -> None:
    from reference import hook_values

    torch.manual_seed(0)
    model = _Twice().eval()
    x = torch.randn(3, 4)
    expected, ref = hook_values(model, ["lin", "out"], x)
    tapped = fxprobe.tap(model, ops=model.lin, tracer=tracer)
    with torch.no_grad():
        assert torch.equal(tapped(x), expected)
    assert sorted(tapped.taps.keys()) == ["lin", "lin_1"]
    for name in ("lin", "lin_1"):
        assert torch.equal(tapped.taps[name], ref[name])
    both = fxprobe.tap(model, ops=[model.out, "lin"], tracer=tracer)
    with torch.no_grad():
        both(x)
    assert torch.equal(both.taps["out"], ref["out"]) and torch.equal(both.taps["lin"], ref["lin"])


def test_a_module_selects_in_the_extractor_and_the_pictures() -> None:
    from reference import hook_values

    torch.manual_seed(0)
    model = _Twice().eval()
    x = torch.randn(3, 4)
    expected, ref = hook_values(model, ["lin"], x)
    out, feats = fxprobe.extractor(model, ops=model.lin)(x)
    assert torch.equal(out, expected) and sorted(feats) == ["lin", "lin_1"]
    assert all(torch.equal(feats[n], ref[n]) for n in feats)
    drawn = fxprobe.to_dot(model, ops=model.lin).source  # marks what "lin*" marks
    assert drawn == fxprobe.to_dot(model, ops="lin*").source != fxprobe.to_dot(model).source


def test_a_module_not_in_the_model_is_a_clear_error() -> None:
    model = _Twice()
    with pytest.raises(fxprobe.SelectorError, match="not part of the model"):
        fxprobe.tap(model, ops=nn.Linear(4, 4))
    with pytest.raises(fxprobe.SelectorError, match="not part of the model"):
        fxprobe.tap(model, ops=[model.lin, _Twice().out])


def test_a_module_selects_in_intervene_and_run_with_cache() -> None:
    from reference import hook_values

    torch.manual_seed(0)
    model = _Twice().eval()
    x = torch.randn(3, 4)
    tapped = fxprobe.tap(model, ops="out", tracer="dynamo")
    with torch.no_grad():
        tapped(x)
        handle = model.lin.register_forward_hook(lambda m, a, out: out * 0)
        want = model(x)
        handle.remove()
        with tapped.intervene({model.lin: lambda s, v: v * 0}):
            got = tapped(x)
        assert torch.equal(got, want)
        expected, ref = hook_values(model, ["lin"], x)
        out, cache = tapped.run_with_cache(x, names=model.lin)
        assert torch.equal(out, expected) and sorted(cache) == ["lin", "lin_1"]
        assert torch.equal(cache["lin"], ref["lin"]) and torch.equal(cache["lin_1"], ref["lin_1"])
        # The tapped module's own copy of the module names the same calls.
        out, cache = tapped.run_with_cache(x, names=[tapped.lin])
        assert sorted(cache) == ["lin", "lin_1"]
