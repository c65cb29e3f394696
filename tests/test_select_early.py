"""Selectors the module tree decides are refused at tap(), before torch dynamo captures anything;
selectors valid for a site only dynamo finds are not (runtime/early.py, frontends/dynamo_reach.py).

The reference for "valid" is dynamo itself: every name of every site it finds on GPT-2 and
Llama must pass the early check, as must the same name with its block index written ``*``."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

import fxprobe
from fxprobe.core.select import glob
from fxprobe.frontends.dynamo_reach import Reach, glob_reaches
from tests.life_models import gpt2, llama

tf = pytest.importorskip("transformers")

IDS = torch.tensor([[1, 5, 7, 2, 9]])


def _graphs() -> int:
    return counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("tracer", ["dynamo", "fx+dynamo", "auto"])
@pytest.mark.parametrize("ops, says", [
    ("blocks.*.resid_postt", ["blocks.*.resid_postt", "Did you mean: blocks.*.resid_post",
                              "canonical name"]),
    ("model.layerz.*", ["model.layerz.*", "Did you mean: model.layers.*", "module path"]),
    (nn.Conv2d, ["Conv2d", "holds no Conv2d module", "Linear"]),
    (["model.layers.*.mlp", "model.layer.*.mlp"], ["model.layer.*.mlp",
                                                   "Did you mean: model.layers.*.mlp"]),
    ([nn.Conv2d, nn.Conv1d], ["Conv2d"]),
])
def test_never_matching_selector_raises_at_tap_before_any_capture(tracer, ops, says):
    model = llama()
    before = _graphs()
    with pytest.raises(fxprobe.SelectorError) as err:
        fxprobe.tap(model, ops=ops, tracer=tracer)
    for text in says:
        assert text in str(err.value)
    assert _graphs() == before  # nothing was captured


def test_canonical_names_on_a_model_that_cannot_have_them():
    # No list of repeated blocks: no canonical names at all.
    flat = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    with pytest.raises(fxprobe.SelectorError, match="no list of repeated blocks"):
        fxprobe.tap(flat, ops="blocks.*.attn.q", tracer="dynamo")
    # Repeated blocks whose code computes no attention (no identifier there names one).
    stack = nn.Sequential(nn.Linear(8, 8), nn.Sequential(
        *[nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8)) for _ in range(3)]))
    before = _graphs()
    with pytest.raises(fxprobe.SelectorError, match="compute no attention"):
        fxprobe.tap(stack, ops="blocks.0.attn.q", tracer="dynamo")
    assert _graphs() == before
    # The module paths stay valid, and the same blocks with an attention may have the names.
    fxprobe.tap(stack, ops="1.0.0", tracer="dynamo")
    fxprobe.tap(llama(), ops="blocks.0.attn.q", tracer="dynamo")


def _tree_accepts(model: nn.Module, name: str) -> bool:
    return bool(Reach.of(model, [""]).could_match(glob(name)))


def _check_every_name(model: nn.Module, records: list[fxprobe.Site]) -> None:
    names = {n for s in records for n in (s.name, *s.canonical)}
    assert any(n.startswith("blocks.") for n in names)  # canonical names were found
    reach = Reach.of(model, [""])
    for name in sorted(names):
        starred = re.sub(r"(?<=\.)\d+(?=\.|$)", "*", name)
        for pattern in (name, starred, starred + "*"):
            assert reach.could_match(glob(pattern)), pattern


def test_every_name_dynamo_finds_on_llama_passes_the_early_check():
    model = llama()
    found = fxprobe.sites(model, tracer="dynamo", example_kwargs={"input_ids": IDS})
    _check_every_name(model, [*found.records, *found.modules, *found.inner])


@pytest.mark.parametrize("tracer", ["auto", "dynamo", "fx+dynamo", "hooks"])
def test_valid_selectors_of_every_kind_are_accepted(tracer):
    model = gpt2()
    block = model.transformer.h[0]
    valid: list[object] = [
        "transformer.h.*.mlp", "transformer.h.0.attn.c_attn", nn.LayerNorm, block,
        re.compile(r"h\.1\.mlp$"), fxprobe.where(lambda s: s.name.endswith("ln_f")),
        [nn.LayerNorm, nn.Conv2d], "transformer.ln_f",
    ]
    if tracer != "hooks":
        valid += ["blocks.*.resid_post", "blocks.0.attn.q", "logits", "embed",
                  "transformer.h.0.add", "*.softmax", torch.add, "input_ids",
                  "transformer.h.0.mlp_1*"]
    for ops in valid:
        fxprobe.tap(model, ops=ops, tracer=tracer).remove()


def test_values_after_an_accepted_tap_equal_hooks():
    """Two forwards under dynamo with selectors of several kinds: the values are those of
    forward hooks on the untapped model (the early check left the selection as it was);
    every name dynamo found passes the early check."""
    model = gpt2()
    tapped = fxprobe.tap(model, ops=["transformer.h.*.mlp", nn.Conv2d, "blocks.1.resid_post"],
                         tracer="dynamo")
    for ids in (IDS, IDS.flip(1)):  # two calls: the second's values are its own
        ref: dict[int, torch.Tensor] = {}
        hs = [model.transformer.h[i].mlp.register_forward_hook(
            lambda m, a, o, i=i, ref=ref: ref.__setitem__(i, o.detach().clone()))
            for i in range(2)]
        with torch.no_grad():
            out = model(ids).logits
        for h in hs:
            h.remove()
        with torch.no_grad():
            torch.testing.assert_close(tapped(ids).logits, out)
        for i in range(2):
            torch.testing.assert_close(tapped.taps[f"transformer.h.{i}.mlp"], ref[i])
        assert tapped.taps["blocks.1.resid_post"].shape == (1, 5, 32)
    known = tapped.known_sites()  # GPT-2's, as dynamo found them
    _check_every_name(model, [*known.records, *known.modules, *known.inner])


def test_glob_reach_forms():
    assert glob_reaches("a.b.*", "a.b")  # a.b.<op>
    assert glob_reaches("a.b_1", "a.b")  # a second call
    assert glob_reaches("a.b.add_3", "a.b")
    assert not glob_reaches("a.b.c.d", "a.b")  # one identifier after the path, no more
    assert not glob_reaches("a.bc", "a.b")
    assert glob_reaches("[ab].?", "a")
    assert glob_reaches("input_ids", "")  # the model's own inputs and code
    assert not glob_reaches("x.y", "")
    assert glob_reaches("*", "anything")
    assert not glob_reaches("[!a]*", "a.b")


def test_unregistered_modules_are_reached():
    class Holder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.helpers = [nn.Linear(4, 4)]  # not a submodule: dynamo still runs its code

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.helpers[0](self.lin(x))

    assert _tree_accepts(Holder(), "helpers.0.linear")
