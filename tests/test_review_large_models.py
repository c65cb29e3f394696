"""Sequences of calls on models loaded the way large models are (accelerate's ``device_map=``
with cpu and disk offload, ``dispatch_model``), and on models changed after ``tap()``: every
value against the untapped model loaded the same way, read by forward hooks that clone."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fxprobe
from fxprobe.core.errors import UsageError

accelerate = pytest.importorskip("accelerate")
transformers = pytest.importorskip("transformers")

LAYERS = 6


def _dmap() -> dict[str, str]:
    out = {"model.embed_tokens": "cpu", "model.norm": "cpu", "model.rotary_emb": "cpu",
           "lm_head": "cpu"}
    for i in range(LAYERS):
        out[f"model.layers.{i}"] = "disk" if i % 3 == 1 else "cpu"
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> str:
    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("llama")
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    return str(path)


def _load(how: str, saved: str, tmp: str) -> nn.Module:
    cls = transformers.LlamaForCausalLM
    if how == "device_map":
        return cls.from_pretrained(saved, device_map=_dmap(), offload_folder=tmp).eval()
    model = cls.from_pretrained(saved).eval()
    if how == "dispatch_model":
        return accelerate.dispatch_model(model, device_map=_dmap(), offload_dir=tmp)
    return model


def _hooked(model: nn.Module, ids: torch.Tensor, edits: dict[int, object] | None = None
            ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """Logits and each layer's output (cloned) of the untapped ``model``; ``edits``: a
    function of a layer's output that replaces it."""
    got: dict[int, torch.Tensor] = {}
    handles = []
    for i, layer in enumerate(model.model.layers):
        def hook(mod: nn.Module, args: tuple, out: object, i: int = i) -> object:
            t = out[0] if isinstance(out, tuple) else out
            fn = (edits or {}).get(i)
            if fn is not None:
                t = fn(t)  # type: ignore[operator]
            got[i] = t.detach().clone()
            if fn is None:
                return None
            return (t, *out[1:]) if isinstance(out, tuple) else t
        handles.append(layer.register_forward_hook(hook))
    try:
        with torch.no_grad():
            logits = model(ids).logits
    finally:
        for h in handles:
            h.remove()
    return logits, got


@pytest.mark.parametrize("how", ["device_map", "dispatch_model"])
def test_a_sequence_of_shapes_and_blocks_on_a_dispatched_model(
        how: str, saved: str, tmp_path: object) -> None:
    model = _load(how, saved, str(tmp_path))
    ref = _load(how, saved, str(tmp_path) + "-ref")
    tapped = fxprobe.tap(model, ops="blocks.*.resid_post")
    torch.manual_seed(1)
    calls = [  # (ids, the layer edited by a block and how, or None)
        (torch.randint(3, 64, (1, 7)), None),
        (torch.randint(3, 64, (1, 11)), None),  # a new length
        (torch.randint(3, 64, (2, 9)), None),  # a new batch
        (torch.randint(3, 64, (2, 9)), (1, lambda t: t * 2 + 1)),
        (torch.randint(3, 64, (2, 9)), None),  # after the block: unedited
        (torch.randint(3, 64, (1, 5)), (4, lambda t: -t)),  # another block, another layer
        (torch.randint(3, 64, (1, 7)), None),
    ]
    for step, (ids, edit) in enumerate(calls):
        want, values = _hooked(ref, ids, None if edit is None else {edit[0]: edit[1]})
        with torch.no_grad():
            if edit is None:
                got = tapped(ids).logits
            else:
                layer, fn = edit
                with tapped.intervene({f"blocks.{layer}.resid_post":
                                       lambda s, v, fn=fn: fn(v)}):
                    got = tapped(ids).logits
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=f"step {step}")
        for i in range(LAYERS):
            torch.testing.assert_close(tapped.taps[f"blocks.{i}.resid_post"], values[i],
                                       rtol=0, atol=0, msg=f"step {step}, layer {i}")
    # generate with and without an edit, then run_with_cache
    ids = calls[0][0]
    with torch.no_grad():
        assert torch.equal(tapped.generate(ids, max_new_tokens=3, do_sample=False),
                           ref.generate(ids, max_new_tokens=3, do_sample=False))
        with tapped.intervene({"blocks.2.resid_post": lambda s, v: v * 3}):
            got = tapped.generate(ids, max_new_tokens=3, do_sample=False)
        h = ref.model.layers[2].register_forward_hook(
            lambda m, a, o: (o[0] * 3, *o[1:]) if isinstance(o, tuple) else o * 3)
        try:
            want = ref.generate(ids, max_new_tokens=3, do_sample=False)
        finally:
            h.remove()
        assert torch.equal(got, want)
        out, cache = tapped.run_with_cache(ids, names=["blocks.3.resid_post"])
    logits, values = _hooked(ref, ids)
    torch.testing.assert_close(out.logits, logits, rtol=0, atol=0)
    torch.testing.assert_close(cache["blocks.3.resid_post"], values[3], rtol=0, atol=0)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x)) + x


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Block() for _ in range(3)])
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x)


