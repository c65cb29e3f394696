"""fxprobe's captures skip dynamo's per-write stack records (its log of the writes a capture
replays: every layer's cache entry), unless the user set another policy or asked for the
log; the setting is restored after each call, and values stay the model's."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import transformers as tf
from canonical_support import DECODER, TOKENS
from torch._dynamo.side_effects import SideEffects

import fxprobe

_SEEN: list[str] = []


@pytest.fixture
def policies(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The replay policy in force at each write dynamo records while it traces."""
    record = SideEffects._capture_user_stack

    def seen(self: Any, key: Any) -> None:
        _SEEN.append(torch._dynamo.config.side_effect_replay_policy)
        record(self, key)

    _SEEN.clear()
    monkeypatch.setattr(SideEffects, "_capture_user_stack", seen)
    monkeypatch.delenv("TORCH_LOGS", raising=False)
    return _SEEN


@pytest.mark.parametrize("user", ["info", "warn"])
def test_the_policy_during_captures_and_after(user: str, policies: list[str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch._dynamo.config, "side_effect_replay_policy", user)
    monkeypatch.setenv("FXPROBE_DYNAMO_REGIONS", "shared")
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(**DECODER, **TOKENS)).eval()
    tapped = fxprobe.tap(model, ops="blocks.*.resid_post", tracer="dynamo")
    ids = torch.randint(2, 100, (1, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(ids)
        out = tapped(ids)  # a prefill: each layer's cache entry is written
        step = tapped(ids[:, :1], cache=out.cache)
        ref_step = model(ids[:, :1], cache=ref.cache)
    assert policies, "dynamo recorded no write: the test no longer sees the captures"
    assert set(policies) == {"silent" if user == "info" else user}
    assert torch._dynamo.config.side_effect_replay_policy == user
    torch.testing.assert_close(out.logits, ref.logits)
    torch.testing.assert_close(step.logits, ref_step.logits)
