"""Per-call interventions and caches over a tapped module's life: the tenth ``intervene``
block or ``run_with_cache`` sees the same sites, canonical names and values as the first.

References: forward hooks (and pre-hooks) that edit or clone a module's output (or input) on
the untapped model.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import fxprobe

tf = pytest.importorskip("transformers")

# canonical name -> (module path, "in": its first input / "out": its output)
Where = dict[str, tuple[str, str]]


def _gpt2() -> nn.Module:
    return tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100,
                                            bos_token_id=0, eos_token_id=0))


def _llama() -> nn.Module:
    return tf.LlamaForCausalLM(tf.LlamaConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=2, num_key_value_heads=1,
        intermediate_size=64, vocab_size=100, bos_token_id=0, eos_token_id=0))


def _gptj() -> nn.Module:  # a parallel block: x + attn(ln(x)) + mlp(ln(x))
    return tf.GPTJForCausalLM(tf.GPTJConfig(n_layer=2, n_embd=32, n_head=2, rotary_dim=8,
                                            vocab_size=100, bos_token_id=0, eos_token_id=0))


def _where(block: str, attn: str, out_proj: str, act: str, mlp_proj: str) -> Where:
    return {
        "blocks.1.attn.z": (f"{block}.{attn}.{out_proj}", "in"),
        "blocks.1.attn_out": (f"{block}.{attn}", "out"),
        "blocks.1.mlp.pre": (f"{block}.mlp.{act}", "in"),
        "blocks.1.mlp.post": (f"{block}.mlp.{mlp_proj}", "in"),
        "blocks.1.mlp_out": (f"{block}.mlp", "out"),
        "blocks.1.resid_post": (block, "out"),
        "logits": ("lm_head", "out"),
    }


FAMILIES: dict[str, tuple[Callable[[], nn.Module], Where]] = {
    "gpt2": (_gpt2, _where("transformer.h.1", "attn", "c_proj", "act", "c_proj")),
    "llama": (_llama, _where("model.layers.1", "self_attn", "o_proj", "act_fn", "down_proj")),
    "gptj": (_gptj, _where("transformer.h.1", "attn", "out_proj", "act", "fc_out")),
}


def _flip(site: Any, value: torch.Tensor) -> torch.Tensor:
    """Negate position 1: an edit that tells positions (and so sites) apart."""
    value = value.clone()
    value[:, 1] = -value[:, 1]
    return value


def _double(site: Any, value: torch.Tensor) -> torch.Tensor:
    return value * 2


def _first(x: Any) -> torch.Tensor:
    return x[0] if isinstance(x, tuple) else x


def _hooks(model: nn.Module, where: tuple[str, str], fn: Callable[[torch.Tensor], Any]
           ) -> Any:
    """A hook on the module at ``where`` calling ``fn`` on its first input or output; a
    tensor ``fn`` returns replaces it."""
    path, side = where
    module = model.get_submodule(path)
    if side == "in":
        def pre(m: nn.Module, args: tuple[Any, ...]) -> Any:
            new = fn(args[0])
            return None if new is None else (new, *args[1:])
        return module.register_forward_pre_hook(pre)

    def post(m: nn.Module, args: Any, out: Any) -> Any:
        new = fn(_first(out))
        if new is None:
            return None
        return (new, *out[1:]) if isinstance(out, tuple) else new
    return module.register_forward_hook(post)


def _edited(model: nn.Module, where: tuple[str, str], ids: torch.Tensor) -> torch.Tensor:
    handle = _hooks(model, where, lambda v: _flip(None, v))
    try:
        return model(input_ids=ids).logits
    finally:
        handle.remove()


def _cloned(model: nn.Module, wheres: Where, *args: Any, **kwargs: Any
            ) -> dict[str, torch.Tensor]:
    kept: dict[str, torch.Tensor] = {}
    handles = [_hooks(model, w, lambda v, n=n: kept.__setitem__(n, v.detach().clone()))
               for n, w in wheres.items()]
    try:
        model(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    return kept


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, whatever the per-head split (``attn.z`` is ``(batch, pos, heads,
    head_dim)``; what the output projection reads, ``(batch, pos, heads * head_dim)``)."""
    return a.numel() == b.numel() and torch.allclose(a.reshape(b.shape), b, atol=1e-6)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request: Any) -> tuple[nn.Module, Any, torch.Tensor, Where]:
    build, where = FAMILIES[request.param]
    torch.manual_seed(0)
    model = build().eval()
    model.config._attn_implementation = "eager"
    ids = torch.randint(2, 100, (2, 7), generator=torch.Generator().manual_seed(1))
    tapped = fxprobe.tap(model, ops="blocks.0.resid_post", tracer="dynamo")
    with torch.no_grad():
        tapped(input_ids=ids)
    return model, tapped, ids, where


