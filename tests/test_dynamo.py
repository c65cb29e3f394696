"""The dynamo frontend on plain PyTorch models: a timm-style ViT with fused attention, graph
breaks, fx+dynamo, every capture mode. References: fx names, forward hooks, hand computations."""


from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import zoo
from dynamo_support import OPS, InplaceAfter, ViT, image, make_vit
from reference import hook_values, model_state, same, states_equal
from torch import nn

import fxprobe


def attention_by_hand(model: ViT, x: torch.Tensor, layer: int) -> torch.Tensor:
    """softmax(q k^T * scale) from the qkv projection's output, read by a forward hook."""
    attn = model.blocks[layer].attn
    _, seen = hook_values(model, [f"blocks.{layer}.attn.qkv"], x)
    b, n, _ = seen[f"blocks.{layer}.attn.qkv"].shape
    qkv = seen[f"blocks.{layer}.attn.qkv"].reshape(b, n, 3, attn.heads, attn.head_dim)
    q, k = qkv[:, :, 0].transpose(1, 2), qkv[:, :, 1].transpose(1, 2)
    return torch.softmax(q @ k.transpose(-2, -1) * attn.scale, dim=-1)


@pytest.fixture(scope="module")
def vit_all() -> tuple[ViT, fxprobe.TappedModule]:
    torch._dynamo.reset()
    model = make_vit()
    tapped = fxprobe.tap(model, ops=OPS + [fxprobe.attention_probs], tracer="dynamo")
    with torch.no_grad():
        tapped(image())
    return model, tapped


def test_vit_names_match_the_fx_frontend_and_values_match_hooks(vit_all: Any) -> None:
    model, tapped = vit_all
    fx_names = [s.name for s in fxprobe.tap(model, ops=OPS, tracer="fx").sites]
    dyn = [s for s in tapped.sites if s.target is not fxprobe.attention_probs]
    assert [s.name for s in dyn] == fx_names
    assert {s.how for s in tapped.sites} == {"dynamo"}
    assert "blocks.1.attn.scaled_dot_product_attention" in fx_names
    x = image(batch=2, seed=5)
    with torch.no_grad():
        out = tapped(x)
        expected, ref = hook_values(model, ["blocks.0.attn.qkv", "blocks.1.norm2", "head"], x)
    assert torch.equal(out, expected)
    for name, value in ref.items():
        assert torch.equal(tapped.taps[name], value), name
    assert tapped.dynamo_info[0].breaks == 0


def test_sdpa_attention_probabilities_equal_the_softmax_by_hand(vit_all: Any) -> None:
    model, tapped = vit_all
    x = image(batch=3, seed=7)
    with torch.no_grad():
        tapped(x)
        for layer in (0, 1):
            expected = attention_by_hand(model, x, layer)
            got = tapped.taps[f"blocks.{layer}.attn.attention_probs"]
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
            assert not torch.equal(got, torch.zeros_like(got))


def test_attention_probs_is_computed_only_where_selected() -> None:
    model = make_vit()
    tapped = fxprobe.tap(model, ops=fxprobe.attention_probs & fxprobe.where(
        lambda s: s.module_path == "blocks.1.attn"), tracer="dynamo")
    with torch.no_grad():
        tapped(image())
    assert [s.name for s in tapped.sites] == ["blocks.1.attn.attention_probs"]
    (graph,) = _instrumented_graphs(tapped)
    calls = [n for n in graph.nodes if n.target is fxprobe.attention_probs]
    assert len(calls) == 1  # layer 0 keeps its fused attention alone


def _instrumented_graphs(tapped: fxprobe.TappedModule) -> list[Any]:
    region = tapped._program().dynamo[""]  # a look inside: the graphs that run
    return [v.graph for c in region.captured for v in c.versions.values()]


