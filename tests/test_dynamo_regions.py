"""Repeated blocks traced once by dynamo (``frontends/dynamo_inline.py``): every site, name and
value as when each block is traced on its own (``FXPROBE_DYNAMO_REGIONS=0``), and as forward
hooks that clone on an untapped copy see them; per-call edits of one layer; sequences of calls;
the model untouched."""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from canonical_support import DECODER, TOKENS, _close, tf
from torch import nn

import fxprobe

LAYERS = 4


def build(family: str) -> nn.Module:
    torch.manual_seed(0)
    if family == "Llama":
        model: nn.Module = tf.LlamaForCausalLM(tf.LlamaConfig(
            **{**DECODER, "num_hidden_layers": LAYERS}, **TOKENS))
    elif family == "BERT":
        model = tf.BertModel(tf.BertConfig(num_hidden_layers=LAYERS, hidden_size=32,
                                           num_attention_heads=2, intermediate_size=64,
                                           vocab_size=100, max_position_embeddings=64))
    else:
        model = tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=LAYERS, n_embd=32, n_head=2,
                                                 n_positions=64, **TOKENS))
    return model.eval()


BLOCKS = {"Llama": "model.layers.{L}", "BERT": "encoder.layer.{L}", "GPT-2": "transformer.h.{L}"}
HOOKS = {  # canonical role: (module, "in" | "out")
    "Llama": {"mlp.post": ("model.layers.{L}.mlp.down_proj", "in"),
              "mlp_out": ("model.layers.{L}.mlp", "out"),
              "attn.z": ("model.layers.{L}.self_attn.o_proj", "in")},
    "BERT": {"mlp.post": ("encoder.layer.{L}.output.dense", "in"),
             "attn.z": ("encoder.layer.{L}.attention.output.dense", "in")},
    "GPT-2": {"mlp.post": ("transformer.h.{L}.mlp.c_proj", "in"),
              "mlp_out": ("transformer.h.{L}.mlp", "out"),
              "attn.z": ("transformer.h.{L}.attn.c_proj", "in")},
}


def kwargs(family: str, batch: int = 2, length: int = 7, **extra: Any) -> dict[str, Any]:
    ids = torch.randint(2, 100, (batch, length), generator=torch.Generator().manual_seed(length))
    kw: dict[str, Any] = {"input_ids": ids}
    if family != "BERT":
        kw["use_cache"] = False
    return {**kw, **extra}


def _first(x: Any) -> torch.Tensor:
    return x[0] if isinstance(x, (tuple, list)) else x


def references(family: str, kw: dict[str, Any], edit: Any = None) -> dict[str, torch.Tensor]:
    """Canonical values of an untapped copy, by forward hooks that clone (q, k, v: what the
    attention kernel reads); ``edit(L, value)`` applied to each block's output by a hook."""
    model = build(family)
    ref: dict[str, torch.Tensor] = {}
    handles = []
    for L in range(LAYERS):
        block = model.get_submodule(BLOCKS[family].format(L=L))

        def post(m: nn.Module, args: Any, out: Any, *, L: int = L) -> Any:
            if edit is not None:
                value = edit(L, _first(out))
                out = (value, *out[1:]) if isinstance(out, tuple) else value
            ref[f"blocks.{L}.resid_post"] = _first(out).detach().clone()
            return out

        handles.append(block.register_forward_hook(post))
        for role, (template, io) in HOOKS[family].items():
            module = model.get_submodule(template.format(L=L))

            def keep(m: nn.Module, args: Any, out: Any = None, *, name: str = f"blocks.{L}.{role}",
                     io: str = io) -> None:
                ref[name] = (_first(args) if io == "in" else _first(out)).detach().clone()

            handles.append(module.register_forward_pre_hook(keep) if io == "in"
                           else module.register_forward_hook(keep))
    kernels: list[tuple[torch.Tensor, ...]] = []
    real = F.scaled_dot_product_attention

    def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *a: Any, **k2: Any) -> Any:
        kernels.append((q.detach().clone(), k.detach().clone(), v.detach().clone()))
        return real(q, k, v, *a, **k2)

    mp = pytest.MonkeyPatch()
    try:
        mp.setattr(F, "scaled_dot_product_attention", sdpa)
        mp.setattr(torch.nn.functional, "scaled_dot_product_attention", sdpa)
        with torch.no_grad():
            out = model(**kw)
    finally:
        mp.undo()
        for h in handles:
            h.remove()
    assert len(kernels) == LAYERS
    for L, qkv in enumerate(kernels):
        ref.update({f"blocks.{L}.attn.{x}": t for x, t in zip("qkv", qkv, strict=True)})
    ref["out"] = out.logits if hasattr(out, "logits") else out.last_hidden_state
    return ref