@torch.no_grad()
def test_every_intervene_block_edits_the_same_sites(family: Any) -> None:
    """The first block built the graph with intervention points, whose canonical names came
    out short (dynamo drops where each graph input came from once the backend returns: the
    weights read by ``attn.z``, ``mlp.pre/post`` and ``logits`` were found no more)."""
    model, tapped, ids, where = family
    plain = model(input_ids=ids).logits
    canonical = _canonical(tapped)
    assert set(where) <= {c for names in canonical.values() for c in names}
    glob = []
    for _ in range(3):
        with tapped.intervene({"blocks.1.attn.*": _double}):
            glob.append(tapped(input_ids=ids).logits)
    assert not torch.equal(glob[0], plain)
    assert torch.equal(glob[0], glob[1]) and torch.equal(glob[1], glob[2])
    for name, w in where.items():
        ref = _edited(model, w, ids)
        assert not torch.equal(ref, plain), name
        for _ in range(3):
            with tapped.intervene({name: _flip}):
                assert torch.allclose(tapped(input_ids=ids).logits, ref, atol=1e-5), name
    assert torch.equal(tapped(input_ids=ids).logits, plain)
    assert _canonical(tapped) == canonical  # what fxprobe lists too


def _canonical(tapped: Any) -> dict[str, tuple[str, ...]]:
    return {s.name: s.canonical for s in tapped.known_sites().records if s.canonical}


@torch.no_grad()
def test_every_cache_holds_the_same_sites_and_values(family: Any) -> None:
    model, tapped, ids, where = family
    ref = _cloned(model, where, input_ids=ids)
    first = None
    for _ in range(3):
        _, cache = tapped.run_with_cache(input_ids=ids, names=list(where))
        for name in where:
            assert _same(cache[name], ref[name]), name
        _, block = tapped.run_with_cache(input_ids=ids, names="blocks.0.*")
        keys = (list(cache), list(block))
        assert first is None or keys == first
        first = keys
        with tapped.intervene({"blocks.1.attn.*": _double}):
            tapped(input_ids=ids)
    assert len(first[0]) == len(where)  # one site per name (none of them shares a value)


@torch.no_grad()
def test_a_seeded_sequence_of_per_call_runs_agrees_with_hooks(family: Any) -> None:
    """Blocks, nested blocks, a block whose function raises, caches inside blocks, on two
    input shapes in a seeded order: each step against hooks on the untapped model."""
    model, tapped, ids, where = family
    rng = random.Random(7)
    inputs = [ids, ids[:1, :5]]
    names = sorted(where)

    def boom(site: Any, value: torch.Tensor) -> torch.Tensor:
        raise KeyError("boom")

    for step in range(10):
        x, a, b = rng.choice(inputs), rng.choice(names), rng.choice(names)
        op = ["nested", "raise", "cache"][step % 3]
        handle = _hooks(model, where[a], lambda v: _flip(None, v))
        try:
            one = model(input_ids=x).logits
            kept = _cloned(model, {b: where[b]}, input_ids=x)
            second = _hooks(model, where[b], lambda v: _flip(None, v))
            two = model(input_ids=x).logits
            second.remove()
        finally:
            handle.remove()
        with tapped.intervene({a: _flip}):
            if op == "nested":
                with tapped.intervene({b: _flip}):
                    assert torch.allclose(tapped(input_ids=x).logits, two, atol=1e-5), step
            elif op == "raise":
                with pytest.raises(KeyError, match="boom"), tapped.intervene({b: boom}):
                    tapped(input_ids=x)
            else:
                _, cache = tapped.run_with_cache(input_ids=x, names=b)
                assert _same(cache[b], kept[b]) and len(cache) == 1, step
            assert torch.allclose(tapped(input_ids=x).logits, one, atol=1e-5), step
        assert torch.equal(tapped(input_ids=x).logits, model(input_ids=x).logits), step