def test_graph_breaks_keep_names_and_values() -> None:
    model = make_vit(brk=True)
    torch._dynamo.reset()
    tapped = fxprobe.tap(model, ops=OPS, tracer="dynamo")
    fx_names = [s.name for s in fxprobe.tap(make_vit(), ops=OPS, tracer="fx").sites]
    x = image()
    with torch.no_grad():
        out = tapped(x)
        tapped(image(seed=3))
        out = tapped(x)
        expected, ref = hook_values(model, ["blocks.0.mlp.fc2", "blocks.1.mlp.fc2",
                                            "blocks.1.attn.proj"], x)
    assert torch.equal(out, expected)
    assert sorted(s.name for s in tapped.sites) == sorted(fx_names)
    for name, value in ref.items():
        assert torch.equal(tapped.taps[name], value), name
    explained = torch._dynamo.explain(make_vit(brk=True))(x)
    info = tapped.dynamo_info[0]
    assert (info.graphs, info.breaks) == (explained.graph_count, explained.graph_break_count)
    assert info.breaks > 0
    assert f"{info.breaks} graph break(s)" in str(tapped.summary())


def test_fx_plus_dynamo_captures_what_fx_cannot_trace() -> None:
    model, (x,), _ = zoo.make("data_dependent")
    before = model_state(model)
    torch._dynamo.reset()
    tapped = fxprobe.tap(model, tracer="fx+dynamo")
    assert tapped.fallbacks == ()
    how = {s.name: s.how for s in tapped.sites}
    assert how["stem"] == how["gate"] == "fx"
    for sign in (1.0, -1.0):
        gen = torch.Generator().manual_seed(0)
        inp = torch.randn(3, 8, generator=gen)
        with torch.no_grad():
            while model.stem(inp).sum() * sign <= 0:  # an input that takes this branch
                inp = torch.randn(3, 8, generator=gen)
            out = tapped(inp)
            expected, ref = hook_values(model, ["stem", "gate", "gate.pos", "gate.neg.1"], inp)
        assert torch.equal(out, expected)
        taken = "gate.pos" if sign > 0 else "gate.neg.1"
        for name in ("stem", "gate", taken):
            assert torch.equal(tapped.taps[name], ref[name]), name
    how = {s.name: s.how for s in tapped.sites}
    assert how["gate.pos"] == how["gate.neg.1"] == "dynamo"
    tapped.remove()
    assert states_equal(before, model_state(model))


def test_selectors_are_checked_at_tap_or_at_the_first_forward() -> None:
    # no module path can fit: refused at tap(), before dynamo captures anything
    with pytest.raises(fxprobe.SelectorError, match="atn") as early:
        fxprobe.tap(make_vit(), ops=["*.atn.softmax"], tracer="dynamo")
    assert "attn" in str(early.value)
    # an op name inside a module only the capture can decide
    tapped = fxprobe.tap(make_vit(), ops=["blocks.0.attn.sofmax"], tracer="dynamo")
    with pytest.raises(fxprobe.SelectorError, match="first forward") as e:
        with torch.no_grad():
            tapped(image())
    assert "blocks.0.attn" in str(e.value)  # close names from what the forward found


def test_sites_needs_an_example_input_for_dynamo() -> None:
    model = make_vit()
    with pytest.raises(fxprobe.ConfigError, match="example_input"):
        fxprobe.sites(model, tracer="dynamo")
    names = fxprobe.sites(model, tracer="dynamo", example_input=image())
    assert "blocks.0.attn.qkv" in names and "blocks.1.attn.attention_probs" in names
    assert {r.how for r in names.records} == {"dynamo"}


def test_reference_capture_is_safe_from_later_inplace_ops() -> None:
    torch.manual_seed(0)
    model = InplaceAfter()
    tapped = fxprobe.tap(model, ops=[nn.Linear, torch.relu], tracer="dynamo")
    x = torch.randn(4, 8)
    with torch.no_grad():
        out = tapped(x)
        expected, ref = hook_values(model, ["fc"], x)
    assert torch.equal(out, expected)
    assert torch.equal(tapped.taps["fc"], ref["fc"])
    assert (ref["fc"] < 0).any()  # the copy matters: relu_ would have changed it


