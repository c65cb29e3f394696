"""fxprobe on tensor-parallel models: 2 gloo ranks on CPU, spawned once for the session
(tests/gloo_job.py, shared with the other distributed tests).

A tiny Llama (hidden 32, 4 heads, 2 key/value heads, 2 layers) saved with ``save_pretrained``,
loaded with ``tp_plan="auto"`` or split by ``torch.distributed.tensor.parallel`` plans, tapped
under ``tracer="dynamo"``. Every scenario runs on both ranks inside one spawned job and checks
itself against the same model loaded whole in that process: forward hooks that clone (or edit)
on the untapped model for the values a module call holds (``attn.z`` is what ``o_proj`` reads,
``mlp.post`` what ``down_proj`` reads, ``mlp.pre`` what the activation reads, ``resid_post`` a
layer's output, ``attn_out`` what ``o_proj`` returns, the logits), and, for ``attn.q``/``k`` and
the pattern, which no module holds, the whole model tapped in the same process. Each rank's
value is compared with the full one (``gather=True``) or with its expected part of it: the
chunk of the split dimension in rank order, which ``site.sharding`` states.
"""

from __future__ import annotations

import functools
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from gloo_job import WORLD, assert_ok, verdicts
from torch import nn

import fxprobe
from fxprobe.frontends.sharding import ShardingWarning

transformers = pytest.importorskip("transformers")

HEADS, HEAD_DIM = 4, 8
CANONICAL = ["blocks.*.attn.q", "blocks.*.attn.k", "blocks.*.attn.v", "blocks.*.attn.z",
             "blocks.*.attn.pattern", "blocks.*.mlp.pre", "blocks.*.mlp.post",
             "blocks.*.resid_pre", "blocks.*.resid_mid", "blocks.*.resid_post",
             "blocks.*.attn_out", "blocks.*.mlp_out", "logits"]
SPLIT = {"attn.q": 1, "attn.k": 1, "attn.v": 1, "attn.z": 2, "attn.pattern": 1, "mlp.pre": 2,
         "mlp.post": 2}  # the dimension each canonical value is split along; others whole


def ids(n: int) -> torch.Tensor:
    return torch.arange(1, n + 1).remainder(60).unsqueeze(0) * 3 % 64


def save(path: Path) -> None:
    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=HEADS, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)


def whole(path: Path) -> nn.Module:
    return transformers.LlamaForCausalLM.from_pretrained(path).eval()


def sharded(path: Path) -> nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' notes on tp_plan
        return transformers.LlamaForCausalLM.from_pretrained(path, tp_plan="auto").eval()


