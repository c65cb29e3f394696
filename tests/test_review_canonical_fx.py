"""Review of canonical transformer names under torch.fx, on hand-written layouts the other
tests did not build: pre-LN, post-LN (BERT), parallel attention and MLP (GPT-J), a residual
added in the other order (``h + x``), a fused qkv projection, blocks in a Sequential or in
named children, ``nn.MultiheadAttention`` (batch first or not), two stacks, train-mode dropout
(a dropout module called twice in each block). Every name's value is checked against what it
is by definition, as forward hooks that clone see it on an untapped copy; a name a layout
cannot have must be refused, never attached to another value."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxprobe

D, H = 16, 2


class Attn(nn.Module):
    def __init__(self, fused: bool = False, own: str = "w") -> None:
        super().__init__()
        self.fused, self.own = fused, own  # own: the q/k/v projections' prefix
        if fused:
            self.qkv = nn.Linear(D, 3 * D)
        else:
            for n in "qkv":
                setattr(self, own + n, nn.Linear(D, D))
        self.o = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T = x.size(0), x.size(1)
        if self.fused:
            q, k, v = self.qkv(x).split(D, dim=-1)
        else:
            q, k, v = (getattr(self, self.own + n)(x) for n in "qkv")
        q, k, v = (t.view(B, T, H, D // H).transpose(1, 2) for t in (q, k, v))
        z = F.scaled_dot_product_attention(q, k, v)
        return self.o(z.transpose(1, 2).reshape(B, T, D))


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.proj = nn.Linear(D, 32), nn.Linear(32, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, kind: str = "pre", fused: bool = False, drop: float = 0.0) -> None:
        super().__init__()
        self.kind = kind
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.attn, self.mlp = Attn(fused), MLP()
        self.drop = nn.Dropout(drop)  # called twice per forward: after attn and after mlp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "pre":
            x = x + self.drop(self.attn(self.ln1(x)))
            return x + self.drop(self.mlp(self.ln2(x)))
        if self.kind == "swapped":  # the residual added second: h + x
            x = self.drop(self.attn(self.ln1(x))) + x
            return self.drop(self.mlp(self.ln2(x))) + x
        if self.kind == "post":  # BERT: the norm of each sum
            x = self.ln1(x + self.drop(self.attn(x)))
            return self.ln2(x + self.drop(self.mlp(x)))
        h = self.ln1(x)  # parallel (GPT-J): x + attn(ln(x)) + mlp(ln(x))
        if self.kind == "parallel1":  # as one add: x + (attn + mlp), the sum a branch
            return torch.add(x, self.drop(self.attn(h)) + self.drop(self.mlp(h)))
        return x + self.drop(self.attn(h)) + self.drop(self.mlp(h))


class LM(nn.Module):
    def __init__(self, kind: str = "pre", fused: bool = False, holder: str = "list",
                 drop: float = 0.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.wte, self.wpe = nn.Embedding(50, D), nn.Embedding(16, D)
        blocks = [Block(kind, fused, drop) for _ in range(2)]
        self.holder = holder
        if holder == "list":
            self.blocks: Any = nn.ModuleList(blocks)
        elif holder == "seq":
            self.blocks = nn.Sequential(*blocks)
        else:
            self.first, self.second = blocks
        self.ln_f, self.head = nn.LayerNorm(D), nn.Linear(D, 50, bias=False)

    def block_list(self) -> list[nn.Module]:
        return [self.first, self.second] if self.holder == "named" else list(self.blocks)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.wte(ids) + self.wpe(torch.arange(ids.size(1)))
        if self.holder == "seq":
            x = self.blocks(x)
        else:
            for b in self.block_list():
                x = b(x)
        return self.head(self.ln_f(x))


def per_head(t: torch.Tensor) -> torch.Tensor:
    B, T = t.shape[:2]
    return t.reshape(B, T, H, D // H).transpose(1, 2)


def hooked(model: LM, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """Every canonical value by its definition, from forward hooks that clone on ``model``
    (untapped); the names the layout cannot have are not in it."""
    ref: dict[str, Any] = {}
    handles = []

    def keep(name: str, value: torch.Tensor) -> None:
        ref[name] = value.detach().clone()

    def pre(mod: nn.Module, name: str) -> None:
        handles.append(mod.register_forward_pre_hook(lambda m, a: keep(name, a[0])))

    def post(mod: nn.Module, name: str) -> None:
        handles.append(mod.register_forward_hook(lambda m, a, o: keep(name, o)))

    for i, b in enumerate(model.block_list()):
        p, at = f"blocks.{i}.", b.attn
        pre(b, p + "resid_pre")
        post(b, p + "resid_post")
        if at.fused:
            post(at.qkv, p + "qkv")
        else:
            for n in "qkv":
                post(getattr(at, at.own + n), p + "attn." + n)
        pre(at.o, p + "attn.z")
        post(b.mlp.fc, p + "mlp.pre")
        pre(b.mlp.proj, p + "mlp.post")
        # the branches are what the residual adds read: the dropout's outputs, in order
        calls: list[str] = [p + "attn_out", p + "mlp_out"]
        handles.append(b.drop.register_forward_hook(
            lambda m, a, o, calls=calls: keep(calls.pop(0), o)))
        if b.kind in ("pre", "swapped"):
            pre(b.ln2, p + "resid_mid")
        elif b.kind == "post":
            post(b.ln1, p + "resid_mid")
    post(model.wte, "embed")
    post(model.wpe, "pos_embed")
    post(model.ln_f, "ln_final")
    with torch.no_grad():
        ref["logits"] = model(ids)
    for h in handles:
        h.remove()
    for i in range(2):
        qkv = ref.pop(f"blocks.{i}.qkv", None)
        for j, n in enumerate("qkv"):
            name = f"blocks.{i}.attn.{n}"
            ref[name] = per_head(qkv[..., j * D:(j + 1) * D] if qkv is not None else ref[name])
        ref[f"blocks.{i}.attn.z"] = ref[f"blocks.{i}.attn.z"].reshape(*ids.shape, H, D // H)
    return ref


ALL = ["embed", "pos_embed", "ln_final", "logits"] + [
    f"blocks.{i}.{r}" for i in range(2) for r in (
        "resid_pre", "attn.q", "attn.k", "attn.v", "attn.z", "attn_out", "resid_mid",
        "mlp.pre", "mlp.post", "mlp_out", "resid_post")]
LAYOUTS = [dict(kind="pre"), dict(kind="post"), dict(kind="parallel"), dict(kind="swapped"),
           dict(kind="parallel1"),
           dict(kind="pre", fused=True), dict(kind="post", fused=True),
           dict(kind="swapped", holder="seq")]


def _listed(model: nn.Module, **kw: Any) -> dict[str, str]:
    return {c: s.name for s in fxprobe.sites(model, tracer="fx", **kw) for c in s.canonical}


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda d: "-".join(map(str, d.values())))
@pytest.mark.parametrize("tracer", ["fx", "auto"])
def test_every_name_is_its_value_by_definition_across_calls(layout: dict[str, Any],
                                                            tracer: str) -> None:
    model = LM(**layout).eval()
    reference = copy.deepcopy(model)
    want = hooked(reference, torch.randint(0, 50, (1, 3)))
    listed = _listed(model)
    assert set(listed) == set(want), set(listed) ^ set(want)  # absent exactly where undefined
    tapped = fxprobe.tap(model, ops=sorted(want), tracer=tracer)
    for shape in [(2, 5), (3, 9), (1, 1), (2, 5)]:
        ids = torch.randint(0, 50, shape)
        want = hooked(reference, ids)
        with torch.no_grad():
            out = tapped(ids)
        assert torch.equal(out, want["logits"])
        for name, value in want.items():
            torch.testing.assert_close(tapped.taps[name], value, msg=f"{name} {shape}")
    if layout["kind"].startswith("parallel"):  # a name it cannot have: refused, not moved
        for name in ("blocks.0.resid_mid", "blocks.1.resid_mid"):
            with pytest.raises(fxprobe.SelectorError):
                fxprobe.tap(model, ops=name, tracer=tracer)
            with pytest.raises(fxprobe.SelectorError):
                fxprobe.extractor(model, return_nodes=[name])


def test_blocks_in_named_children_have_no_names_rather_than_wrong_ones() -> None:
    model = LM(holder="named").eval()
    assert not _listed(model)
    for name in ("blocks.0.resid_post", "ln_final", "logits"):
        with pytest.raises(fxprobe.SelectorError):
            fxprobe.tap(model, ops=name, tracer="fx")
        with pytest.raises(fxprobe.SelectorError):
            fxprobe.extractor(model, return_nodes=[name])


class Own(LM):
    """Projections whose own paths are canonical names: ``blocks.0.attn.q`` is a Linear."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        for b in self.blocks:
            b.attn = Attn(own="")


