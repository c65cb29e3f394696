"""Warm calls of shared blocks (``FXPROBE_DYNAMO_REGIONS=shared``, ``frontends/dynamo_blocks.py``)
over sequences a stale lookup would get wrong: a block's parameters replaced by new objects,
one at the address of another block's freed one (as swapping checkpoints with
``load_state_dict(assign=True)`` does). Every value against an untapped copy of the model
(forward hooks that clone, its output under the same edit)."""

from __future__ import annotations

import copy
import gc
from typing import Any

import pytest
import torch
from canonical_support import DECODER, TOKENS, tf
from torch import nn

import fxprobe

LAYERS = 3
SITE = "model.layers.{}.mlp.down_proj"  # the input of down_proj, what mlp_out hooks see out


def _llama() -> nn.Module:
    torch.manual_seed(0)
    return tf.LlamaForCausalLM(tf.LlamaConfig(
        **{**DECODER, "num_hidden_layers": LAYERS}, **TOKENS)).eval()


def _mlp_outs(model: nn.Module, kw: dict[str, Any], scale: dict[int, float] | None = None
              ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The untapped model's logits and each layer's MLP output (forward hooks that clone);
    ``scale[L]`` multiplies layer L's."""
    seen: dict[str, torch.Tensor] = {}
    handles = []
    for L, layer in enumerate(model.model.layers):
        def hook(m: nn.Module, a: Any, out: torch.Tensor, L: int = L) -> torch.Tensor:
            out = out * (scale or {}).get(L, 1.0)
            seen[f"blocks.{L}.mlp_out"] = out.detach().clone()
            return out
        handles.append(layer.mlp.register_forward_hook(hook))
    try:
        with torch.no_grad():
            logits = model(**kw).logits
    finally:
        for h in handles:
            h.remove()
    return logits, seen


def _check(tapped: Any, reference: nn.Module, kw: dict[str, Any]) -> None:
    """Each layer's MLP output under its canonical and its own name, and an edit of each
    layer's by its own name, as the untapped copy's."""
    with torch.no_grad():
        tapped(**kw)
    want = _mlp_outs(reference, kw)[1]
    for L in reversed(range(LAYERS)):  # the last first: a value under another's name
        for name in (SITE.format(L), f"blocks.{L}.mlp_out"):
            torch.testing.assert_close(tapped.taps[name], want[f"blocks.{L}.mlp_out"],
                                       rtol=0, atol=0, msg=name)
    for L in range(LAYERS):
        with torch.no_grad(), tapped.intervene({SITE.format(L): lambda s, v: v * 3}):
            got = tapped(**kw).logits
        torch.testing.assert_close(got, _mlp_outs(reference, kw, {L: 3.0})[0], rtol=0, atol=0,
                                   msg=f"an edit of {SITE.format(L)}")


def test_a_new_parameter_at_a_freed_one_s_address_is_named_for_its_own_block(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A shared block's graph is named per instance by the identity of one of its parameters
    (``_Captured.version``, its first: ``input_layernorm.weight``). A parameter replaced twice
    is freed, and Python may give its address to a new parameter of another block: that block
    must not run under the names of the first (its values stored as the other block's, an
    edit by its own name silently not applied)."""
    monkeypatch.setenv("FXPROBE_DYNAMO_REGIONS", "shared")
    model = _llama()
    reference = copy.deepcopy(model)
    tapped = fxprobe.tap(model, ops="blocks.*.mlp_out", tracer="dynamo")
    kw = {"input_ids": torch.randint(2, 100, (2, 7), generator=torch.Generator().manual_seed(1)),
          "use_cache": False}
    _check(tapped, reference, kw)

    def replace(L: int, new: nn.Parameter | None = None) -> None:
        """Layer L's anchor replaced on the untapped copy, then on the model (last, so that
        nothing is allocated between the old one's release and what follows)."""
        norm = reference.model.layers[L].input_layernorm
        norm.weight = nn.Parameter(norm.weight.detach() * 1.25)
        norm = model.model.layers[L].input_layernorm
        norm.weight = new if new is not None else nn.Parameter(norm.weight.detach() * 1.25)

    replace(2)  # a parameter made after tap(): nothing but the model holds it
    _check(tapped, reference, kw)
    freed = id(model.model.layers[2].input_layernorm.weight)
    replace(2)  # the first freed
    gc.collect()
    kept = []  # new parameters, kept alive until one lands at the freed address
    for _ in range(200_000):
        p = nn.Parameter(model.model.layers[1].input_layernorm.weight.detach() * 1.25)
        if id(p) == freed:
            break
        kept.append(p)
    else:
        pytest.skip("no new parameter got the freed one's address")
    del kept
    replace(1, p)
    _check(tapped, reference, kw)
    _check(tapped, reference, kw)
