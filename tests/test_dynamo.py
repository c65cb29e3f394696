"""The dynamo frontend on plain PyTorch models: a timm-style ViT with fused attention, graph
breaks, fx+dynamo, every capture mode. References: fx names, forward hooks, hand computations."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import zoo
from reference import hook_values, model_state, same, states_equal
from torch import nn

import fxprobe


class Attention(nn.Module):
    """timm's ``Attention`` with ``fused_attn=True``."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.head_dim = dim // heads
        self.scale = self.head_dim ** -0.5
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        x = F.scaled_dot_product_attention(q, k, v)
        x = x.transpose(1, 2).reshape(b, n, c)
        return self.proj(x)


class Mlp(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, dim * 2)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(dim * 2, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, brk: bool = False) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = Mlp(dim)
        self.brk = brk

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        if self.brk:
            torch._dynamo.graph_break()  # a no-op in eager; splits the captured graph
        return x + self.mlp(self.norm2(x))


class ViT(nn.Module):
    """A timm-style ViT: patch embedding, class token, blocks with fused attention."""

    def __init__(self, dim: int = 32, heads: int = 2, depth: int = 2, brk: bool = False) -> None:
        super().__init__()
        self.patch_embed = nn.Conv2d(3, dim, kernel_size=4, stride=4)
        self.cls_token = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
        self.pos_embed = nn.Parameter(torch.randn(1, 5, dim) * 0.02)
        self.blocks = nn.Sequential(*[Block(dim, heads, brk) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        x = self.norm(self.blocks(x))
        return self.head(x[:, 0])


def make_vit(brk: bool = False) -> ViT:
    torch.manual_seed(0)
    return ViT(brk=brk).eval()


def image(batch: int = 2, seed: int = 1) -> torch.Tensor:
    return torch.randn(batch, 3, 8, 8, generator=torch.Generator().manual_seed(seed))


def attention_by_hand(model: ViT, x: torch.Tensor, layer: int) -> torch.Tensor:
    """softmax(q k^T * scale) from the qkv projection's output, read by a forward hook."""
    attn = model.blocks[layer].attn
    _, seen = hook_values(model, [f"blocks.{layer}.attn.qkv"], x)
    b, n, _ = seen[f"blocks.{layer}.attn.qkv"].shape
    qkv = seen[f"blocks.{layer}.attn.qkv"].reshape(b, n, 3, attn.heads, attn.head_dim)
    q, k = qkv[:, :, 0].transpose(1, 2), qkv[:, :, 1].transpose(1, 2)
    return torch.softmax(q @ k.transpose(-2, -1) * attn.scale, dim=-1)


OPS = [F.scaled_dot_product_attention, torch.add, nn.Linear, nn.LayerNorm, nn.GELU]


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
    assert tapped.captures[0].breaks == 0


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
    info = tapped.captures[0]
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


def test_selectors_are_checked_at_the_first_forward() -> None:
    tapped = fxprobe.tap(make_vit(), ops=["*.atn.softmax"], tracer="dynamo")
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


class InplaceAfter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        h.relu_()  # overwrites the Linear's output in place
        h += 1.0
        return h * 2


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


def test_grad_on_dynamo_sites_matches_autograd() -> None:
    model = make_vit()
    tapped = fxprobe.tap(model, ops=["blocks.1.attn.qkv", "blocks.0.norm2"], tracer="dynamo",
                         grad=True)
    x = image()
    tapped(x).square().sum().backward()
    seen: dict[str, torch.Tensor] = {}

    def keep(name: str) -> Any:
        def hook(m: nn.Module, a: Any, out: torch.Tensor) -> None:
            out.retain_grad()
            seen[name] = out

        return hook

    ref_model = copy.deepcopy(model)
    ref_model.zero_grad()
    ref_model.blocks[1].attn.qkv.register_forward_hook(keep("blocks.1.attn.qkv"))
    ref_model.blocks[0].norm2.register_forward_hook(keep("blocks.0.norm2"))
    ref_model(x).square().sum().backward()
    for name, value in seen.items():
        assert value.grad is not None
        torch.testing.assert_close(tapped.grads[name], value.grad, rtol=0, atol=0)
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None for g in grads)  # training through the tapped module trains it


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


# -- tracer="auto": fx, then dynamo for what fx cannot trace, then hooks ----------------------

def test_auto_never_uses_dynamo_when_fx_traces_everything(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    def no_compile(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("torch.compile was called for an fx-traceable model")

    monkeypatch.setattr(torch, "compile", no_compile)
    model = make_vit()
    tapped = fxprobe.tap(model, ops=OPS)
    x = image()
    with torch.no_grad():
        out = tapped(x)
        expected, ref = hook_values(model, ["blocks.0.attn.qkv", "head"], x)
    assert torch.equal(out, expected) and torch.equal(tapped.taps["head"], ref["head"])
    assert {s.how for s in tapped.sites} == {"fx"} and tapped.captures == ()
    assert [s.name for s in tapped.sites] == [
        s.name for s in fxprobe.tap(model, ops=OPS, tracer="fx").sites]


def _taking(model: nn.Module, sign: float) -> torch.Tensor:
    """An input for zoo's DataDependent whose gate takes the positive (or negative) branch."""
    gen = torch.Generator().manual_seed(0)
    inp = torch.randn(3, 8, generator=gen)
    while model.stem(inp).sum() * sign <= 0:
        inp = torch.randn(3, 8, generator=gen)
    return inp


def test_auto_runs_what_fx_cannot_trace_under_dynamo_after_listing_hooks() -> None:
    model, _, _ = zoo.make("data_dependent")
    before = model_state(model)
    tapped = fxprobe.tap(model, ops=[nn.Linear, torch.sum])
    # Before the first forward: what fx and hooks know (the fallback is still listed).
    assert [(s.name, s.how) for s in tapped.sites] == [
        ("stem", "fx"), ("gate.pos", "hook"), ("gate.neg.0", "fx"), ("head", "fx")]
    assert [f.path for f in tapped.fallbacks] == ["gate"]
    for sign in (1.0, -1.0):
        inp = _taking(model, sign)
        with torch.no_grad():
            out = tapped(inp)
            expected, ref = hook_values(model, ["stem", "gate.pos", "gate.neg.0", "head"], inp)
        assert torch.equal(out, expected)
        taken = "gate.pos" if sign > 0 else "gate.neg.0"
        for name in ("stem", taken, "head"):
            assert torch.equal(tapped.taps[name], ref[name]), name
        assert torch.equal(tapped.taps["gate.sum"], ref["stem"].sum())
    how = {s.name: s.how for s in tapped.sites}
    assert how == {"stem": "fx", "head": "fx", "gate.pos": "dynamo", "gate.neg.0": "dynamo",
                   "gate.sum": "dynamo"}
    assert tapped.fallbacks == ()
    assert [c.path for c in tapped.captures] == ["gate"]  # stem and head: fx only
    assert "gate: " in "\n".join(tapped.summary().notes)
    assert "1 dynamo" in tapped.summary().notes[0] or "dynamo)" in tapped.summary().notes[0]
    tapped.remove()
    assert states_equal(before, model_state(model))


def test_auto_defers_a_selector_only_dynamo_can_match_to_the_first_forward() -> None:
    model, (x,), _ = zoo.make("data_dependent")
    tapped = fxprobe.tap(model, ops="gate.sum")  # no fx or hook site has this name
    assert tapped.sites == ()
    with torch.no_grad():
        tapped(x)
    assert [s.name for s in tapped.sites] == ["gate.sum"]
    assert torch.equal(tapped.taps["gate.sum"], model.stem(x).sum())
    typo = fxprobe.tap(model, ops="gate.summ")
    with pytest.raises(fxprobe.SelectorError, match="gate.summ") as err, torch.no_grad():
        typo(x)
    assert "first forward" in str(err.value) and "gate.sum" in str(err.value)


def test_auto_falls_back_to_hooks_when_dynamo_fails(dynamo_fails: None) -> None:
    model, _, _ = zoo.make("data_dependent")
    tapped = fxprobe.tap(model, ops=nn.Linear)
    for sign in (1.0, -1.0):
        inp = _taking(model, sign)
        with torch.no_grad():
            out = tapped(inp)
            expected, ref = hook_values(model, ["gate.pos", "gate.neg.0"], inp)
        assert torch.equal(out, expected)  # the forward that works eagerly still works
        (name,) = ref
        assert torch.equal(tapped.taps[name], ref[name])
    assert {s.name: s.how for s in tapped.sites}["gate.pos"] == "hook"
    (fb,) = tapped.fallbacks
    assert fb.path == "gate" and "control flow" in fb.error
    assert "torch dynamo failed too" in fb.error and "dynamo fails here" in fb.error
    assert tapped.captures[0].graphs == 0


class _CountsThenBreaks(nn.Module):
    """Writes a buffer in place, then a graph break: two graphs."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        y = self.lin(x)
        return y * 2 if y.sum() > 0 else -y  # data-dependent: fx cannot trace it


def test_auto_refuses_to_run_twice_what_wrote_model_state(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    real = fxprobe.frontends.dynamo.DynamoRegion.backend

    def second_graph_fails(self: Any, gm: Any, example_inputs: Any) -> Any:
        if self.graphs:
            raise RuntimeError("the second graph fails")
        return real(self, gm, example_inputs)

    monkeypatch.setattr(fxprobe.frontends.dynamo.DynamoRegion, "backend", second_graph_fails)
    torch.manual_seed(0)
    model = nn.Sequential(_CountsThenBreaks())
    tapped = fxprobe.tap(model, ops=nn.Linear)
    with pytest.raises(fxprobe.CaptureError, match="in place") as err, torch.no_grad():
        tapped(torch.randn(2, 4))
    assert "the second graph fails" in str(err.value)
    assert model[0].calls.item() == 1  # written once, as the forward did before failing


def test_sites_under_auto_lists_dynamo_sites_only_with_an_example_input() -> None:
    model, (x,), _ = zoo.make("data_dependent")
    plain = fxprobe.sites(model)
    assert "gate.pos" in plain and "gate.sum" not in plain
    assert [f.path for f in plain.fallbacks] == ["gate"]
    found = fxprobe.sites(model, example_input=x)
    how = {r.name: r.how for r in found.records}
    assert how["stem"] == "fx" and how["gate.sum"] == "dynamo"
    assert found.fallbacks == ()
    vit = make_vit()  # fx traces it whole: an example input changes nothing, runs no dynamo
    for tracer in ("auto", "fx+dynamo"):
        assert fxprobe.sites(vit, tracer=tracer, example_input=image()) == fxprobe.sites(vit)


def test_graphs_copied_and_outplaced_include_dynamo_graphs() -> None:
    torch.manual_seed(0)
    model = InplaceAfter()
    tapped = fxprobe.tap(model, ops=[nn.Linear], tracer="dynamo")
    assert tapped.graphs == {} and tapped.copied == frozenset()
    with torch.no_grad():
        tapped(torch.randn(4, 8))
    (key,) = tapped.graphs
    assert key == "dynamo::0"
    graph = tapped.graphs[key]
    assert any(n.op == "call_function" and "linear" in str(n.target) for n in graph.nodes)
    assert tapped.copied == {"fc"}  # relu_ overwrites it: copied (see the test above)
    vit = fxprobe.tap(make_vit(brk=True), ops=nn.Linear, tracer="dynamo")
    with torch.no_grad():
        vit(image())
    keys = list(vit.graphs)
    assert keys[0] == "dynamo::0" and len(keys) == len(set(keys)) >= 3
    assert all(k.startswith("dynamo::") for k in keys)
    assert any("@blocks.1" in k for k in keys)  # a graph reused for another block


class _Skips(nn.Module):
    """Calls its untraceable gate only for inputs with a positive sum."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = zoo.Gate(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gate(x) if x.sum() > 0 else x


def test_a_module_split_by_a_graph_break_names_its_ops_by_its_own_path() -> None:
    # The gate's forward breaks the graph, so dynamo runs it as a frame of its own, whose
    # graph receives no parameter: its module is found from the code the frame runs.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), _Skips()).eval()
    gen = torch.Generator().manual_seed(0)
    x = next(x for x in (torch.randn(2, 8, generator=gen) for _ in range(20))
             if model[0](x).sum() > 0)  # the gate runs
    tapped = fxprobe.tap(model, ops=["1.gate.sum", "1.sum"])
    with torch.no_grad():
        out = tapped(x)
    assert torch.equal(out, model(x))
    assert [(s.name, s.how) for s in tapped.sites] == [("1.sum", "dynamo"),
                                                       ("1.gate.sum", "dynamo")]
    h = model[0](x)
    assert torch.equal(tapped.taps["1.sum"], h.sum())  # _Skips' own test
    assert torch.equal(tapped.taps["1.gate.sum"], h.sum())  # the Gate's, on the same input


class _FailsOnNegative(nn.Module):
    """Untraceable, and raises for some inputs whether run eagerly or under dynamo."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.min() < -100:
            raise ValueError("out of range")
        return self.lin(x)


def test_auto_keeps_dynamo_when_the_model_itself_raises() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(_FailsOnNegative())
    tapped = fxprobe.tap(model, ops=nn.Linear)
    with pytest.raises(ValueError, match="out of range"), torch.no_grad():
        tapped(torch.full((2, 4), -1000.0))
    x = torch.randn(2, 4)
    with torch.no_grad():
        out = tapped(x)
    assert torch.equal(out, model(x)) and torch.equal(tapped.taps["0.lin"], model[0].lin(x))
    assert tapped.fallbacks == () and [s.how for s in tapped.sites] == ["dynamo"]


class _Untraceable(nn.Module):
    """Data-dependent control flow (fx cannot trace it); calls its layer twice."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > -1e9:  # taken for every input here: each call runs the same code
            x = self.fc(x).relu()
        return self.fc(x)


class _CallsTwice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = _Untraceable()
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.inner(self.inner(x) + 1))


@pytest.mark.parametrize("tracer", ["auto", "fx+dynamo", "dynamo"])
def test_a_module_dynamo_runs_called_twice_keeps_both_calls(tracer: str) -> None:
    torch.manual_seed(0)
    model = _CallsTwice().eval()
    x = torch.randn(3, 4)
    torch._dynamo.reset()
    tapped = fxprobe.tap(model, ops=nn.Linear, tracer=tracer)
    with torch.no_grad():
        out = tapped(x)
        expected, ref = hook_values(model, ["inner.fc", "head"], x)
    assert torch.equal(out, expected)
    # As hooks count calls: inner.fc and inner.fc_1 in the first call of inner, then _2, _3.
    assert sorted(tapped.taps) == sorted(ref) == [
        "head", "inner.fc", "inner.fc_1", "inner.fc_2", "inner.fc_3"]
    for name, value in ref.items():
        assert torch.equal(tapped.taps[name], value), name
    with torch.no_grad():  # the next forward: the same names, its own values
        tapped(2 * x)
        _, ref = hook_values(model, ["inner.fc", "head"], 2 * x)
    assert sorted(tapped.taps) == sorted(ref)
    for name, value in ref.items():
        assert torch.equal(tapped.taps[name], value), name
    assert {s.name for s in tapped.sites} >= set(ref)

    # fn= reaches the second call alone: zero its first layer's output.
    def fn(site: fxprobe.Site, value: torch.Tensor) -> torch.Tensor | None:
        return torch.zeros_like(value) if site.name == "inner.fc_2" else None

    patched = fxprobe.tap(model, ops=nn.Linear, tracer=tracer, fn=fn)
    calls: list[int] = []

    def zero_third(m: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor | None:
        calls.append(1)
        return torch.zeros_like(out) if len(calls) == 3 else None

    handle = model.inner.fc.register_forward_hook(zero_third)
    with torch.no_grad():
        try:
            reference = model(x)
        finally:
            handle.remove()
        got = patched(x)
    assert torch.equal(got, reference) and not torch.equal(got, expected)
    assert patched.taps.replaced == {"inner.fc_2"}


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