class _Inner(nn.Module):
    """A module dynamo runs as frames of its own (a graph break inside)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.fc2 = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x).relu()
        torch._dynamo.graph_break()
        return self.fc2(y) * 2


class _Plain(nn.Module):
    """The same without parameters: which instance runs a frame is told by its code."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(x) + 1
        torch._dynamo.graph_break()
        return y * 3


class _Twice(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.head = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.inner(self.inner(x) + 1))


# the site names of both calls, in the order they run -> (module path, "out")
TWICE: dict[str, tuple[Callable[[], nn.Module], dict[str, tuple[str, str]]]] = {
    "params": (_Inner, {"inner.fc": ("inner.fc", "out"), "inner.fc2": ("inner.fc2", "out"),
                        "inner.fc_1": ("inner.fc", "out"),
                        "inner.fc2_1": ("inner.fc2", "out")}),
    "plain": (_Plain, {"inner.mul": ("inner", "out"), "inner.mul_1": ("inner", "out")}),
}


def _calls(model: nn.Module, x: torch.Tensor, sites: dict[str, tuple[str, str]],
           edit: str | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The output, and each site's value cloned by a hook (the n-th call of a module is its
    n-th site in ``sites``), the site ``edit`` negated."""
    kept: dict[str, torch.Tensor] = {}
    order: dict[str, list[str]] = {}
    for name, w in sites.items():
        order.setdefault(w[0], []).append(name)

    def hook(path: str) -> Callable[[torch.Tensor], Any]:
        def fn(v: torch.Tensor) -> Any:
            name = order[path][sum(n in kept for n in order[path])]
            kept[name] = v.detach().clone()
            return -v if name == edit else None
        return fn

    handles = [_hooks(model, (p, "out"), hook(p)) for p in order]
    try:
        return model(x), kept
    finally:
        for h in handles:
            h.remove()


@pytest.mark.parametrize("kind", sorted(TWICE))
@torch.no_grad()
def test_a_module_dynamo_runs_as_its_own_frame_called_twice(kind: str) -> None:
    """Each call's sites are sites of their own (``inner.fc``, then ``inner.fc_1``), in the
    graph with intervention points too: built for the wrong call, the cache held two values,
    not four, and an edit of the second call's site landed on the first."""
    build, sites = TWICE[kind]
    torch.manual_seed(0)
    model = _Twice(build()).eval()
    x = torch.randn(2, 4)
    plain, ref = _calls(model, x, sites)
    assert len(ref) == len(sites)
    tapped = fxprobe.tap(model, ops="head", tracer="dynamo")
    for _ in range(3):  # the first per-call run is the first forward: no site known before
        out, cache = tapped.run_with_cache(x, names="inner.*")
        assert torch.equal(out, plain)
        assert [n for n in cache if n in sites] == list(sites)
        for name in sites:
            assert torch.equal(cache[name], ref[name]), name
    for name in sites:
        edited, _ = _calls(model, x, sites, edit=name)
        assert not torch.equal(edited, plain)
        for _ in range(2):
            with tapped.intervene({name: lambda s, v: -v}):
                assert torch.equal(tapped(x), edited), name
    assert torch.equal(tapped(x), plain)
    fresh = fxprobe.tap(model, ops="head", tracer="dynamo")
    assert torch.equal(fresh(x), plain)  # the graphs of tap() first, then the per-call ones
    _, cache = fresh.run_with_cache(x, names=list(sites))
    assert list(cache) == list(sites)
    assert all(torch.equal(cache[n], ref[n]) for n in sites)


