"""A model that raises while dynamo traces it (a bad argument, a transformers input check):
dynamo marks the frame's code, and the resume function after a graph break, to be skipped
for good. The next calls of the tapped model, and of another tap of the same class, are
captured again with every site (``frontends/dynamo_rearm.py``); before, each later call
raised ``DynamoError`` (blaming the recompile limit) or ``SelectorError`` (the sites after the
graph break never seen again). Values against the untapped model."""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from canonical_support import DECODER, TOKENS
from torch import nn

import fxprobe


class Checked(nn.Module):
    def __init__(self, split: bool) -> None:
        super().__init__()
        self.fc, self.fc2, self.split = nn.Linear(4, 4), nn.Linear(4, 4), split

    def forward(self, x: torch.Tensor, flag: bool = False) -> torch.Tensor:
        h = self.fc(x)
        if self.split:
            torch._dynamo.graph_break()
        if flag:
            raise ValueError("flag is not supported")
        return self.fc2(h).relu()


@pytest.mark.parametrize("warm", [False, True], ids=["cold", "warm"])
@pytest.mark.parametrize("split", [False, True], ids=["whole", "graph-break"])
def test_calls_after_the_model_raised_are_captured(split: bool, warm: bool) -> None:
    torch.manual_seed(0)
    model = Checked(split)
    x = torch.randn(2, 4)
    first = fxprobe.tap(model, ops=["fc", "fc2"], tracer="dynamo")
    with torch.no_grad():
        if warm:
            first(x)
        with pytest.raises(ValueError, match="flag is not supported"):
            first(x, flag=True)
        for n in (2, 3):  # a new batch too
            xs = torch.randn(n, 4)
            out = first(xs)
            torch.testing.assert_close(out, model(xs))
            torch.testing.assert_close(first.taps["fc"], model.fc(xs))
            torch.testing.assert_close(first.taps["fc2"], model.fc2(model.fc(xs)))
        # another model of the class, tapped after: the code after the break is its too
        other = Checked(split)
        second = fxprobe.tap(other, ops=["fc2"], tracer="dynamo")
        out = second(x)
        torch.testing.assert_close(out, other(x))
        torch.testing.assert_close(second.taps["fc2"], other.fc2(other.fc(x)))


@pytest.mark.parametrize("mode", ["1", "shared"])
def test_a_transformers_input_error_leaves_the_tapped_model_usable(
        mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FXPROBE_DYNAMO_REGIONS", mode)
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(**DECODER, **TOKENS)).eval()
    tapped = fxprobe.tap(model, ops="blocks.*.resid_post", tracer="dynamo")
    ids = torch.randint(1, 100, (2, 6))
    embeds = model.get_input_embeddings()(ids)
    with torch.no_grad():
        with pytest.raises(ValueError):  # both ids and embeddings: transformers refuses
            tapped(input_ids=ids, inputs_embeds=embeds, use_cache=False)
        out = tapped(input_ids=ids, use_cache=False)
        kept: dict[int, torch.Tensor] = {}
        handles = [layer.register_forward_hook(
            lambda m, a, o, i=i: kept.__setitem__(i, (o[0] if isinstance(o, tuple) else o).clone()))
            for i, layer in enumerate(model.model.layers)]
        try:
            ref = model(input_ids=ids, use_cache=False)
        finally:
            for h in handles:
                h.remove()
    torch.testing.assert_close(out.logits, ref.logits)
    names = {c: s.name for s in tapped.known_sites() for c in s.canonical}
    for i, value in kept.items():
        torch.testing.assert_close(tapped.taps[names[f"blocks.{i}.resid_post"]], value)
