"""Warm calls of shared blocks (``FXPROBE_DYNAMO_REGIONS=shared``, ``frontends/dynamo_blocks.py``):
a block whose graph dynamo compiled runs it without dynamo's frame evaluation, looked up by
dynamo's own guards (``Blocks.cached``). Sequences that a stale lookup would get wrong: a new
length, a new batch, train/eval, with and without gradients, autocast, a parameter edited in
place and two replaced, a shared config changed, a per-call edit, ``run_with_cache`` and a hook
after warm calls, float64. Every value against an untapped copy of the model (its output,
forward hooks that clone, its gradients)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from canonical_support import DECODER, TOKENS, tf
from test_dynamo_regions import kwargs
from torch import nn

import fxprobe
from fxprobe.frontends.dynamo_blocks import _MISS, Blocks, _plain

LAYERS = 4
POST = "blocks.{}.resid_post"


def _llama(**config: Any) -> nn.Module:
    torch.manual_seed(0)
    return tf.LlamaForCausalLM(tf.LlamaConfig(
        **{**DECODER, "num_hidden_layers": LAYERS, **config}, **TOKENS)).eval()


def _tap(model: nn.Module, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, list[int]]:
    """The tapped model, and a list that counts the block calls left to dynamo's frame
    evaluation (a warm call that the lookup served leaves none)."""
    monkeypatch.setenv("FXPROBE_DYNAMO_REGIONS", "shared")
    tapped = fxprobe.tap(model, ops="blocks.*.resid_post", tracer="dynamo")
    through: list[int] = []
    cached = Blocks.cached

    def counted(self: Blocks, *args: Any) -> Any:
        out = cached(self, *args)
        if out is _MISS:
            through.append(1)
        return out

    monkeypatch.setattr(Blocks, "cached", counted)
    return tapped, through


def _reference(model: nn.Module, kw: dict[str, Any], edit: Any = None,
               seed: int | None = None) -> tuple[Any, dict[str, torch.Tensor]]:
    """The untapped ``model``'s output and each layer's output (forward hooks that clone);
    ``edit(L, value)`` replaces layer L's output."""
    kept: dict[str, torch.Tensor] = {}
    handles = []
    for L, layer in enumerate(model.model.layers):
        def hook(m: nn.Module, args: Any, out: Any, *, L: int = L) -> Any:
            value = out[0] if isinstance(out, tuple) else out
            if edit is not None:
                value = edit(L, value)
            kept[POST.format(L)] = value.detach().clone()
            return (value, *out[1:]) if isinstance(out, tuple) else value
        handles.append(layer.register_forward_hook(hook))
    try:
        if seed is not None:
            torch.manual_seed(seed)
        out = model(**kw)
    finally:
        for h in handles:
            h.remove()
    return out, kept


def _same(tapped: Any, out: Any, ref: tuple[Any, dict[str, torch.Tensor]],
          taps: Any = None) -> None:
    taps = tapped.taps if taps is None else taps
    for L in range(LAYERS):
        torch.testing.assert_close(taps[POST.format(L)], ref[1][POST.format(L)],
                                   rtol=0, atol=0, msg=POST.format(L))
    torch.testing.assert_close(out.logits, ref[0].logits, rtol=0, atol=0)


