"""A static KV cache: the layer's keys and values are written in place into a buffer
(``keys.index_copy_(2, positions, k)``, the buffer made by ``torch.zeros`` at the first step,
a graph input after it), which the attention kernel then reads. The keys are still the block's
own: its attention is ``attn.*`` (not ``cross_attn.*``, as when keys come from outside the
block), at the first step and at the later ones, whose one-position steps have the same shape
as the cache's length counter. ``attn.k``/``.v`` are what the kernel reads: a slice of the
buffer taken after the write (SDPA), or the buffer itself after the write (eager), with this
step's positions (an edit of them: tests/test_cache_edits.py)."""

from __future__ import annotations

import pytest
import torch

import fxprobe

tf = pytest.importorskip("transformers")

from test_cache_edits import _model as _llama  # noqa: E402

_ROLES = {"resid_pre", "attn.q", "attn.scores", "attn.pattern", "attn.z", "attn_out",
          "resid_mid", "mlp.pre", "mlp.post", "mlp_out", "resid_post"}


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@torch.no_grad()
def test_a_static_caches_blocks_have_self_attention_names(attn: str) -> None:
    model = _llama(attn)
    torch._dynamo.reset()
    tapped = fxprobe.tap(model, ops="blocks.1.*", tracer="dynamo")
    cache = tf.StaticCache(config=model.config, max_cache_len=8)
    ids = torch.tensor([[5, 6, 7]])
    out = tapped(input_ids=ids, past_key_values=cache, cache_position=torch.arange(3))
    roles = {c.split(".", 2)[2] for s in tapped.sites for c in s.canonical
             if c.startswith("blocks.1.")}
    assert not any("cross" in r for r in roles), roles
    assert roles == _ROLES | {"attn.k", "attn.v"}
    for step in (0, 1):
        if step:  # a one-position step: the buffers are graph inputs now
            tapped(input_ids=torch.tensor([[9]]), past_key_values=cache,
                   cache_position=torch.tensor([3]))
        for role, buffer in (("k", cache.layers[1].keys), ("v", cache.layers[1].values)):
            got = tapped.taps[f"blocks.1.attn.{role}"]  # the positions so far, or the buffer
            n = got.shape[2]
            assert n in (3 + step, 8), got.shape
            torch.testing.assert_close(got, buffer[:, :, :n])
        # This step's graph named the roles (a one-position step's names once went astray:
        # the length counter's update read as the stream, an arange as mlp_out).
        for role in ("resid_mid", "attn.pattern", "mlp_out", "attn_out"):
            assert tapped.taps[f"blocks.1.{role}"].shape[-2:] in ((3 - 2 * step, 32),
                                                                   (3 - 2 * step, n)), role
    torch.testing.assert_close(out.logits, _llama(attn)(
        input_ids=ids, past_key_values=tf.StaticCache(config=model.config, max_cache_len=8),
        cache_position=torch.arange(3)).logits)


@torch.no_grad()
def test_a_cache_written_by_indexing_is_read_as_one_written_by_index_copy(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``keys[:, :, positions] = k`` (transformers' fallback where ``index_copy_`` is missing)
    is a write into the buffer too."""
    def update(self: object, key_states: torch.Tensor, value_states: torch.Tensor,
               *args: object, **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[-2]
        at = torch.arange(n, device=self.device) + self.cumulative_length
        self.cumulative_length.add_(n)
        self.keys[:, :, at] = key_states
        self.values[:, :, at] = value_states
        return self.keys, self.values

    monkeypatch.setattr(tf.cache_utils.StaticLayer, "update", update)
    model = _llama("eager")
    torch._dynamo.reset()
    tapped = fxprobe.tap(model, ops="blocks.1.*", tracer="dynamo")
    cache = tf.StaticCache(config=model.config, max_cache_len=8)
    tapped(input_ids=torch.tensor([[5, 6, 7]]), past_key_values=cache,
           cache_position=torch.arange(3))
    roles = {c.split(".", 2)[2] for s in tapped.sites for c in s.canonical
             if c.startswith("blocks.1.")}
    assert roles == _ROLES | {"attn.k", "attn.v"}