@pytest.mark.parametrize("mode", ["stats", "sample", "keep", "both", "to"])
def test_capture_modes_on_dynamo_sites(mode: str) -> None:
    model = make_vit()
    kw: dict[str, Any] = {"stats": {"reduce": "stats"}, "sample": {"reduce": "sample",
                          "sample_size": 16, "seed": 3}, "keep": {"keep": 3},
                          "both": {"capture": "both"}, "to": {"to": "cpu"}}[mode]
    tapped = fxprobe.tap(model, ops="blocks.*.mlp.fc2", tracer="dynamo", **kw)
    paths = ["blocks.0.mlp.fc2", "blocks.1.mlp.fc2"]
    xs = [image(seed=s) for s in range(4)]
    refs = []
    with torch.no_grad():
        for x in xs:
            tapped(x)
            refs.append(hook_values(model, paths, x)[1])
    last = refs[-1]
    for p in paths:
        got = tapped.taps[p]
        if mode == "stats":
            v = last[p].double()
            assert got.shape == tuple(v.shape)
            assert got.mean == pytest.approx(v.mean().item(), rel=1e-6)
            assert got.max == pytest.approx(v.max().item())
            assert got.min == pytest.approx(v.min().item())
        elif mode == "sample":
            assert torch.equal(got, fxprobe.sample_vector(last[p], 16, 3))
        elif mode == "keep":
            assert len(tapped.history) == 3
            for frame, ref in zip(tapped.history, refs[-3:], strict=True):
                assert torch.equal(frame[p], ref[p])
        elif mode == "both":
            _, ins = hook_values(model, [p.rsplit(".", 1)[0] + ".act"], xs[-1])
            assert torch.equal(got.output, last[p])
            assert torch.equal(got.inputs[0], ins[p.rsplit(".", 1)[0] + ".act"])
        else:
            assert got.device.type == "cpu" and torch.equal(got, last[p])


def test_fn_patches_a_query_head_and_a_head_output() -> None:
    model = make_vit()
    x = image()

    def fn(site: fxprobe.Site, value: torch.Tensor) -> torch.Tensor | None:
        if site.name == "blocks.0.attn.qkv":  # zero head 1 of the query
            value = value.clone()
            value[..., 16:32] = 0
            return value
        if site.name == "blocks.1.attn.scaled_dot_product_attention":
            value = value.clone()
            value[:, 0] = 0  # head 0's output
            return value
        return None

    tapped = fxprobe.tap(model, ops=["blocks.0.attn.qkv",
                                     "blocks.1.attn.scaled_dot_product_attention"],
                         tracer="dynamo", fn=fn)
    patched = copy.deepcopy(model)

    def zero_query_head(m: nn.Module, a: Any, out: torch.Tensor) -> torch.Tensor:
        out = out.clone()
        out[..., 16:32] = 0
        return out

    def zero_head_output(m: nn.Module, args: Any) -> Any:
        h = args[0].clone()  # (b, n, heads * head_dim) after transpose/reshape
        h[..., :16] = 0
        return (h,)

    patched.blocks[0].attn.qkv.register_forward_hook(zero_query_head)
    patched.blocks[1].attn.proj.register_forward_pre_hook(zero_head_output)
    with torch.no_grad():
        out = tapped(x)
        expected = patched(x)
        plain = model(x)
    assert torch.equal(out, expected) and not torch.equal(out, plain)
    assert set(tapped.taps.replaced) == {
        "blocks.0.attn.qkv", "blocks.1.attn.scaled_dot_product_attention"}


def test_model_untouched_and_outputs_equal() -> None:
    model = make_vit()
    before = model_state(model)
    tapped = fxprobe.tap(model, tracer="dynamo")
    with torch.no_grad():
        out = tapped(image())
        assert same(out, model(image()))
    assert len(tapped.taps) > 30
    tapped.remove()
    assert states_equal(before, model_state(model))