def test_a_name_that_is_the_models_own_is_one_site_not_two() -> None:
    """``blocks.0.attn.q`` is the model's own q projection here; it was also given, as a
    canonical name, to the per-head q: a tap read the projection under it, and an edit by
    that name ran on both (the projection, then its per-head view: q edited twice)."""
    model = Own().eval()
    reference = copy.deepcopy(model)
    listed = _listed(model)
    assert "blocks.0.attn.q" not in listed and "blocks.1.attn.v" not in listed
    assert listed["blocks.0.resid_post"] == "blocks.0.add_1"  # the others stay
    tapped = fxprobe.tap(model, ops="blocks.0.resid_post", tracer="fx")
    ids = torch.randint(0, 50, (2, 5))
    seen: list[str] = []

    def double(site: Any, value: torch.Tensor) -> torch.Tensor:
        seen.append(site.name)
        return value * 2

    with torch.no_grad():
        with tapped.intervene({"blocks.0.attn.q": double}):
            edited = tapped(ids)
        hook = reference.blocks[0].attn.q.register_forward_hook(lambda m, a, o: o * 2)
        expected = reference(ids)
        hook.remove()
        plain = tapped(ids)
        _, cache = tapped.run_with_cache(ids, names="blocks.0.attn.q")
    assert seen == ["blocks.0.attn.q"]
    torch.testing.assert_close(edited, expected)
    assert torch.equal(plain, reference(ids).detach())
    assert list(cache) == ["blocks.0.attn.q"] and cache["blocks.0.attn.q"].shape == (2, 5, D)