@pytest.mark.parametrize("tracer", ["auto", "hooks"])
@pytest.mark.parametrize("change", ["closure", "submodule"])
def test_a_forward_or_submodule_replaced_on_the_model_after_tap_is_refused(
        tracer: str, change: str) -> None:
    # Before: the tapped module silently ran the forward and submodules of tap() time, and
    # its output differed from the model's with no word. The copy does not follow such a
    # change (hooks registered later are followed): every call refuses until it is undone.
    torch.manual_seed(0)
    model = _Net().eval()
    x = torch.randn(2, 8)
    tapped = fxprobe.tap(model, ops=nn.Linear, tracer=tracer)
    before = tapped(x)
    torch.testing.assert_close(before, model(x), rtol=0, atol=0)
    block = model.blocks[1]
    if change == "closure":
        inner = block.forward

        def wrapped(*args: object) -> torch.Tensor:
            return inner(*args) * 2  # type: ignore[operator]

        block.forward = wrapped
    else:
        old = block.fc
        block.fc = nn.Linear(8, 8)
    assert not torch.allclose(model(x), before)  # the model's values did change
    for _ in range(2):  # not said once and then ignored
        with pytest.raises(UsageError, match="'blocks.1'"):
            tapped(x)
    if change == "closure":
        del block.forward
    else:
        block.fc = old
    torch.testing.assert_close(tapped(x), model(x), rtol=0, atol=0)  # undone: runs again


def test_weights_changed_on_the_model_after_tap_are_seen(saved: str) -> None:
    model = _load("plain", saved, "")
    tapped = fxprobe.tap(model, ops="blocks.*.resid_post")
    ids = torch.tensor([[3, 9, 4, 17, 5]])

    def same() -> None:
        want, values = _hooked(model, ids)
        with torch.no_grad():
            got = tapped(ids).logits
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        torch.testing.assert_close(tapped.taps["blocks.2.resid_post"], values[2],
                                   rtol=0, atol=0)

    same()
    torch.manual_seed(2)
    model.load_state_dict({k: v + 0.05 * torch.randn_like(v)
                           for k, v in model.state_dict().items()})
    same()
    model.load_state_dict({k: v + 0.05 * torch.randn_like(v)
                           for k, v in model.state_dict().items()}, assign=True)
    same()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model(ids, labels=ids).loss.backward()
    opt.step()
    same()
    layer = model.model.layers[3].mlp.down_proj
    layer.weight = nn.Parameter(torch.randn_like(layer.weight))
    same()


# Found by review 27: a Qwen2 (or Gemma2) with full-attention and sliding-window layers, after a
# call without a cache, ran its full-attention layers shared (one op each) beside the sliding
# ones traced in place at a call with a cache; the canonical pass named only the kernels it
# found in the graph, so the shared layers' calls had no ``blocks.L.resid_post`` there and
# tap()'s taps of them raised SiteNotRunError (logits, edits, run_with_cache were right).
def test_taps_of_shared_cache_layers_beside_sliding_layers_after_a_call_without_cache() -> None:
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        use_sliding_window=True, sliding_window=4, max_window_layers=2)
    model = transformers.Qwen2ForCausalLM(cfg).eval()
    tapped = fxprobe.tap(model, ops="blocks.*.resid_post")
    x = torch.randint(3, 64, (1, 9))
    got: dict[int, torch.Tensor] = {}
    handles = [layer.register_forward_hook(
        lambda m, a, o, i=i: got.__setitem__(i, (o[0] if isinstance(o, tuple) else o).clone()))
        for i, layer in enumerate(model.model.layers)]
    try:
        with torch.no_grad():
            want = model(x, use_cache=True).logits
    finally:
        for h in handles:
            h.remove()
    with torch.no_grad():
        tapped(x, use_cache=False)
        out = tapped(x, use_cache=True).logits
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    for i in range(4):
        torch.testing.assert_close(tapped.taps[f"blocks.{i}.resid_post"], got[i],
                                   rtol=0, atol=0, msg=f"layer {i}")
