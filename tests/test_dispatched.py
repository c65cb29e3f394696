"""Models dispatched by accelerate (``device_map=`` with cpu and disk offload, ``dispatch_model``,
``cpu_offload``) and modules whose ``forward`` a wrapper replaced keep their op-level sites and
canonical names; values, outputs and per-call edits equal the untapped model's, read with
forward hooks that clone on a model loaded the same way."""

from __future__ import annotations

import functools
import types
import warnings

import pytest
import torch
from torch import nn

import fxprobe
from fxprobe.frontends.wrappers import WrappedForwardWarning

accelerate = pytest.importorskip("accelerate")
transformers = pytest.importorskip("transformers")

IDS = torch.tensor([[1, 5, 7, 3, 9, 2]])
DEVICE_MAP = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk",
              "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> str:
    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("llama")
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    return str(path)


def load(how: str, saved: str, tmp: str) -> nn.Module:
    """The model at ``saved``, loaded the way ``how`` says (each call a new model)."""
    cls = transformers.LlamaForCausalLM
    if how == "device_map":
        return cls.from_pretrained(saved, device_map=DEVICE_MAP, offload_folder=tmp).eval()
    model = cls.from_pretrained(saved).eval()
    if how == "dispatch_model":
        dm = {**DEVICE_MAP, "model.layers.0": "disk", "model.layers.1": "cpu"}
        return accelerate.dispatch_model(model, device_map=dm, offload_dir=tmp)
    if how == "cpu_offload":
        return accelerate.cpu_offload(model, execution_device=torch.device("cpu"))
    return model