def reference(model: nn.Module, x: torch.Tensor,
              edits: dict[str, Callable[[torch.Tensor], torch.Tensor]] | None = None
              ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Logits and cloned values of the untapped whole ``model`` read by forward hooks;
    ``edits`` (by canonical name) change the value as the model runs."""
    edits = edits or {}
    got: dict[str, torch.Tensor] = {}
    handles = []

    def reads(name: str, per_head: bool) -> Callable[..., Any]:  # the input of a module
        def pre(mod: nn.Module, args: tuple) -> tuple:
            v = args[0]
            if per_head:
                v = v.view(*v.shape[:-1], HEADS, HEAD_DIM)
            if name in edits:
                v = edits[name](v.clone())
            got[name] = v.clone()
            return (v.reshape(args[0].shape), *args[1:])
        return pre

    def returns(name: str) -> Callable[..., Any]:
        def hook(mod: nn.Module, args: tuple, out: Any) -> Any:
            t = out[0] if isinstance(out, tuple) else out
            if name in edits:
                t = edits[name](t.clone())
            got[name] = t.clone()
            return (t, *out[1:]) if isinstance(out, tuple) else t
        return hook

    def rotary(mod: nn.Module, args: tuple, out: Any) -> None:
        got["cos"], got["sin"] = out[0].clone(), out[1].clone()

    handles.append(model.model.rotary_emb.register_forward_hook(rotary))
    for i, layer in enumerate(model.model.layers):
        for p in ("q", "k", "v"):
            handles.append(getattr(layer.self_attn, f"{p}_proj").register_forward_hook(
                returns(f"blocks.{i}.{p}_proj")))
        handles += [
            layer.self_attn.o_proj.register_forward_pre_hook(reads(f"blocks.{i}.attn.z", True)),
            layer.mlp.down_proj.register_forward_pre_hook(reads(f"blocks.{i}.mlp.post", False)),
            layer.mlp.act_fn.register_forward_pre_hook(reads(f"blocks.{i}.mlp.pre", False)),
            layer.self_attn.o_proj.register_forward_hook(returns(f"blocks.{i}.attn_out")),
            layer.register_forward_hook(returns(f"blocks.{i}.resid_post"))]
    try:
        with torch.no_grad():
            logits = model(x).logits
    finally:
        for h in handles:
            h.remove()
    got["logits"] = logits
    for i in range(len(model.model.layers)):  # q, k, v after rotary, and the pattern, by hand
        heads = {}
        for p in ("q", "k", "v"):
            t = got.pop(f"blocks.{i}.{p}_proj")
            heads[p] = t.view(*t.shape[:-1], -1, HEAD_DIM).transpose(1, 2)
        q, k = transformers.models.llama.modeling_llama.apply_rotary_pos_emb(
            heads["q"], heads["k"], got["cos"], got["sin"])
        got[f"blocks.{i}.attn.q"], got[f"blocks.{i}.attn.k"] = q, k
        got[f"blocks.{i}.attn.v"] = heads["v"]
        kk = k.repeat_interleave(HEADS // k.shape[1], dim=1)
        scores = q @ kk.transpose(-1, -2) / HEAD_DIM ** 0.5
        n = q.shape[2]
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        got[f"blocks.{i}.attn.pattern"] = scores.softmax(-1)
    return logits, got


def part(full: torch.Tensor, sh: fxprobe.Site | Any, rank: int) -> torch.Tensor:
    """This rank's chunk of ``full`` along the dimension ``sh`` (a Sharding) names."""
    start, stop = sh.span(full.shape[sh.dim])
    assert sh.rank == rank and sh.ranks == WORLD
    return full.narrow(sh.dim, start, stop - start)


def sharding_of(tapped: Any, name: str) -> Any:
    """The record of site ``name`` in ``tapped.sites`` (the selected ones)."""
    for s in tapped.sites:
        if name == s.name or name in s.canonical:
            return s.sharding
    raise AssertionError(f"no site {name} in tapped.sites")


def close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.shape == b.shape, (what, tuple(a.shape), tuple(b.shape))
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m: f"{what}: {m}")


# ---------------------------------------------------------------------------- scenarios
SCENARIOS: dict[str, Callable[[int, Path], None]] = {}


def scenario(f: Callable[[int, Path], None]) -> Callable[[int, Path], None]:
    SCENARIOS[f.__name__] = f
    return f


def zero_head(v: torch.Tensor, head: int = 1) -> torch.Tensor:
    v = v.clone()
    v[:, :, head] = 0
    return v


EDITS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "blocks.0.attn.z": zero_head, "blocks.1.mlp.post": lambda v: v * 2.0}
"""Zero head 1 of layer 0's attn.z, scale layer 1's mlp.post (by hooks on the whole model)."""