class _Contexts(nn.Module):
    """Calls whose values are no tensors (a context manager, None), and a split (a tuple)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", enabled=False):
            y = self.fc(x)
        with torch.set_grad_enabled(False):
            z = y * 2
        a, b = z.split(4, -1)
        return a + b


def test_a_cache_of_every_site_holds_tensors_only() -> None:
    torch.manual_seed(0)
    model = _Contexts().eval()
    x = torch.randn(2, 4)
    tapped = fxprobe.tap(model, ops="fc", tracer="dynamo")
    tapped(x)
    y = model.fc(x).detach()
    for names in (None, "*"):
        _, cache = tapped.run_with_cache(x, names=names)
        assert torch.equal(cache["fc"], y)
        assert torch.equal(cache["mul"], y * 2)
        assert isinstance(cache["split"], tuple)  # a tuple of tensors is kept
        assert all(torch.equal(a, b) for a, b in zip(cache["split"], (y * 2).split(4, -1),
                                                     strict=True))
        assert all(isinstance(v, (torch.Tensor, tuple)) for v in cache.values()), dict(cache)
        assert "set_grad_enabled" not in cache and "enter_autocast" not in cache
        with pytest.raises(fxprobe.UnknownSiteError, match="NoneType, not a tensor"):
            cache["set_grad_enabled"]
        with pytest.raises(fxprobe.UnknownSiteError, match="Autocast, not a tensor"):
            cache["enter_autocast"]


@torch.no_grad()
def test_a_transformer_cache_of_every_site_holds_tensors_only(family: Any) -> None:
    model, tapped, ids, where = family
    _, cache = tapped.run_with_cache(input_ids=ids)
    odd = {n: type(v).__name__ for n, v in cache.items() if not isinstance(v, torch.Tensor)
           and not (isinstance(v, (tuple, list)) and all(
               isinstance(t, torch.Tensor) for t in v))}
    assert not odd
    assert torch.equal(cache["logits"], model(input_ids=ids).logits)
    # the calls of modules dynamo traced through, by name too (each is another site's value);
    # a layer's call is a site of its own: the op that runs the layer's graph, captured once
    # for every layer (frontends/dynamo_blocks.py)
    calls = {n: where[n] for n in ("blocks.1.resid_post", "blocks.1.mlp_out")}
    ref = _cloned(model, calls, input_ids=ids)
    for name, (path, _) in calls.items():
        assert torch.equal(cache[path], ref[name]), path
        assert (path in list(cache)) == (name == "blocks.1.resid_post"), path


class _Attn(nn.Module):
    def __init__(self, d: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.o = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (y.view(b, t, self.heads, -1).transpose(1, 2)
                   for y in self.qkv(x).split(d, -1))
        p = torch.softmax(q @ k.transpose(-1, -2) / 8 ** 0.5, -1)
        return self.o((p @ v).transpose(1, 2).reshape(b, t, d))


class _Block(nn.Module):
    """A block dynamo runs as a frame of its own (a graph break after its work): the graph
    captured for ``blocks.0`` runs ``blocks.1`` and ``blocks.2`` too, named for each later."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = _Attn(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        x = x + self.mlp(self.ln2(x))
        torch._dynamo.graph_break()
        return x


class _Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Block() for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


@torch.no_grad()
def test_a_graph_reused_for_another_block_has_its_canonical_names() -> None:
    """Named for ``blocks.1`` after dynamo's backend returned, the graph knew its weights no
    more: ``blocks.*.attn.z`` (and ``mlp.pre/post``) selected block 0's alone, silently."""
    torch.manual_seed(0)
    model = _Stack().eval()
    x = torch.randn(2, 5, 16)
    wheres = {f"blocks.{i}.{name}": (f"blocks.{i}.{path}", "in")
              for i in range(3) for name, path in [("attn.z", "attn.o"), ("mlp.pre", "mlp.1"),
                                                   ("mlp.post", "mlp.2")]}
    ref = _cloned(model, wheres, x)
    tapped = fxprobe.tap(model, ops=["blocks.*.attn.z", "blocks.*.mlp.pre", "blocks.*.mlp.post"],
                         tracer="dynamo")
    assert torch.equal(tapped(x), model(x))
    assert len(tapped.taps) == len(wheres)
    _, cache = tapped.run_with_cache(x, names=list(wheres))
    for name in wheres:
        assert _same(tapped.taps[name], ref[name]), name
        assert _same(cache[name], ref[name]), name

