"""Training under torch.distributed with taps (DDP of a tapped model, a tapped DDP, FSDP2 before
and after tap, an FSDP2 transformer), for tests/test_dist.py, and the models they train."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from reference import hook_values, same
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import fxprobe

WORLD = 2  # the ranks' timeouts: tests/gloo_job.py



def hook_targets(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(n, m) for n, m in model.named_modules() if n]

class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x)) * self.scale


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def net() -> Net:
    torch.manual_seed(0)
    return Net()


def batch(rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(3 + 2 * rank, 8, generator=g)  # ranks see different batch sizes


def train(model: nn.Module, rank: int, steps: int = 3) -> list[list[torch.Tensor]]:
    """SGD steps on this rank's batches; the full parameters after each step."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    states = []
    for step in range(steps):
        model(batch(rank, step)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        states.append([p.full_tensor() if hasattr(p, "full_tensor") else p.detach().clone()
                       for p in model.parameters()])
    return states


# -- scenarios (run on every rank) ----------------------------------------------------------

def ddp_of_tapped(rank: int, tmp: Path) -> None:
    tapped = fxprobe.tap(net(), ops=["blocks.*.relu", "head"])
    got = train(DDP(tapped), rank)
    want = train(DDP(net()), rank)
    assert all(same(a, b) for a, b in zip(got, want, strict=True)), "parameters differ"
    # Each rank's taps are its own values: eager hooks on this rank's last batch.
    model = net()
    with torch.no_grad():
        for p, q in zip(model.parameters(), tapped.parameters(), strict=True):
            p.copy_(q)
        tapped(batch(rank, 9))
        _, ref = hook_values(model, ["head"], batch(rank, 9))
    assert torch.equal(tapped.taps["head"], ref["head"])
    assert tapped.taps["blocks.0.relu"].shape[0] == 3 + 2 * rank


def tap_of_ddp(rank: int, tmp: Path) -> None:
    ddp = DDP(net())
    tapped = fxprobe.tap(ddp, ops="module.head")
    got = train(tapped, rank)
    want = train(DDP(net()), rank)
    assert all(same(a, b) for a, b in zip(got, want, strict=True)), "parameters differ"
    assert tapped.taps["module.head"].shape == (3 + 2 * rank, 2)


def fsdp2(rank: int, tmp: Path) -> None:
    from torch.distributed.fsdp import fully_shard

    def sharded(kw: dict[str, Any] | None) -> nn.Module:
        model: nn.Module = fxprobe.tap(net(), **kw) if kw is not None else net()
        for block in model.blocks:  # type: ignore[union-attr]
            fully_shard(block)
        fully_shard(model)
        return model

    want = train(sharded(None), rank)
    for kw in ({"leaf_modules": [Block]}, {"tracer": "hooks"}, {}):
        model = sharded(kw)
        # fully_shard after tap() hooks blocks fxprobe had traced through: with nothing
        # said, it notices and traces again, each block a region of its own that is called
        # as a module (so FSDP's unshard hook runs), its ops still sites.
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = train(model, rank)
        assert all(same(a, b) for a, b in zip(got, want, strict=True)), f"{kw}: params differ"
        assert model.taps["blocks.1"].shape == (3 + 2 * rank, 8)  # type: ignore[operator]
        if not kw:
            assert any("traced again" in str(w.message) for w in caught)
            assert same(model.taps["blocks.1.mul"], model.taps["blocks.1"])  # type: ignore


def fsdp2_then_tap(rank: int, tmp: Path) -> None:
    """A model fully_shard-ed first, then tapped, under every tracer: site names as on the
    unsharded model, values as hooks on an unsharded copy see them, training as untapped."""
    from torch.distributed.fsdp import fully_shard

    def sharded() -> nn.Module:
        model = net()
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        return model

    x = batch(rank, 9)
    untapped = sharded()
    with torch.no_grad():
        untapped(x)
    want = train(untapped, rank)
    for tracer in ("auto", "dynamo", "hooks"):
        plain = fxprobe.tap(net(), tracer=tracer)
        plain(x)
        model = sharded()
        tapped = fxprobe.tap(model, tracer=tracer)
        with torch.no_grad():
            tapped(x)
        # Under dynamo each block's graph is told apart by its parameters, which FSDP2
        # swaps for unsharded ones during the forward: blocks.1's values once came out
        # named blocks.0.lin_1, blocks.0.relu_1...
        # The ops' names (a sharded block, a module with FSDP's hooks, is a region of its
        # own under fx: its input, its call and its attributes are named as such).
        def ops(t: Any) -> list[str]:
            return [s.name for s in t.sites if s.kind not in ("placeholder", "get_attr")
                    and s.name not in ("blocks.0", "blocks.1")]

        names, known = ops(tapped), ops(plain)
        if tracer == "dynamo":  # dynamo runs the sharded root's own code as written: no head
            known = [n for n in known if n.startswith("blocks.")]
        assert names == known, (tracer, names)
        shown = [n for n in names if n in dict(hook_targets(net()))]
        _, ref = hook_values(net(), shown, x)
        for n in shown:
            assert same(tapped.taps[n], ref[n]), (tracer, n)
        got = train(tapped, rank)
        assert all(same(a, b) for a, b in zip(got, want, strict=True)), f"{tracer}: params"


def fsdp2_transformer(rank: int, tmp: Path) -> None:
    """A Hugging Face model sharded per block, then tapped (dynamo, under tracer="auto"):
    each block's values under its own name, equal to hooks on an unsharded copy."""
    from torch.distributed.fsdp import fully_shard

    tf = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = tf.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=64)
    model, ref = tf.GPT2LMHeadModel(config).eval(), tf.GPT2LMHeadModel(config).eval()
    ref.load_state_dict(model.state_dict())
    for block in model.transformer.h:
        fully_shard(block)
    fully_shard(model)
    ids = torch.randint(0, 100, (2, 6), generator=torch.Generator().manual_seed(rank))
    names = [f"transformer.h.{i}.mlp.c_fc" for i in range(2)] + ["lm_head"]
    tapped = fxprobe.tap(model, ops=names)
    with torch.no_grad():
        out = tapped(ids)
        _, seen = hook_values(ref, names, ids)
        want = ref(ids)
    assert torch.allclose(out.logits, want.logits, atol=1e-6)
    assert sorted(tapped.taps) == sorted(names)
    for n in names:
        assert torch.allclose(tapped.taps[n], seen[n], atol=1e-6), n