@scenario
def local_parts_by_default(rank: int, path: Path) -> None:
    """gather=False: each canonical name on each rank; its value the rank's part of the whole
    model's, along the dimension its record names; the logits whole; a second call with
    another length too. Per-call edits of the parts (head 1 zeroed on the rank holding it)
    give the logits of the same edit on the whole model; a call after the block is unedited;
    run_with_cache hands back parts."""
    full, tapped = whole(path), fxprobe.tap(sharded(path), ops=CANONICAL, tracer="dynamo")
    for n in (8, 5):
        x = ids(n)
        logits, want = reference(full, x)
        with torch.no_grad():
            out = tapped(x).logits
        close(out, logits, "logits")
        for layer in range(2):
            for role in ("attn.q", "attn.k", "attn.v", "attn.pattern", "attn.z", "mlp.pre",
                         "mlp.post", "resid_post", "attn_out"):
                name = f"blocks.{layer}.{role}"
                ref = want[name]
                sh = sharding_of(tapped, name)
                if role in SPLIT:
                    assert sh is not None and sh.dim == SPLIT[role] and sh.understood, (name, sh)
                    assert not sh.gathered and not sh.partial and not sh.dtensor, (name, sh)
                    ref = part(ref, sh, rank)
                else:
                    assert sh is None, (name, sh)  # the same full value on every rank
                close(tapped.taps[name], ref, f"{name} at length {n}")
        q = tapped.taps["blocks.0.attn.q"]
        assert q.shape == (1, HEADS // WORLD, n, HEAD_DIM), q.shape  # 2 of 4 heads
        for name in ("logits", "blocks.1.resid_pre", "blocks.0.mlp_out"):
            assert tapped.taps[name] is not None

    def zero_global_head(site: fxprobe.Site, v: torch.Tensor) -> torch.Tensor:
        start, stop = site.sharding.span(HEADS)  # this rank's heads
        return zero_head(v, 1 - start) if start <= 1 < stop else v

    x = ids(7)
    plain, ref = reference(full, x)
    edited, _ = reference(full, x, EDITS)
    with torch.no_grad():
        with tapped.intervene({"blocks.0.attn.z": zero_global_head,
                               "blocks.1.mlp.post": lambda s, v: v * 2.0}):
            close(tapped(x).logits, edited, "intervene on the parts")
        close(tapped(x).logits, plain, "after the block")
        out, cache = tapped.run_with_cache(x, names=["blocks.1.mlp.pre"])
    close(out.logits, plain, "run_with_cache")
    sh = sharding_of(tapped, "blocks.1.mlp.pre")
    close(cache["blocks.1.mlp.pre"], part(ref["blocks.1.mlp.pre"], sh, rank), "cache")


@scenario
def gathered_values(rank: int, path: Path) -> None:
    """gather=True: every rank holds the whole model's values, the output unchanged; per-call
    edits and run_with_cache see the whole values, and the edits give the logits of the same
    edit on the whole model."""
    full = whole(path)
    tapped = fxprobe.tap(sharded(path), ops=CANONICAL, tracer="dynamo", gather=True)
    x = ids(8)
    logits, want = reference(full, x)
    with torch.no_grad():
        close(tapped(x).logits, logits, "logits")
    for name in ("blocks.0.attn.z", "blocks.1.mlp.pre", "blocks.1.mlp.post",
                 "blocks.0.attn_out", "blocks.1.resid_post", "blocks.1.attn.q",
                 "blocks.0.attn.k", "blocks.0.attn.pattern"):
        close(tapped.taps[name], want[name], name)
    sh = sharding_of(tapped, "blocks.0.attn.z")
    assert sh.gathered and sh.dim == 2 and sh.ranks == WORLD, sh
    edited, _ = reference(full, x, EDITS)
    per_call = {k: functools.partial(lambda f, s, v: f(v), f) for k, f in EDITS.items()}
    with torch.no_grad(), tapped.intervene(per_call):
        close(tapped(x).logits, edited, "intervene on gathered values")
    with torch.no_grad():
        out, cache = tapped.run_with_cache(x, names=["blocks.*.mlp.pre", "blocks.0.attn.z"])
    close(out.logits, logits, "run_with_cache")
    close(cache["blocks.1.mlp.pre"], want["blocks.1.mlp.pre"], "cache of mlp.pre")
    close(cache["blocks.0.attn.z"], want["blocks.0.attn.z"], "cache of attn.z")


@scenario
def fn_on_gathered_values(rank: int, path: Path) -> None:
    """tap(fn=) with gather=True edits the whole value: the logits of the same edit by hooks
    on the whole model, at every call."""
    full = whole(path)

    def fn(site: fxprobe.Site, v: torch.Tensor) -> torch.Tensor:
        hit = [c for c in site.canonical if c in EDITS]
        return EDITS[hit[0]](v) if hit else v

    tapped = fxprobe.tap(sharded(path), ops=list(EDITS), tracer="dynamo", gather=True, fn=fn)
    for _ in range(2):
        edited, want = reference(full, ids(7), EDITS)
        with torch.no_grad():
            close(tapped(ids(7)).logits, edited, "fn= on gathered values")
        close(tapped.taps["blocks.0.attn.z"], want["blocks.0.attn.z"], "the value kept")


def torch_plan(model: nn.Module, **colwise: Any) -> nn.Module:
    """``model`` split by torch's own plans: q/k/v, gate and up by output features, o_proj and
    down_proj by input features."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )
    mesh = init_device_mesh("cpu", (WORLD,))
    plan: dict[str, Any] = {}
    for i in range(len(model.model.layers)):
        pre = f"model.layers.{i}."
        for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj",
                  "mlp.up_proj"):
            plan[pre + m] = ColwiseParallel(**colwise)
        for m in ("self_attn.o_proj", "mlp.down_proj"):
            plan[pre + m] = RowwiseParallel()
    return parallelize_module(model, mesh, plan)


@scenario
def torch_parallel_plans(rank: int, path: Path) -> None:
    """parallelize_module with ColwiseParallel/RowwiseParallel: each module's value is the
    rank's part its record names (the projections split by output features, the activation
    after them) or the whole value (the row-parallel projections, reduced; the layers), read
    against hooks on the whole model; the stream's canonical names too, and the logits."""
    full = whole(path)
    model = torch_plan(whole(path))
    x = ids(6)
    got: dict[str, torch.Tensor] = {}
    names = {"self_attn.q_proj": 2, "mlp.act_fn": 2, "mlp.up_proj": 2, "self_attn.o_proj": None,
             "mlp.down_proj": None, "": None}
    def keep(name: str) -> Callable[..., None]:
        def hook(mod: nn.Module, args: tuple, out: Any) -> None:
            got[name] = (out[0] if isinstance(out, tuple) else out).clone()
        return hook

    paths = [f"model.layers.{i}.{m}".rstrip(".") for i in range(2) for m in names]
    handles = [full.get_submodule(p).register_forward_hook(keep(p)) for p in paths]
    logits, want = reference(full, x)
    for h in handles:
        h.remove()
    tapped = fxprobe.tap(model, ops=["model.layers.*", "blocks.*.resid_post"], tracer="dynamo")
    with torch.no_grad():
        close(tapped(x).logits, logits, "logits")
    for i in range(2):
        for m, dim in names.items():
            name = f"model.layers.{i}.{m}".rstrip(".")
            sh = sharding_of(tapped, name)
            assert (sh.dim if sh is not None else None) == dim, (name, sh)
            ref = got[name] if sh is None else part(got[name], sh, rank)
            close(tapped.taps[name], ref, name)
        close(tapped.taps[f"blocks.{i}.resid_post"], want[f"blocks.{i}.resid_post"], "resid")


