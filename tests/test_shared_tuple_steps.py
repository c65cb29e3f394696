"""``FXPROBE_DYNAMO_REGIONS=shared`` on Bloom and Falcon (layers returning tuples) over a
prefill and generation steps with a KV cache: per-call edits of ``blocks.1.resid_pre`` and
``blocks.0.resid_post``, and the values kept at every layer's ``resid_post``, against hooks
editing / cloning the untapped model's layers over the same steps (a later in-place write on a
layer's output, missed by the analysis of ``block_kv``, would show as a kept value that
differs from the hook's clone)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import pytest
import torch
import transformers as tf
from canonical_support import TOKENS

import fxprobe

MODELS = {
    "Bloom": lambda: tf.BloomForCausalLM(tf.BloomConfig(n_layer=2, hidden_size=32, n_head=4,
                                                        **TOKENS)),
    "Falcon": lambda: tf.FalconForCausalLM(tf.FalconConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=2, **TOKENS)),
}
Edit = Callable[[torch.Tensor], torch.Tensor]


def _hidden(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    return args[0] if args else kwargs["hidden_states"]


def _steps(model: Any, call: Callable[..., Any], ids: torch.Tensor, cache: bool) -> list[Any]:
    """A prefill of ``ids`` then two steps of one token each (the cache's or the whole)."""
    outs, past, seq = [], None, ids
    for step in range(3):
        if step:
            nxt = torch.tensor([[7 + step], [11 + step]])
            seq = torch.cat([seq, nxt], 1)
        if cache:
            out = call(seq if past is None else seq[:, -1:], past_key_values=past,
                       use_cache=True)
            past = out.past_key_values
        else:
            out = call(seq, use_cache=False)
        outs.append(out.logits)
    return outs


def _hooked(model: Any, ids: torch.Tensor, cache: bool, layers: Any, pre: Edit | None,
            post: Edit | None) -> tuple[list[Any], list[dict[int, torch.Tensor]]]:
    kept: list[dict[int, torch.Tensor]] = []

    def keep(m: Any, a: Any, o: Any, i: int) -> None:
        if i == 0:
            kept.append({})
        # blocks.0.resid_post is blocks.1.resid_pre: taps see the value after the edit
        kept[-1][i] = pre(o[0]) if i == 0 and pre is not None else o[0].clone()

    handles = [layer.register_forward_hook(lambda m, a, o, i=i: keep(m, a, o, i))
               for i, layer in enumerate(layers)]
    if post is not None:  # registered first on layer 0: it runs before the clone
        handles.insert(0, layers[0].register_forward_hook(
            lambda m, a, o: (post(o[0]), *o[1:])))
        layers[0]._forward_hooks.move_to_end(next(reversed(layers[0]._forward_hooks)), False)
    if pre is not None:
        def edit_pre(m: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            if args:
                return (pre(args[0]), *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": pre(kwargs["hidden_states"])}
        handles.append(layers[1].register_forward_pre_hook(edit_pre, with_kwargs=True))
    try:
        outs = _steps(model, model, ids, cache)
    finally:
        for h in handles:
            h.remove()
    return outs, kept


@pytest.mark.parametrize("cache", [False, True], ids=["no-cache", "cache"])
@pytest.mark.parametrize("family", sorted(MODELS))
def test_edits_and_values_over_steps(family: str, cache: bool,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FXPROBE_DYNAMO_REGIONS", "shared")
    torch.manual_seed(0)
    model = MODELS[family]().eval()
    layers = model.transformer.h
    ids = torch.randint(1, 100, (2, 5), generator=torch.Generator().manual_seed(1))
    tapped = fxprobe.tap(model, ops=fxprobe.where(lambda s: True), tracer="dynamo")
    pre: Edit = lambda v: v * 0.5 + 1  # noqa: E731
    post: Edit = lambda v: v.flip(-1)  # noqa: E731
    with torch.no_grad():
        tapped(ids, use_cache=cache)
        names = {c: s.name for s in tapped.known_sites() for c in s.canonical}
        posts = [names[f"blocks.{i}.resid_post"] for i in range(len(layers))]
        for edits, (p, q) in (({"blocks.1.resid_pre": lambda s, v: pre(v)}, (pre, None)),
                              ({"blocks.0.resid_post": lambda s, v: post(v)}, (None, post)),
                              ({}, (None, None))):
            kept: list[dict[int, torch.Tensor]] = []

            def call(*args: Any, edits: dict[str, Any] = edits,
                     kept: list[dict[int, torch.Tensor]] = kept, **kwargs: Any) -> Any:
                with tapped.intervene(edits) if edits else contextlib.nullcontext():
                    out = tapped(*args, **kwargs)
                kept.append({i: tapped.taps[n].clone() for i, n in enumerate(posts)})
                return out

            got = _steps(model, call, ids, cache)
            ref, ref_kept = _hooked(model, ids, cache, layers, p, q)
            for step, (a, b) in enumerate(zip(got, ref, strict=True)):
                torch.testing.assert_close(a, b, msg=f"{sorted(edits)} step {step} logits")
            for step, (a, b) in enumerate(zip(kept, ref_kept, strict=True)):
                for i in b:
                    torch.testing.assert_close(a[i], b[i], msg=f"{sorted(edits)} step {step} "
                                               f"blocks.{i}.resid_post")