class EverySoftmax(nn.Module):
    """The spellings of one op that dynamo records differently."""

    def __init__(self) -> None:
        super().__init__()
        self.sm = nn.Softmax(dim=-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = F.softmax(x, dim=-1)
        b = torch.softmax(x * 2, -1)
        c = (x * 3).softmax(-1)
        d = torch.ops.aten._softmax(x * 4, -1, False)  # an ATen-level target
        e = self.sm(x * 5)  # a module call: its site is the module's path
        return a + b + c + d + e


def test_function_selector_matches_every_spelling() -> None:
    tapped = fxprobe.tap(EverySoftmax(), ops=F.softmax, tracer="dynamo")
    x = torch.randn(3, 5)
    with torch.no_grad():
        out = tapped(x)
    assert torch.equal(out, EverySoftmax()(x))
    assert list(tapped.taps) == ["softmax", "softmax_1", "softmax_2", "softmax_3", "sm"]
    for i, name in enumerate(tapped.taps):
        assert torch.equal(tapped.taps[name], torch.softmax(x * (i + 1), -1)), name


def test_fn_on_attention_probs_beside_sdpa_drives_the_attention_output() -> None:
    model = make_vit()
    x = image()

    def edit(p: torch.Tensor) -> torch.Tensor:
        p = p.clone()
        p[:, 0, 2] = 0.0
        p[:, 0, 2, 4] = 1.0  # head 0: token 2 attends to token 4 alone
        return p

    def fn(site: fxprobe.Site, value: torch.Tensor) -> torch.Tensor | None:
        return edit(value) if site.name == "blocks.0.attn.attention_probs" else None

    sdpa = "blocks.0.attn.scaled_dot_product_attention"
    tapped = fxprobe.tap(model, ops=["blocks.0.attn.attention_probs", sdpa, "blocks.0.attn"],
                         tracer="dynamo", fn=fn, capture="both")
    # By hand: layer 0's SDPA call replaced by edit(softmax(q k^T * scale)) @ v.
    real_sdpa, seen = F.scaled_dot_product_attention, []

    def by_hand(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: Any) -> torch.Tensor:
        if seen:
            return real_sdpa(q, k, v, **kw)
        out = edit(torch.softmax(q @ k.transpose(-2, -1) * q.size(-1) ** -0.5, dim=-1)) @ v
        seen.append((q, k, v, out))
        return out

    with torch.no_grad():
        got = tapped(x)
        plain = model(x)
        try:
            F.scaled_dot_product_attention = by_hand
            expected, ref = hook_values(model, ["blocks.0.attn"], x)
        finally:
            F.scaled_dot_product_attention = real_sdpa
    torch.testing.assert_close(got, expected)
    assert not torch.allclose(got, plain, atol=1e-3)
    assert tapped.taps.replaced == {"blocks.0.attn.attention_probs"}
    q, k, v, out = seen[0]
    # The call's sites read what flows on: the output of the edited pattern; their inputs
    # are still the call's.
    torch.testing.assert_close(tapped.taps[sdpa].output, out)
    for name in (sdpa, "blocks.0.attn.attention_probs"):
        assert all(torch.equal(a, b) for a, b in zip(tapped.taps[name].inputs, (q, k, v),
                                                       strict=True)), name
    torch.testing.assert_close(tapped.taps["blocks.0.attn"].output, ref["blocks.0.attn"])

    def in_place(site: fxprobe.Site, value: torch.Tensor) -> None:
        if site.name == "blocks.0.attn.attention_probs":
            value.copy_(edit(value))

    edited_in_place = fxprobe.tap(model, ops=fxprobe.attention_probs, tracer="dynamo",
                                  fn=in_place)
    with torch.no_grad():
        torch.testing.assert_close(edited_in_place(x), expected)