class Scores(nn.Module):
    """A colwise projection whose parts are then mixed by a product fxprobe does not follow."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 16, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        return torch.cumsum(h, dim=-1)


@scenario
def a_part_fxprobe_cannot_follow_is_said(rank: int, path: Path) -> None:
    """A value computed from a part by an op whose split fxprobe cannot follow: a warning
    naming the module, a record that says so, the rank's own value kept (never gathered
    as if it were a known part); the part before it is still known and gathered."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
    torch.manual_seed(0)
    model = parallelize_module(Scores(), init_device_mesh("cpu", (WORLD,)),
                               {"proj": ColwiseParallel()})
    x = torch.randn(3, 8)
    for tracer in ("auto", "hooks"):  # tracers that do not follow the parts say so at tap()
        with pytest.warns(ShardingWarning, match=r"DTensor parameters, the first in proj.*"
                          r"pass tracer='dynamo'"):
            fxprobe.tap(model, tracer=tracer)
    for gather in (False, True):
        tapped = fxprobe.tap(model, tracer="dynamo", gather=gather)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            with torch.no_grad():
                out = tapped(x)
        said = [str(w.message) for w in seen if issubclass(w.category, ShardingWarning)]
        assert len(said) == 1 and "cumsum" in said[0] and "understood" in said[0], said
        sh = sharding_of(tapped, "cumsum")
        assert sh is not None and not sh.understood and not sh.gathered, sh
        close(tapped.taps["cumsum"], out, "the rank's own value")
        proj = sharding_of(tapped, "proj")
        assert proj is not None and proj.dim == 1 and proj.gathered == gather, proj
        assert tapped.taps["proj"].shape == (3, 16 if gather else 8)


# ---------------------------------------------------------------------------- the job
def prepare(tmp: Path) -> Path:
    """Before the ranks start (tests/gloo_job.py): the model every scenario loads."""
    save(tmp / "llama")
    return tmp / "llama"


@pytest.fixture(scope="module")
def gloo_verdicts(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    return verdicts(request.config, "test_tensor_parallel")


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_on_two_gloo_ranks(gloo_verdicts: list[dict[str, Any]], name: str) -> None:
    assert_ok(gloo_verdicts, name)


def test_gather_is_a_flag_and_artifacts_refuse_it() -> None:
    with pytest.raises(fxprobe.ConfigError, match="gather"):
        fxprobe.tap(nn.Linear(2, 2), gather="yes")  # type: ignore[arg-type]
    scripted = torch.jit.script(nn.Linear(2, 2))
    with pytest.raises(fxprobe.ConfigError, match="gather=True is not supported"):
        fxprobe.tap(scripted, gather=True)


def test_a_model_without_tensor_parallelism_has_no_sharding() -> None:
    tapped = fxprobe.tap(nn.Sequential(nn.Linear(2, 3), nn.ReLU()), tracer="dynamo",
                         gather=True)
    tapped(torch.ones(1, 2))
    assert tapped.sites and all(s.sharding is None for s in tapped.sites)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