def test_warm_calls_skip_dynamo_and_stay_right_across_a_sequence(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Attention dropout (0.5) shows the training flag: in training the reference runs with
    the same seed."""
    model = _llama(attention_dropout=0.5)
    reference = copy.deepcopy(model)
    tapped, through = _tap(model, monkeypatch)
    kw = kwargs("Llama")

    def check(kw: dict[str, Any], *, warm: bool | None = None, edit: Any = None,
              fn: Any = None, train: bool = False, grad: bool = False) -> torch.Tensor:
        through.clear()
        tapped.train(train)
        reference.train(train)
        for m in (model, reference):
            m.zero_grad(set_to_none=True)
        with torch.set_grad_enabled(grad):
            torch.manual_seed(7)
            if fn is None:
                out = tapped(**kw)
            else:
                with tapped.intervene(fn):
                    out = tapped(**kw)
            ref = _reference(reference, kw, edit, seed=7)
        _same(tapped, out, ref)
        if grad:  # gradients of every parameter as the untapped model's
            out.logits.pow(2).sum().backward()
            ref[0].logits.pow(2).sum().backward()
            for (name, p), q in zip(model.named_parameters(), reference.parameters(),
                                    strict=True):
                torch.testing.assert_close(p.grad, q.grad, msg=name)
        if warm is not None:  # served by the lookup (none left to dynamo), or not
            assert (not through) == warm, through
        return out.logits.detach()

    plain = check(kw)
    check(kw, warm=True)
    check(kwargs("Llama", length=11), warm=True)  # symbolic sizes: the same graph
    check(kwargs("Llama", batch=3), warm=True)
    # Gradients (another grad mode: another graph), then none again.
    check(kw, grad=True, warm=False)
    check(kw, grad=True, warm=True)
    check(kw, warm=True)
    # Training (dropout), with gradients; then eval, without.
    assert not torch.equal(check(kw, train=True, grad=True, warm=False), plain)
    check(kw, train=True, grad=True, warm=True)
    check(kw, warm=True)
    # A parameter written in place: the graph reads the live tensor.
    with torch.no_grad():
        for m in (model, reference):
            m.model.layers[2].mlp.up_proj.weight.mul_(1.5)
    check(kw, warm=True)
    # Parameters replaced on the model (its parameter dicts are the tapped copy's): the
    # instance's anchor (its first parameter, by which its names are looked up) and another.
    for m in (model, reference):
        layer = m.model.layers[1]
        layer.input_layernorm.weight = nn.Parameter(layer.input_layernorm.weight * 0.5)
        layer.mlp.up_proj.weight = nn.Parameter(layer.mlp.up_proj.weight.flip(0))
    check(kw)
    check(kw, warm=True)
    # A per-call edit after warm calls, inside a block and around the blocks; then none.
    check(kw, edit=lambda L, v: v * 3 + 1 if L == 2 else v,
          fn={POST.format(2): lambda s, v: v * 3 + 1})
    check(kw, edit=lambda L, v: v - 2 if L == 0 else v,
          fn={"blocks.1.resid_pre": lambda s, v: v - 2})
    check(kw, warm=True)
    with torch.no_grad():
        out, cache = tapped.run_with_cache(**kw, names="blocks.*.resid_post")
        _same(tapped, out, _reference(reference, kw), taps=cache)
    # float64: every parameter converted (shared dicts), a new dtype for the guards.
    model.double()
    reference.double()
    check(kw, warm=False)
    assert tapped.taps[POST.format(3)].dtype == torch.float64
    check(kw, warm=True)
    # A hook on the model after warm calls: it runs, seeing the values an untapped copy's do.
    seen: list[torch.Tensor] = []
    model.model.layers[3].mlp.register_forward_hook(
        lambda m, a, o: seen.append(o.detach().clone()))
    want: list[torch.Tensor] = []
    reference.model.layers[3].mlp.register_forward_hook(
        lambda m, a, o: want.append(o.detach().clone()))
    check(kw)
    assert len(seen) == len(want) == 1
    torch.testing.assert_close(seen[0], want[0], rtol=0, atol=0)


def _graph_only(module: Any, *args: Any, **kwargs: Any) -> Any:
    return __compiled_fn_1(args[0], module._modules["lin"]._parameters["weight"])[0]  # type: ignore[name-defined]  # noqa: F821


def _calls_the_module(module: Any, *args: Any, **kwargs: Any) -> Any:
    out = __compiled_fn_1(args[0])  # type: ignore[name-defined]  # noqa: F821
    return module(*out)


def _resumes(module: Any, *args: Any, **kwargs: Any) -> Any:
    return __resume_at_8_2(__compiled_fn_1(args[0]))  # type: ignore[name-defined]  # noqa: F821


def _stores(module: Any, *args: Any, **kwargs: Any) -> Any:
    out = __compiled_fn_1(args[0])  # type: ignore[name-defined]  # noqa: F821
    module.last = out[1]
    return out[0]


def _two_graphs(module: Any, *args: Any, **kwargs: Any) -> Any:
    return __compiled_fn_2(__compiled_fn_1(args[0])[0])  # type: ignore[name-defined]  # noqa: F821


@pytest.mark.parametrize(("fn", "plain"), [
    (_graph_only, True), (_calls_the_module, False), (_resumes, False), (_stores, False),
    (_two_graphs, False)])
def test_only_a_code_that_only_calls_its_graph_runs_without_dynamo(fn: Any, plain: bool) -> None:
    """A transformed code that calls anything but its one graph and dynamo's helpers (the
    module as written, a resume function after a graph break) or replays a side effect runs
    under dynamo's frame evaluation, which would compile what it calls."""
    assert _plain(fn.__code__) is plain