def reference(model: nn.Module, edit: float = 1.0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Logits and cloned values read by forward hooks on the untapped ``model``; ``edit``
    multiplies layer 0's output (its ``resid_post``) as the model runs."""
    got: dict[str, torch.Tensor] = {}
    layers = model.model.layers

    def out(name: str, scale: float = 1.0):  # noqa: ANN202
        def hook(mod: nn.Module, args: tuple, output: object) -> object:
            t = output[0] if isinstance(output, tuple) else output
            got[name] = t.detach().clone() * scale
            if scale != 1.0:
                return (t * scale, *output[1:]) if isinstance(output, tuple) else t * scale
            return None
        return hook

    def mid(mod: nn.Module, args: tuple) -> None:
        got["blocks.1.resid_mid"] = args[0].detach().clone()

    handles = [layers[0].register_forward_hook(out("blocks.0.resid_post", edit)),
               layers[1].register_forward_hook(out("blocks.1.resid_post")),
               layers[1].self_attn.q_proj.register_forward_hook(out("q1")),
               layers[1].post_attention_layernorm.register_forward_pre_hook(mid)]
    try:
        with torch.no_grad():
            logits = model(IDS).logits
    finally:
        for h in handles:
            h.remove()
    return logits, got


HOWS = ["device_map", "dispatch_model", "cpu_offload"]


@pytest.mark.parametrize("how", HOWS)
def test_values_sites_and_canonical_names_equal_the_untapped_model(
        how: str, saved: str, tmp_path: object, monkeypatch: pytest.MonkeyPatch) -> None:
    model = load(how, saved, str(tmp_path))
    forward_before = model.__dict__["forward"]
    plain = load("plain", saved, "")
    logits, want = reference(load(how, saved, str(tmp_path)))
    torch.testing.assert_close(logits, plain(IDS).logits, rtol=0, atol=0)
    tapped = fxprobe.tap(model, ops=["blocks.*.resid_post", "blocks.1.resid_mid",
                                     "model.layers.1.self_attn.q_proj", nn.Linear],
                         tracer="auto")
    with torch.no_grad():
        out = tapped(IDS)
    torch.testing.assert_close(out.logits, logits, rtol=0, atol=0)
    taps = tapped.taps
    for name in ("blocks.0.resid_post", "blocks.1.resid_post", "blocks.1.resid_mid"):
        torch.testing.assert_close(taps[name], want[name], rtol=0, atol=0)
    torch.testing.assert_close(taps["model.layers.1.self_attn.q_proj"], want["q1"], rtol=0, atol=0)
    devices = tapped.devices  # where each value is computed, and where offloaded weights live
    # cpu_offload hooks only the modules that hold weights (and moves nothing between them).
    assert devices.get("blocks.1.resid_mid") == (None if how == "cpu_offload" else "cpu")
    kept = {"device_map": "disk", "dispatch_model": None, "cpu_offload": "cpu"}[how]
    assert devices["model.layers.1.self_attn.q_proj"] == (
        "cpu" if kept is None else f"cpu (weights offloaded to {kept})")
    assert fxprobe.tap(load("plain", saved, ""), ops=nn.Linear).devices == {}
    # Every site the plain model has under dynamo, with its canonical names. accelerate's
    # hooks keep the layers from being shared (captured once, called as one op each): they
    # are captured in the model's graph, as the plain model's marked layers are.
    monkeypatch.setenv("FXPROBE_DYNAMO_REGIONS", "marked")
    ref = fxprobe.tap(plain, ops="*", tracer="auto")
    ref(IDS)
    monkeypatch.delenv("FXPROBE_DYNAMO_REGIONS")
    mine = fxprobe.tap(model, ops="*", tracer="auto")
    with torch.no_grad():
        mine(IDS)
    assert {s.name: s.canonical for s in mine.sites} == {s.name: s.canonical for s in ref.sites}
    # The model is the user's: accelerate's wrapper is still its forward, with no hook added.
    assert model.__dict__["forward"] is forward_before
    assert not model.model.layers[1]._forward_hooks
    assert model.model.layers[1].self_attn.q_proj.weight.device == torch.device(
        "meta" if how != "dispatch_model" else "cpu")


@pytest.mark.parametrize("how", ["device_map", "cpu_offload"])
def test_intervene_and_run_with_cache_equal_hooks_making_the_same_edit(
        how: str, saved: str, tmp_path: object) -> None:
    logits, want = reference(load(how, saved, str(tmp_path)), edit=2.0)
    tapped = fxprobe.tap(load(how, saved, str(tmp_path)), ops="blocks.*.resid_post")
    with torch.no_grad(), tapped.intervene({"blocks.0.resid_post": lambda s, v: v * 2}):
        out = tapped(IDS)
    torch.testing.assert_close(out.logits, logits, rtol=0, atol=0)
    torch.testing.assert_close(tapped.taps["blocks.1.resid_post"], want["blocks.1.resid_post"],
                               rtol=0, atol=0)
    plain_logits, plain = reference(load(how, saved, str(tmp_path)))
    with torch.no_grad():
        out, cache = tapped.run_with_cache(IDS, names="blocks.*.resid_post")
    torch.testing.assert_close(out.logits, plain_logits, rtol=0, atol=0)
    for name in ("blocks.0.resid_post", "blocks.1.resid_post"):
        torch.testing.assert_close(cache[name], plain[name], rtol=0, atol=0)


def test_hooks_tracer_runs_accelerate_per_module(saved: str, tmp_path: object) -> None:
    logits, want = reference(load("device_map", saved, str(tmp_path)))
    model = load("device_map", saved, str(tmp_path))
    tapped = fxprobe.tap(model, ops=["model.layers.*", nn.Linear], tracer="hooks")
    with torch.no_grad():
        out = tapped(IDS)
    torch.testing.assert_close(out.logits, logits, rtol=0, atol=0)
    torch.testing.assert_close(tapped.taps["model.layers.1.self_attn.q_proj"], want["q1"],
                               rtol=0, atol=0)
    layer1 = tapped.taps["model.layers.1"]
    layer1 = layer1[0] if isinstance(layer1, tuple) else layer1
    torch.testing.assert_close(layer1, want["blocks.1.resid_post"], rtol=0, atol=0)
    # The offloaded weights went back to disk after the forward.
    assert model.model.layers[1].self_attn.q_proj.weight.device == torch.device("meta")


# -- a forward replaced by a wrapper, on a plain module ----------------------------------------

class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.fc2 = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x))) + x


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


