"""Review of canonical names under torch.fx, continued: an encoder-decoder (two stacks; the
decoder's cross-attention keys come from the encoder, their view sized from the decoder's
stream, ``k.view(x.size(0), ...)``) and ``nn.MultiheadAttention`` batch first or not. Each
name's value is what forward hooks that clone see on an untapped copy, by definition; a name
the layout cannot have is refused."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxprobe
from tests.test_review_canonical_fx import MLP, Attn, Block, D, H


class CrossAttn(Attn):
    def forward(self, x: torch.Tensor, mem: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        B, T, S = x.size(0), x.size(1), mem.size(1)
        q = self.wq(x).view(B, T, H, D // H).transpose(1, 2)
        k = self.wk(mem).view(B, S, H, D // H).transpose(1, 2)  # sized from x: B
        v = self.wv(mem).view(B, S, H, D // H).transpose(1, 2)
        z = F.scaled_dot_product_attention(q, k, v)
        return self.o(z.transpose(1, 2).reshape(B, T, D))


class DecBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2, self.ln3 = nn.LayerNorm(D), nn.LayerNorm(D), nn.LayerNorm(D)
        self.attn, self.cross, self.mlp = Attn(), CrossAttn(), MLP()

    def forward(self, x: torch.Tensor, mem: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        x = x + self.cross(self.ln2(x), mem)
        return x + self.mlp(self.ln3(x))


class EncDec(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.src, self.tgt = nn.Embedding(50, D), nn.Embedding(50, D)
        self.enc = nn.ModuleList([Block() for _ in range(2)])
        self.enc_ln = nn.LayerNorm(D)
        self.dec = nn.ModuleList([DecBlock() for _ in range(2)])
        self.ln_f, self.head = nn.LayerNorm(D), nn.Linear(D, 50, bias=False)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        m = self.src(src)
        for b in self.enc:
            m = b(m)
        m = self.enc_ln(m)
        x = self.tgt(tgt)
        for b in self.dec:
            x = b(x, m)
        return self.head(self.ln_f(x))


def _hooks(model: nn.Module, args: tuple[Any, ...], spec: list[tuple[str, str, str]]
           ) -> dict[str, Any]:
    """``{name: clone}`` for each (name, module path, "in" or "out"), and ``model(*args)``
    as ``logits``."""
    ref: dict[str, Any] = {}
    handles = []
    for name, path, where in spec:
        mod = model.get_submodule(path)
        if where == "in":
            handles.append(mod.register_forward_pre_hook(
                lambda m, a, name=name: ref.__setitem__(name, a[0].detach().clone())))
        else:
            handles.append(mod.register_forward_hook(
                lambda m, a, o, name=name: ref.__setitem__(
                    name, (o[0] if isinstance(o, tuple) else o).detach().clone())))
    with torch.no_grad():
        ref["logits"] = model(*args)
    for h in handles:
        h.remove()
    return ref


def _encdec_spec() -> list[tuple[str, str, str]]:
    spec = [("encoder.embed", "src", "out"), ("decoder.embed", "tgt", "out"),
            ("encoder.ln_final", "enc_ln", "out"), ("decoder.ln_final", "ln_f", "out")]
    for i in range(2):
        e, d = f"encoder.blocks.{i}.", f"decoder.blocks.{i}."
        spec += [(e + "resid_pre", f"enc.{i}", "in"), (e + "resid_post", f"enc.{i}", "out"),
                 (e + "resid_mid", f"enc.{i}.ln2", "in"), (e + "attn_out", f"enc.{i}.attn", "out"),
                 (e + "mlp_out", f"enc.{i}.mlp", "out"), (e + "attn.q", f"enc.{i}.attn.wq", "out")]
        spec += [(d + "resid_pre", f"dec.{i}", "in"), (d + "resid_post", f"dec.{i}", "out"),
                 (d + "resid_mid", f"dec.{i}.ln2", "in"),
                 (d + "resid_mid_cross", f"dec.{i}.ln3", "in"),
                 (d + "attn_out", f"dec.{i}.attn", "out"),
                 (d + "cross_attn_out", f"dec.{i}.cross", "out"),
                 (d + "mlp_out", f"dec.{i}.mlp", "out"),
                 (d + "mlp.pre", f"dec.{i}.mlp.fc", "out"),
                 (d + "attn.q", f"dec.{i}.attn.wq", "out"),
                 (d + "attn.k", f"dec.{i}.attn.wk", "out"),
                 (d + "cross_attn.q", f"dec.{i}.cross.wq", "out"),
                 (d + "cross_attn.k", f"dec.{i}.cross.wk", "out"),
                 (d + "cross_attn.v", f"dec.{i}.cross.wv", "out"),
                 (d + "cross_attn.z", f"dec.{i}.cross.o", "in")]
    return spec


@pytest.mark.parametrize("tracer", ["fx", "auto"])
def test_two_stacks_each_name_is_its_value_and_cross_attention_is_named_as_such(
        tracer: str) -> None:
    """The decoder's cross-attention keys were taken as the block's own (their view reads
    ``x.size(0)``): ``decoder`` had no ``cross_attn.*``, ``attn.q`` was the cross-attention's
    q and ``attn_out``/``resid_mid`` were each on two sites (an edit by name ran on both)."""
    model = EncDec().eval()
    reference = copy.deepcopy(model)
    spec = _encdec_spec()
    names = [n for n, _, _ in spec] + ["logits"]
    listed = {c: s.name for s in fxprobe.sites(model, tracer="fx") for c in s.canonical}
    assert set(names) <= set(listed), set(names) - set(listed)
    assert listed["decoder.blocks.1.cross_attn_out"] == "dec.1.cross.o"
    assert listed["decoder.blocks.1.attn_out"] == "dec.1.attn.o"
    tapped = fxprobe.tap(model, ops=names, tracer=tracer)
    for s_shape, t_shape in [((2, 5), (2, 3)), ((1, 7), (1, 9)), ((2, 5), (2, 3))]:
        src, tgt = torch.randint(0, 50, s_shape), torch.randint(0, 50, t_shape)
        want = _hooks(reference, (src, tgt), spec)
        for key in [k for k in want if ".attn." in k or ".cross_attn." in k]:
            want[key] = want[key].reshape(*want[key].shape[:2], H, D // H)
            if not key.endswith(".z"):
                want[key] = want[key].transpose(1, 2)
        with torch.no_grad():
            out = tapped(src, tgt)
        assert torch.equal(out, want["logits"])
        for name in names:
            torch.testing.assert_close(tapped.taps[name], want[name], msg=name)
    src, tgt = torch.randint(0, 50, (2, 4)), torch.randint(0, 50, (2, 6))
    with torch.no_grad():  # an edit by name: one site, as a hook on the module
        with tapped.intervene({"decoder.blocks.0.attn_out": lambda s, v: -v}):
            edited = tapped(src, tgt)
        hook = reference.dec[0].attn.register_forward_hook(lambda m, a, o: -o)
        expected = reference(src, tgt)
        hook.remove()
        plain = tapped(src, tgt)
    torch.testing.assert_close(edited, expected)
    assert torch.equal(plain, reference(src, tgt).detach())


class MHABlock(nn.Module):
    def __init__(self, batch_first: bool) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.attn = nn.MultiheadAttention(D, H, batch_first=batch_first)
        self.fc, self.proj = nn.Linear(D, 32), nn.Linear(32, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.proj(torch.relu(self.fc(self.ln2(x))))


class MHAModel(nn.Module):
    def __init__(self, batch_first: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.batch_first = batch_first
        self.emb = nn.Embedding(50, D)
        self.layers = nn.ModuleList([MHABlock(batch_first) for _ in range(2)])
        self.norm, self.out = nn.LayerNorm(D), nn.Linear(D, 50)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        if not self.batch_first:
            x = x.transpose(0, 1)
        for b in self.layers:
            x = b(x)
        if not self.batch_first:
            x = x.transpose(0, 1)
        return self.out(self.norm(x))


@pytest.mark.parametrize("batch_first", [True, False])
def test_multihead_attention_names_are_their_values_and_its_insides_are_absent(
        batch_first: bool) -> None:
    model = MHAModel(batch_first).eval()
    reference = copy.deepcopy(model)
    spec = [("embed", "emb", "out")] + [
        (f"blocks.{i}.{r}", f"layers.{i}{p}", w) for i in range(2) for r, p, w in [
            ("resid_pre", "", "in"), ("resid_post", "", "out"), ("attn_out", ".attn", "out"),
            ("resid_mid", ".ln2", "in"), ("mlp.pre", ".fc", "out"), ("mlp.post", ".proj", "in"),
            ("mlp_out", ".proj", "out")]]
    if batch_first:  # the final norm reads the last block's stream (not through a transpose)
        spec += [("ln_final", "norm", "out")]
    names = [n for n, _, _ in spec] + (["logits"] if batch_first else [])
    listed = {c for s in fxprobe.sites(model, tracer="fx") for c in s.canonical}
    assert listed == set(names), listed ^ set(names)
    for absent in ("blocks.0.attn.q", "blocks.1.attn.z", "blocks.0.attn.pattern", "pos_embed"):
        with pytest.raises(fxprobe.SelectorError):
            fxprobe.tap(model, ops=absent, tracer="fx")
    tapped = fxprobe.tap(model, ops=names, tracer="fx")
    for shape in [(2, 5), (3, 2), (2, 5)]:
        ids = torch.randint(0, 50, shape)
        want = _hooks(reference, (ids,), spec)
        with torch.no_grad():
            out = tapped(ids)
        assert torch.equal(out, want["logits"])
        for name in names:
            torch.testing.assert_close(tapped.taps[name], want[name], msg=name)
    with torch.no_grad():
        with tapped.intervene({"blocks.1.attn_out": lambda s, v: v * 3}):
            edited = tapped(ids)
        hook = reference.layers[1].attn.register_forward_hook(lambda m, a, o: (o[0] * 3, o[1]))
        expected = reference(ids)
        hook.remove()
        plain = tapped(ids)
        unedited = reference(ids)  # (no grad: nn.MultiheadAttention's fast path, as tapped)
    torch.testing.assert_close(edited, expected)
    assert torch.equal(plain, unedited)
