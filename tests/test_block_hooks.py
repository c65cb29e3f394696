"""Hooks on modules inside repeated blocks (``frontends/dynamo_inline.py``): dynamo reuses the
body it traced for one block for the others, so a hook that only some blocks' modules carry
never ran (a forward hook zeroing layer 1's MLP left the logits unedited). A call whose blocks
or global module hooks are hooked is not marked: every hook runs where the model runs it, as
on an untapped copy with the same hooks, over a sequence of calls."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_dynamo_regions import LAYERS, build, kwargs, references, region
from torch import nn

import fxprobe


def _zero(m: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
    return out * 0


def _halve(m: nn.Module, args: Any) -> tuple[Any, ...]:
    return (args[0] * 0.5, *args[1:])


@pytest.mark.parametrize("when", ["before tap", "after a forward"])
def test_a_hook_inside_one_block_runs_and_edits(when: str,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FXPROBE_DYNAMO_REGIONS", "1")
    model, reference = build("Llama"), build("Llama")
    seen: list[str] = []

    def hook(where: str) -> Any:
        def run(m: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
            seen.append(where)
            return out * 0
        return run

    reference.model.layers[1].mlp.register_forward_hook(hook("reference"))
    if when == "before tap":
        model.model.layers[1].mlp.register_forward_hook(hook("tapped"))
    tapped = fxprobe.tap(model, ops="blocks.*.resid_post", tracer="dynamo")
    kw = kwargs("Llama")
    with torch.no_grad():
        if when == "after a forward":
            first = tapped(**kw)
            torch.testing.assert_close(first.logits, references("Llama", kw)["out"])
            assert region(tapped).inlined[1] == 1  # marked while nothing was hooked
            model.model.layers[1].mlp.register_forward_hook(hook("tapped"))
        for length in (7, 9):
            kw = kwargs("Llama", length=length)
            seen.clear()
            with pytest.warns(UserWarning, match="hooks of") if (
                    when == "after a forward" and length == 7) else _nothing():
                out = tapped(**kw)
            want = reference(**kw)
            assert seen.count("tapped") == 1 and seen.count("reference") == 1
            torch.testing.assert_close(out.logits, want.logits)
            # Layer 1's output is its attention's stream alone (the MLP's output zeroed).
            handles = []
            kept: dict[int, torch.Tensor] = {}
            for L, layer in enumerate(reference.model.layers):
                handles.append(layer.register_forward_hook(
                    lambda m, a, o, L=L, kept=kept: kept.__setitem__(L, o.detach().clone())))
            reference(**kw)
            for h in handles:
                h.remove()
            for L in range(LAYERS):
                torch.testing.assert_close(tapped.taps[f"blocks.{L}.resid_post"], kept[L])


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def test_a_global_hook_and_a_pre_hook(monkeypatch: pytest.MonkeyPatch) -> None:
    """A global forward hook (every module) counting calls, and a pre-hook halving what one
    layer's attention output projection reads: counts and values as on the untapped copy."""
    monkeypatch.setenv("FXPROBE_DYNAMO_REGIONS", "1")
    model, reference = build("Llama"), build("Llama")
    for m in (model, reference):
        m.model.layers[2].self_attn.o_proj.register_forward_pre_hook(_halve)
    tapped = fxprobe.tap(model, ops="blocks.*.resid_post", tracer="dynamo")
    kw = kwargs("Llama")
    calls: list[str] = []
    handle = nn.modules.module.register_module_forward_hook(
        lambda m, a, o: calls.append(type(m).__name__) if type(m).__name__ == "LlamaMLP"
        else None)
    try:
        with torch.no_grad():
            out = tapped(**kw)
            mine = list(calls)
            calls.clear()
            want = reference(**kw)
    finally:
        handle.remove()
    assert mine == calls == ["LlamaMLP"] * LAYERS
    torch.testing.assert_close(out.logits, want.logits)
    with torch.no_grad():  # the hooks gone: marked again, the pre-hook still runs
        out = tapped(**kw)
    torch.testing.assert_close(out.logits, reference(**kw).logits)