def _partial(block: nn.Module) -> None:
    def wrapper(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return type(module).forward(module, x) * 1.5
    block.forward = functools.partial(wrapper, block)


def _closure(block: nn.Module) -> None:
    inner = block.forward

    def forward(x: torch.Tensor) -> torch.Tensor:
        return inner(x) * 1.5
    block.forward = forward


def _method(block: nn.Module) -> None:
    def forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return type(self).forward(self, x) * 1.5
    block.forward = types.MethodType(forward, block)


@pytest.mark.parametrize("tracer", ["auto", "fx", "hooks"])
@pytest.mark.parametrize("wrap", [_partial, _closure, _method])
def test_a_wrapped_forward_runs_on_the_copy(wrap: object, tracer: str) -> None:
    torch.manual_seed(0)
    net = Net().eval()
    wrap(net.blocks[0])  # type: ignore[operator]
    x = torch.randn(3, 4)
    want: dict[str, torch.Tensor] = {}
    names = ["blocks.0.fc1", "blocks.0.fc2", "blocks.1.fc1"]
    handles = [net.get_submodule(n).register_forward_hook(
        lambda m, a, o, n=n: want.__setitem__(n, o.detach().clone())) for n in names]
    expected = net(x)
    for h in handles:
        h.remove()
    with warnings.catch_warnings():
        warnings.simplefilter("error", WrappedForwardWarning)
        tapped = fxprobe.tap(net, ops=nn.Linear, tracer=tracer)
        out = tapped(x)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    for n in names:
        torch.testing.assert_close(tapped.taps[n], want[n], rtol=0, atol=0)


class _Holder:
    """A wrapper object holding the module: nothing fxprobe can rebind."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return type(self.module).forward(self.module, x)


def test_a_wrapper_fxprobe_cannot_see_through_is_named_in_a_warning() -> None:
    net = Net().eval()
    net.blocks[0].forward = _Holder(net.blocks[0]).forward
    with pytest.warns(WrappedForwardWarning, match=r"Block\.forward .*_Holder"):
        tapped = fxprobe.tap(net, ops=nn.Linear, tracer="hooks")
    tapped(torch.randn(2, 4))
    assert "blocks.1.fc1" in tapped.taps


@pytest.mark.parametrize("tracer", ["auto", "dynamo"])
@pytest.mark.parametrize("wrap", [_partial, _closure, _method])
def test_the_ops_of_a_wrapped_forward_are_sites_under_dynamo(wrap: object, tracer: str) -> None:
    torch.manual_seed(0)
    net = Net().eval()
    wrap(net.blocks[0])  # type: ignore[operator]
    x = torch.randn(3, 4)
    want: dict[str, torch.Tensor] = {}
    handles = [net.blocks[0].fc1.register_forward_hook(
                   lambda m, a, o: want.__setitem__("relu", torch.relu(o).detach().clone())),
               net.blocks[0].register_forward_hook(
                   lambda m, a, o: want.__setitem__("mul", o.detach().clone()))]
    expected = net(x)
    for h in handles:
        h.remove()
    tapped = fxprobe.tap(net, ops=["blocks.0.relu", "blocks.0.mul"], tracer=tracer)
    torch.testing.assert_close(tapped(x), expected, rtol=0, atol=0)
    assert not tapped.fallbacks
    torch.testing.assert_close(tapped.taps["blocks.0.relu"], want["relu"], rtol=0, atol=0)
    torch.testing.assert_close(tapped.taps["blocks.0.mul"], want["mul"], rtol=0, atol=0)


@pytest.mark.parametrize("tracer", ["fx", "auto", "hooks", "dynamo"])
@pytest.mark.parametrize("how", ["cpu_offload", "dispatch_model"])
def test_an_fx_traceable_model_dispatched_keeps_every_site(
        how: str, tracer: str, tmp_path: object) -> None:
    """fx regions call a module with accelerate's hooks (they run at its call, loading its
    weights) and reach its ops as a region of its own: every site of the plain model, equal."""
    torch.manual_seed(0)
    plain = Net().eval()
    model = Net().eval()
    model.load_state_dict(plain.state_dict())
    if how == "cpu_offload":
        model = accelerate.cpu_offload(model, execution_device=torch.device("cpu"))
    else:
        model = accelerate.dispatch_model(model, device_map={"blocks.0": "cpu", "blocks.1": "disk"},
                                          offload_dir=str(tmp_path), main_device="cpu")
    x = torch.randn(3, 4)
    ref = fxprobe.tap(plain, ops="*", tracer=tracer)
    mine = fxprobe.tap(model, ops="*", tracer=tracer)
    with torch.no_grad():
        torch.testing.assert_close(mine(x), ref(x), rtol=0, atol=0)
    assert not mine.fallbacks
    # A dispatched block is a region of its own under fx: its input is a site too.
    assert {s.name for s in ref.sites} <= {s.name for s in mine.sites}
    for s in ref.sites:
        torch.testing.assert_close(mine.taps[s.name], ref.taps[s.name], rtol=0, atol=0)
    assert model.blocks[1].fc1.weight.device == torch.device("meta")