@pytest.mark.parametrize("kind", ["pre", "post", "parallel"])
def test_train_mode_dropout_then_eval_names_for_both_modes(kind: str) -> None:
    """Dropout (one module called twice per block) in train mode: ``attn_out``/``mlp_out`` are
    what the residual adds read, the dropped values; then eval mode, then train again."""
    model = LM(kind=kind, drop=0.3).train()
    reference = copy.deepcopy(model)
    names = sorted(hooked(copy.deepcopy(reference).eval(), torch.zeros(1, 2, dtype=torch.long)))
    assert set(_listed(model, train=True)) == set(names) == set(_listed(model))
    tapped = fxprobe.tap(model, ops=names, tracer="fx")
    ex = fxprobe.extractor(model, return_nodes=names, train=True)  # a graph per mode
    for step, (mode, shape) in enumerate([("train", (2, 5)), ("eval", (3, 4)),
                                          ("train", (1, 6)), ("eval", (2, 5))]):
        for m in (tapped, reference, ex):
            m.train(mode == "train")
        ids = torch.randint(0, 50, shape)
        torch.manual_seed(step)
        with torch.no_grad():
            out = tapped(ids)
        torch.manual_seed(step)
        with torch.no_grad():
            feats = ex(ids)
        torch.manual_seed(step)
        want = hooked(reference, ids)
        assert torch.equal(out, want["logits"]), mode
        for name in names:
            torch.testing.assert_close(tapped.taps[name], want[name], msg=f"{name} {mode}")
            torch.testing.assert_close(feats[name], want[name], msg=f"extractor {name} {mode}")


@pytest.mark.parametrize("kind", ["post", "parallel", "swapped"])
def test_extractor_tap_and_intervene_on_one_model_then_a_plain_call(kind: str) -> None:
    model = LM(kind=kind).eval()
    reference = copy.deepcopy(model)
    tapped = fxprobe.tap(model, ops=["blocks.0.resid_post", "blocks.1.attn_out"], tracer="fx")
    ex = fxprobe.extractor(model, return_nodes={"blocks.1.resid_pre": "pre1",
                                                "blocks.0.mlp_out": "m0", "ln_final": "lnf"})
    target = "blocks.1.mlp_out" if kind == "parallel" else "blocks.0.resid_mid"
    for shape in [(2, 5), (1, 8)]:
        ids = torch.randint(0, 50, shape)
        want = hooked(reference, ids)
        with torch.no_grad():
            feats = ex(ids)
            with tapped.intervene({target: lambda s, v: v * 0.5}):
                edited = tapped(ids)
            kept = tapped.taps["blocks.1.attn_out"].clone()
            plain = tapped(ids)
        b = reference.blocks[1 if kind == "parallel" else 0]
        if kind == "parallel":  # the MLP branch is the dropout's second call: hook the MLP
            handle = b.mlp.register_forward_hook(lambda m, a, o: o * 0.5)
        elif kind == "post":
            handle = b.ln1.register_forward_hook(lambda m, a, o: o * 0.5)
        else:  # resid_mid is the sum that the MLP's norm reads and the last add reads
            def halve_in_place(m: nn.Module, a: tuple[torch.Tensor, ...]) -> None:
                a[0].mul_(0.5)

            handle = b.ln2.register_forward_pre_hook(halve_in_place)
        with torch.no_grad():
            expected = reference(ids)
        handle.remove()
        torch.testing.assert_close(edited, expected)
        assert torch.equal(plain, want["logits"]) and not torch.equal(edited, plain)
        for name, key in [("blocks.1.resid_pre", "pre1"), ("blocks.0.mlp_out", "m0"),
                          ("ln_final", "lnf")]:
            torch.testing.assert_close(feats[key], want[name], msg=name)
        torch.testing.assert_close(tapped.taps["blocks.0.resid_post"],
                                   want["blocks.0.resid_post"])
        torch.testing.assert_close(tapped.taps["blocks.1.attn_out"], want["blocks.1.attn_out"])
        if kind == "parallel":  # the edit was downstream of block 1's attention
            torch.testing.assert_close(kept, want["blocks.1.attn_out"])