def tap(family: str, monkeypatch: pytest.MonkeyPatch, on: bool, ops: Any = None) -> Any:
    monkeypatch.setenv("FXPROBE_DYNAMO_REGIONS", "1" if on else "0")
    model = build(family)
    if family != "Llama":
        model.config._attn_implementation = "sdpa"
    return model, fxprobe.tap(model, ops=ops or fxprobe.where(lambda s: True), tracer="dynamo")


def region(tapped: Any) -> Any:
    return tapped._lifecycle().program.dynamo[""]


def roles(family: str) -> list[str]:
    return ["resid_post", "attn.q", "attn.k", "attn.v", *HOOKS[family]]


@pytest.mark.parametrize("family", ["Llama", "BERT", "GPT-2"])
def test_every_site_name_and_value_as_without_regions_and_as_hooks(
        family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    kw = kwargs(family)
    runs = {}
    for on in (False, True):
        model, tapped = tap(family, monkeypatch, on)
        with torch.no_grad():
            out = tapped(**kw)
        calls, bodies = region(tapped).inlined  # traced once, stamped for the others
        assert (calls >= LAYERS - 1, bodies) == ((True, 1) if on else (False, 0))
        sites = [(s.name, s.canonical, s.module_path, s.kind) for s in tapped.known_sites()]
        runs[on] = sites, dict(tapped.taps), out
        assert not any("forward" in b.__dict__ for b in model.modules())  # model untouched
    assert runs[True][0] == runs[False][0]
    assert runs[True][1].keys() == runs[False][1].keys()
    for name, value in runs[False][1].items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(runs[True][1][name], value), name
    ref = references(family, kw)
    by_canonical = {c: name for name, canonical, *_ in runs[True][0] for c in canonical}
    for L in range(LAYERS):
        for role in roles(family):
            name = f"blocks.{L}.{role}"
            _close(name, runs[True][1][by_canonical[name]], ref[name])
    result = runs[True][2]
    torch.testing.assert_close(result.logits if hasattr(result, "logits")
                               else result.last_hidden_state, ref["out"])


def test_op_level_site_inside_a_layer_by_its_dynamo_name(monkeypatch: pytest.MonkeyPatch) -> None:
    """A functional ``add`` inside each layer (the residual), by its dynamo name, equals the
    block's output as a hook sees it: the add is the stream the block returns."""
    kw = kwargs("Llama")
    names = [f"model.layers.{L}.add_1" for L in range(LAYERS)]
    _, tapped = tap("Llama", monkeypatch, True, ops=names)
    with torch.no_grad():
        tapped(**kw)
    assert region(tapped).inlined[1] == 1
    ref = references("Llama", kw)
    assert sorted(tapped.taps) == names
    for L in range(LAYERS):
        torch.testing.assert_close(tapped.taps[f"model.layers.{L}.add_1"],
                                   ref[f"blocks.{L}.resid_post"])


def test_a_per_call_edit_of_layer_2_changes_layer_2_only(monkeypatch: pytest.MonkeyPatch) -> None:
    kw = kwargs("Llama")
    _, tapped = tap("Llama", monkeypatch, True, ops="blocks.*.resid_post")
    with torch.no_grad():
        tapped(**kw)
        plain = dict(tapped.taps)
        with tapped.intervene({"blocks.2.resid_post": lambda s, v: v * 3 + 1}):
            out = tapped(**kw)
        edited = dict(tapped.taps)
    ref = references("Llama", kw, edit=lambda L, v: v * 3 + 1 if L == 2 else v)
    names = {s.canonical[0]: s.name for s in tapped.known_sites() if s.canonical}
    for L in range(LAYERS):
        name = names[f"blocks.{L}.resid_post"]
        torch.testing.assert_close(edited[name], ref[f"blocks.{L}.resid_post"])
        assert torch.equal(edited[name], plain[name]) == (L < 2)
    torch.testing.assert_close(out.logits, ref["out"])


def sequence_check(tapped: Any, name_of: Callable[[str], str]) -> Callable[..., None]:
    """``check(kw, edit, fn)``: a forward of ``tapped`` on ``kw`` (inside ``intervene(fn)``
    when ``fn`` is given), each block's output read as ``tapped.taps[name_of(canonical)]`` and
    the logits compared with what an untapped copy's hooks see making ``edit``
    (``references``). ``name_of`` runs after the forward, so it may read this call's sites."""

    def check(kw: dict[str, Any], edit: Any = None, fn: Any = None) -> None:
        with torch.no_grad():
            if fn is None:
                out = tapped(**kw)
            else:
                with tapped.intervene(fn):
                    out = tapped(**kw)
        ref = references("Llama", kw, edit)
        for L in range(LAYERS):
            torch.testing.assert_close(tapped.taps[name_of(f"blocks.{L}.resid_post")],
                                       ref[f"blocks.{L}.resid_post"])
        torch.testing.assert_close(out.logits, ref["out"])

    return check


def test_a_sequence_of_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    """Forward, a new length, a new batch, an edit block, a second one, a forward with the
    cache and one without: every value as an untapped copy's hooks see it."""
    _, tapped = tap("Llama", monkeypatch, True, ops="blocks.*.resid_post")
    names: dict[str, str] = {}

    def name_of(canonical: str) -> str:  # the names every forward so far gave the sites
        names.update({s.canonical[0]: s.name for s in tapped.known_sites() if s.canonical})
        return names[canonical]

    check = sequence_check(tapped, name_of)
    check(kwargs("Llama"))
    check(kwargs("Llama", length=11))
    check(kwargs("Llama", batch=3))
    check(kwargs("Llama"), lambda L, v: v * 0 if L == 1 else v,
          {"blocks.1.resid_post": lambda s, v: v * 0})
    check(kwargs("Llama", length=5), lambda L, v: v + 2 if L == 3 else v,
          {"blocks.3.resid_post": lambda s, v: v + 2})
    check(kwargs("Llama", use_cache=True))  # a cache: not marked, each layer traced
    check(kwargs("Llama"))
    assert region(tapped).inlined[0] >= LAYERS


class _Twice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(torch.relu(self.lin(x))) + x


class _Stack(nn.Module):
    config = types.SimpleNamespace(use_cache=False)  # says it keeps no cache: marked

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Twice() for _ in range(LAYERS))
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def test_a_module_called_twice_inside_each_block(monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.randn(2, 8)
    seen = {}
    for on in (False, True):
        monkeypatch.setenv("FXPROBE_DYNAMO_REGIONS", "1" if on else "0")
        torch.manual_seed(0)
        model = _Stack()
        tapped = fxprobe.tap(model, ops=fxprobe.where(lambda s: True), tracer="dynamo")
        out = tapped(x)
        calls, bodies = region(tapped).inlined
        assert (calls >= LAYERS - 1, bodies) == ((True, 1) if on else (False, 0))
        seen[on] = [s.name for s in tapped.known_sites()], dict(tapped.taps), out
    assert seen[True][0] == seen[False][0]
    assert "blocks.3.lin_1" in seen[True][0]
    torch.manual_seed(0)
    ref_model = _Stack()
    ref: dict[str, list[torch.Tensor]] = {}
    for L, b in enumerate(ref_model.blocks):
        b.lin.register_forward_hook(
            lambda m, a, o, L=L: ref.setdefault(f"blocks.{L}.lin", []).append(o.detach().clone()))
    expect = ref_model(x)
    for L in range(LAYERS):
        taps = seen[True][1]
        assert torch.equal(taps[f"blocks.{L}.lin"], ref[f"blocks.{L}.lin"][0])
        assert torch.equal(taps[f"blocks.{L}.lin_1"], ref[f"blocks.{L}.lin"][1])
    for name, value in seen[False][1].items():
        assert torch.equal(seen[True][1][name], value), name
    torch.testing.assert_close(seen[True][2], expect)


def test_sites_listed_without_a_forward_are_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    kw = kwargs("GPT-2")
    listed = {}
    for on in (False, True):
        monkeypatch.setenv("FXPROBE_DYNAMO_REGIONS", "1" if on else "0")
        listed[on] = [s.name for s in fxprobe.sites(build("GPT-2"), example_kwargs=kw)]
    assert listed[True] == listed[False] and len(listed[True]) > 50


class _Breaks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.a(x).relu()
        torch._dynamo.graph_break()  # a nested compile region cannot hold it
        return self.b(y) + x


def test_blocks_with_a_graph_break_are_traced_each_on_its_own(
        monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.randn(3, 8)
    seen = {}
    for on in (False, True):
        monkeypatch.setenv("FXPROBE_DYNAMO_REGIONS", "1" if on else "0")
        torch.manual_seed(0)
        model = _Stack()
        model.blocks = nn.ModuleList(_Breaks() for _ in range(LAYERS))
        tapped = fxprobe.tap(model, ops=fxprobe.where(lambda s: True), tracer="dynamo")
        out = tapped(x)
        seen[on] = [s.name for s in tapped.known_sites()], dict(tapped.taps), out
        assert region(tapped).inlined == (0, 0) and not region(tapped).blocks
        torch.testing.assert_close(seen[on][2], model(x))
    assert seen[True][0] == seen[False][0]
    assert "blocks.3.add" in seen[True][0]
    for name, value in seen[False][1].items():
        assert torch.equal(seen[True][1][name], value), name


def test_a_call_stamped_with_another_instances_weights_is_refused(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """torch 2.13 stamps the first instance's weights into every later call of a marked
    forward bound as a method (``types.MethodType``): the inlining checks each call's
    parameters, refuses, and the blocks are traced each on its own, with the right values."""
    from fxprobe.frontends import dynamo_inline

    monkeypatch.setenv("FXPROBE_DYNAMO_REGIONS", "marked")

    monkeypatch.setattr(dynamo_inline, "marks", lambda blocks: [
        (b, types.MethodType(dynamo_inline._marked(type(b).forward), b)) for b in blocks])
    x = torch.randn(2, 8)
    torch.manual_seed(0)
    model = _Stack()
    tapped = fxprobe.tap(model, ops=fxprobe.where(lambda s: True), tracer="dynamo")
    torch.testing.assert_close(tapped(x), model(x))
    assert not region(tapped).blocks and region(tapped).inlined == (0, 0)
    for L, b in enumerate(model.blocks):
        torch.testing.assert_close(tapped.taps[f"blocks.{L}.lin"], b.lin(x if L == 0 else
                                   tapped.taps[f"blocks.{L - 1}.add"]))


def test_marked_blocks_with_a_cache_give_the_right_values(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Marked though the call carries a KV cache (``carries_cache`` guessed wrong; dynamo
    traces the first layer in place): every site, name and value, the output and the cache
    as without the marking."""
    from fxprobe.frontends import dynamo_inline

    monkeypatch.setattr(dynamo_inline, "carries_cache", lambda module, kwargs: False)
    kw = kwargs("Llama", use_cache=True)
    runs = {}
    for on in (False, True):
        _, tapped = tap("Llama", monkeypatch, on)
        with torch.no_grad():
            out = tapped(**kw)
        runs[on] = ([s.name for s in tapped.known_sites()], dict(tapped.taps), out.logits,
                    out.past_key_values)
    assert region(tapped).inlined[0] >= LAYERS - 1
    assert runs[True][0] == runs[False][0]
    assert runs[True][1].keys() == runs[False][1].keys()
    for name, value in runs[False][1].items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(runs[True][1][name], value), name
    torch.testing.assert_close(runs[True][2], references("Llama", kw)["out"])
    assert torch.equal(runs[True][3].layers[3].keys, runs[False][3].layers[3].keys)


def test_dropout_in_training_draws_as_without_regions(monkeypatch: pytest.MonkeyPatch) -> None:
    kw = kwargs("GPT-2")
    runs = {}
    for on in (False, True):
        _, tapped = tap("GPT-2", monkeypatch, on, ops="blocks.*.resid_post")
        tapped.train()
        torch.manual_seed(5)
        out = tapped(**kw)
        runs[on] = dict(tapped.taps), out.logits
    assert runs[True][0].keys() == runs[False][0].keys() and len(runs[True][0]) == LAYERS
    for name, value in runs[False][0].items():
        assert torch.equal(runs[True][0][name], value), name
    assert torch.equal(runs[True][1], runs[False][1])


def test_a_per_call_edit_of_a_site_not_selected(monkeypatch: pytest.MonkeyPatch) -> None:
    """An edit of ``blocks.1.mlp_out`` while only the streams are selected runs the version
    with a point at every site (``dynamo_versions``): the streams after it change as a hook
    making the same edit on an untapped copy changes them."""
    kw = kwargs("Llama")
    _, tapped = tap("Llama", monkeypatch, True, ops="blocks.*.resid_post")
    with torch.no_grad():
        tapped(**kw)
        with tapped.intervene({"blocks.1.mlp_out": lambda s, v: v * -2}):
            out = tapped(**kw)
    model = build("Llama")
    model.model.layers[1].mlp.register_forward_hook(lambda m, a, o: o * -2)
    ref: dict[int, torch.Tensor] = {}
    for L, layer in enumerate(model.model.layers):
        layer.register_forward_hook(lambda m, a, o, L=L: ref.setdefault(L, _first(o).clone()))
    with torch.no_grad():
        expect = model(**kw)
    names = {s.canonical[0]: s.name for s in tapped.known_sites() if s.canonical}
    for L in range(LAYERS):
        torch.testing.assert_close(tapped.taps[names[f"blocks.{L}.resid_post"]], ref[L])
    torch.testing.assert_close(out.logits, expect.logits)


def test_an_edit_that_raises_runs_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """An error raised while a marked graph runs (the model's, an edit's) is not taken for
    dynamo's failure on the marking: the call is not run again unmarked."""
    _, tapped = tap("Llama", monkeypatch, True, ops="blocks.*.resid_post")
    calls = []

    def fails(site: object, value: torch.Tensor) -> torch.Tensor:
        calls.append(site)
        raise ValueError("the edit failed")

    with torch.no_grad(), tapped.intervene({"blocks.2.resid_post": fails}):
        with pytest.raises(ValueError, match="the edit failed"):
            tapped(**kwargs("Llama"))
    assert len(calls) == 1 and region(tapped).blocks


class _Permutes(nn.Module):
    """A write that returns nothing (``inv[perm] = ...``), as a mixture of experts' routing."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        perm = torch.argsort(x[:, 0])
        inv = torch.empty_like(perm)
        inv[perm] = torch.arange(perm.shape[0])
        return self.lin(x[perm])[inv] + x


def test_a_write_that_returns_nothing_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.randn(5, 8)
    seen = {}
    for on in (False, True):
        monkeypatch.setenv("FXPROBE_DYNAMO_REGIONS", "1" if on else "0")
        torch.manual_seed(0)
        model = _Stack()
        model.blocks = nn.ModuleList(_Permutes() for _ in range(LAYERS))
        tapped = fxprobe.tap(model, ops=fxprobe.where(lambda s: True), tracer="dynamo")
        out = tapped(x)
        assert region(tapped).inlined[1] == (1 if on else 0)
        torch.testing.assert_close(out, model(x))
        seen[on] = [s.name for s in tapped.known_sites()], dict(tapped.taps)
    assert seen[True][0] == seen[False][0]
    for name, value in seen[False][1].items():
        if "empty_like" not in name:  # memory never written: no value to compare
            assert torch.equal(seen[True][1][name], value), name


def test_an_unknown_regions_mode_is_refused_naming_the_modes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FXPROBE_DYNAMO_REGIONS", "on")
    with pytest.raises(fxprobe.ConfigError, match="'shared'.*'marked'.*'0'"):
        tapped = fxprobe.tap(_Stack(), ops="blocks.*.lin", tracer="dynamo")
        tapped(torch.randn(2, 8))
