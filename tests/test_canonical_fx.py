"""Canonical transformer names on a model torch.fx traces whole (a GPT written by hand): the
value read by a canonical name is the value of the site it stands for, and what forward hooks
that clone see on an untapped copy; across calls, a new batch size and length, the extractor
and the tap of one model."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxprobe


class Block(nn.Module):
    def __init__(self, d: int = 32, heads: int = 2) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.o = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.proj = nn.Linear(d, 64), nn.Linear(64, d)
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.size(0), x.size(1), x.size(2)
        qkv = self.qkv(self.ln_1(x))
        q, k, v = (qkv[..., i * D:(i + 1) * D].view(B, T, self.heads, D // self.heads)
                   .transpose(1, 2) for i in range(3))
        z = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(z.transpose(1, 2).reshape(B, T, D))
        return x + self.proj(F.gelu(self.fc(self.ln_2(x))))


class GPT(nn.Module):
    def __init__(self, shared: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.wte, self.wpe = nn.Embedding(100, 32), nn.Embedding(16, 32)
        b = Block()
        self.blocks = nn.ModuleList([b, b, b] if shared else [Block() for _ in range(3)])
        self.ln_f, self.head = nn.LayerNorm(32), nn.Linear(32, 100, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.wte(input_ids) + self.wpe(torch.arange(input_ids.size(1)))
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln_f(x))


def _hooked(model: nn.Module, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """The canonical values as forward hooks that clone see them on ``model`` (untapped)."""
    ref: dict[str, Any] = {}
    handles = []

    def keep(name: str, value: torch.Tensor) -> None:
        ref[name] = value.detach().clone()

    for i, b in enumerate(model.blocks):
        handles += [
            b.register_forward_pre_hook(lambda m, a, i=i: keep(f"blocks.{i}.resid_pre", a[0])),
            b.register_forward_hook(lambda m, a, o, i=i: keep(f"blocks.{i}.resid_post", o)),
            b.o.register_forward_hook(lambda m, a, o, i=i: keep(f"blocks.{i}.attn_out", o)),
            b.fc.register_forward_hook(lambda m, a, o, i=i: keep(f"blocks.{i}.mlp.pre", o)),
            b.proj.register_forward_pre_hook(
                lambda m, a, i=i: keep(f"blocks.{i}.mlp.post", a[0])),
            b.proj.register_forward_hook(lambda m, a, o, i=i: keep(f"blocks.{i}.mlp_out", o)),
            b.ln_2.register_forward_pre_hook(
                lambda m, a, i=i: keep(f"blocks.{i}.resid_mid", a[0])),
            b.qkv.register_forward_hook(lambda m, a, o, i=i: keep(f"blocks.{i}.qkv", o)),
        ]
    handles += [model.wte.register_forward_hook(lambda m, a, o: keep("embed", o)),
                model.wpe.register_forward_hook(lambda m, a, o: keep("pos_embed", o)),
                model.ln_f.register_forward_hook(lambda m, a, o: keep("ln_final", o))]
    with torch.no_grad():
        ref["logits"] = model(ids)
    for h in handles:
        h.remove()
    B, T = ids.shape
    for i in range(3):  # q, k, v: the qkv projection's thirds, per head
        qkv = ref.pop(f"blocks.{i}.qkv")
        for j, part in enumerate("qkv"):
            ref[f"blocks.{i}.attn.{part}"] = qkv[..., j * 32:(j + 1) * 32].view(
                B, T, 2, 16).transpose(1, 2)
    return ref


CANONICAL = ["embed", "pos_embed", "ln_final", "logits"] + [
    f"blocks.{i}.{r}" for i in range(3) for r in (
        "resid_pre", "attn.q", "attn.k", "attn.v", "attn_out", "resid_mid", "mlp.pre",
        "mlp.post", "mlp_out", "resid_post")]


@pytest.mark.parametrize("tracer", ["fx", "auto"])
def test_tap_reads_by_canonical_name_what_hooks_see_across_calls(tracer: str) -> None:
    model = GPT().eval()
    reference = copy.deepcopy(model)
    calls = []
    model.wte.register_forward_hook(lambda m, a, o: calls.append(1))  # the user's own hook
    tapped = fxprobe.tap(model, ops=CANONICAL, tracer=tracer)
    assert not calls  # finding the names ran none of the model's hooks
    for ids in (torch.randint(0, 100, (2, 5)), torch.randint(0, 100, (3, 9)),
                torch.randint(0, 100, (1, 5))):
        with torch.no_grad():
            out = tapped(ids)
        ref = _hooked(reference, ids)
        assert torch.equal(out, ref["logits"])
        for name in CANONICAL:
            torch.testing.assert_close(tapped.taps[name], ref[name], msg=name)
        site = {c: s.name for s in tapped.sites for c in s.canonical}
        for name in CANONICAL:  # the same value as the site's own name reads
            assert torch.equal(tapped.taps[name], tapped.taps[site[name]]), name
    assert site["blocks.1.resid_post"] == "blocks.1.add_1"
    assert site["blocks.2.resid_pre"] == "blocks.1.add_1"
    assert len(calls) == 3  # one per forward


def test_sites_lists_the_canonical_names_and_the_model_is_untouched() -> None:
    model = GPT().eval()
    before = copy.deepcopy(model.state_dict())
    listed = {c: s.name for s in fxprobe.sites(model, tracer="fx") for c in s.canonical}
    assert set(CANONICAL) <= set(listed)
    assert listed["blocks.0.attn_out"] == "blocks.0.o"
    assert listed["ln_final"] == "ln_f" and listed["logits"] == "head"
    assert listed == {c: s.name for s in fxprobe.sites(model) for c in s.canonical}  # auto
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_extractor_takes_canonical_names_as_ops_and_return_nodes_beside_a_tap() -> None:
    model = GPT().eval()
    reference = copy.deepcopy(model)
    tapped = fxprobe.tap(model, ops="blocks.*.resid_post", tracer="fx")
    ex = fxprobe.extractor(model, ops=["blocks.*.resid_post", "logits"])
    body = fxprobe.extractor(model, return_nodes={"blocks.1.resid_post": "mid",
                                                  "blocks.2.resid_pre": "again",
                                                  "blocks.0.attn.q": "q0"})
    listed = fxprobe.extractor(model, return_nodes=["blocks.0.resid_mid", "blocks.0.add"])
    for ids in (torch.randint(0, 100, (2, 5)), torch.randint(0, 100, (4, 11))):
        ref = _hooked(reference, ids)
        with torch.no_grad():
            out, values = ex(ids)
            feats = body(ids)
            both = listed(ids)
            tapped(ids)
        assert torch.equal(out, ref["logits"])
        assert sorted(values) == ["blocks.0.add_1", "blocks.1.add_1", "blocks.2.add_1", "head"]
        for i in range(3):
            torch.testing.assert_close(values[f"blocks.{i}.add_1"], ref[f"blocks.{i}.resid_post"])
            assert torch.equal(tapped.taps[f"blocks.{i}.resid_post"], values[f"blocks.{i}.add_1"])
        assert list(feats) == ["mid", "again", "q0"]
        torch.testing.assert_close(feats["mid"], ref["blocks.1.resid_post"])
        assert torch.equal(feats["again"], feats["mid"])
        torch.testing.assert_close(feats["q0"], ref["blocks.0.attn.q"])
        assert list(both) == ["blocks.0.resid_mid", "blocks.0.add"]
        assert torch.equal(both["blocks.0.resid_mid"], both["blocks.0.add"])
        torch.testing.assert_close(both["blocks.0.add"], ref["blocks.0.resid_mid"])


@pytest.mark.parametrize("name", ["blocks.0.attn.pattern", "blocks.*.attn.scores"])
def test_no_pattern_beside_sdpa_under_fx_rather_than_the_kernels_output(name: str) -> None:
    """fx computes no probabilities beside F.scaled_dot_product_attention: the pattern is
    absent (dynamo has it), never the attention's output under the pattern's name."""
    model = GPT().eval()
    with pytest.raises(fxprobe.SelectorError, match="matches no site"):
        fxprobe.tap(model, ops=name, tracer="fx")
    with pytest.raises(fxprobe.SelectorError, match="no site"):
        fxprobe.extractor(model, return_nodes=[name.replace("*", "0")])
    sdpa = [s for s in fxprobe.sites(model, tracer="fx")
            if s.op_key == "scaled_dot_product_attention"]
    assert sdpa and not any(s.canonical for s in sdpa)


def test_a_block_listed_several_times_has_no_canonical_names_under_fx() -> None:
    model = GPT(shared=True).eval()
    assert not any(s.canonical for s in fxprobe.sites(model, tracer="fx"))
    with pytest.raises(fxprobe.SelectorError, match="Canonical transformer names exist") as e:
        fxprobe.extractor(model, return_nodes=["blocks.0.resid_post"])
    assert "torch.fx traced whole" in str(e.value)


def test_no_family_recognised_says_what_fx_needs() -> None:
    model = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 8))  # no attention: no family
    with pytest.raises(fxprobe.SelectorError, match="canonical transformer name") as e:
        fxprobe.tap(model, ops="blocks.0.resid_post", tracer="fx")
    assert "torch.fx traced whole" in str(e.value) and "nn.ModuleList" in str(e.value)
    out, values = fxprobe.extractor(model, ops="1")(torch.tensor([[1, 2]]))
    torch.testing.assert_close(values["1"], out)


class NormedGPT(GPT):
    """A train-mode BatchNorm over the embeddings: finding the names must not step it."""

    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(32)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.wte(input_ids) + self.wpe(torch.arange(input_ids.size(1)))
        x = self.bn(x.transpose(1, 2)).transpose(1, 2)
        for b in self.blocks:
            x = nn.functional.dropout(b(x), 0.1, self.training)
        return self.head(self.ln_f(x))


def test_finding_the_names_changes_no_state_of_the_model_nor_the_random_state() -> None:
    model = NormedGPT().train()
    state = copy.deepcopy(model.state_dict())
    rng = torch.random.get_rng_state()
    tapped = fxprobe.tap(model, ops="blocks.*.resid_post", tracer="fx")
    fxprobe.extractor(model, return_nodes=["blocks.2.resid_post"], train=True)
    assert any(s.canonical for s in fxprobe.sites(model, train=True))
    assert torch.equal(rng, torch.random.get_rng_state())
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k]), k
    ids = torch.randint(0, 100, (2, 5))
    torch.manual_seed(1)
    tapped(ids)
    torch.manual_seed(1)
    reference = copy.deepcopy(model)
    reference.load_state_dict(state)
    ref = _hooked(reference, ids)
    for i in range(3):
        assert torch.equal(tapped.taps[f"blocks.{i}.resid_post"], ref[f"blocks.{i}.resid_post"])


def test_intervene_and_run_with_cache_take_canonical_names_under_fx() -> None:
    model = GPT().eval()
    reference = copy.deepcopy(model)
    tapped = fxprobe.tap(model, ops="blocks.0.resid_post", tracer="fx")
    ids = torch.randint(0, 100, (2, 6))

    def halve(site: Any, value: torch.Tensor) -> torch.Tensor:
        return value * 0.5

    with torch.no_grad():
        with tapped.intervene({"blocks.1.resid_post": halve}):
            edited = tapped(ids)
        hook = reference.blocks[1].register_forward_hook(lambda m, a, out: out * 0.5)
        expected = reference(ids)
        hook.remove()
        plain = tapped(ids)  # outside the block: the model as it is
        out, cache = tapped.run_with_cache(ids, names="blocks.*.mlp_out")
        ref = _hooked(reference, ids)
    assert torch.equal(edited, expected) and not torch.equal(edited, plain)
    assert torch.equal(plain, ref["logits"]) and torch.equal(out, plain)
    for i in range(3):
        torch.testing.assert_close(cache[f"blocks.{i}.mlp_out"], ref[f"blocks.{i}.mlp_out"])
    assert torch.equal(tapped.taps["blocks.0.resid_post"], ref["blocks.0.resid_post"])


def test_a_block_with_hooks_of_its_own_has_no_names_the_others_keep_theirs() -> None:
    model = GPT().eval()
    seen: list[torch.Tensor] = []
    model.blocks[0].register_forward_hook(lambda m, a, out: seen.append(out.clone()))
    listed = {c for s in fxprobe.sites(model, tracer="fx") for c in s.canonical}
    assert not any(c.startswith("blocks.0.") and c != "blocks.0.resid_pre" for c in listed)
    assert {"blocks.1.resid_pre", "blocks.1.resid_post", "blocks.2.attn.q"} <= listed
    tapped = fxprobe.tap(model, ops="blocks.1.resid_pre", tracer="fx")
    with torch.no_grad():
        tapped(torch.randint(0, 100, (2, 5)))
    assert len(seen) == 1 and torch.equal(tapped.taps["blocks.1.resid_pre"], seen[0])
