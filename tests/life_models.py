"""The models of the stateful test (tests/test_life.py) and where each value lives in them.

Each :class:`Spec` says how to build a model, which inputs it takes, how it is tapped, and,
for every name the test reads or edits, the *point* of the untapped model that holds the same
value: ``(module path, "in" or "out", call index)``, reached by a forward (pre-)hook. Names of
one value (``blocks.0.resid_post`` and ``blocks.1.resid_pre``; ``lm_head`` and ``logits``)
share one point, so edits on either compose as they do on fxprobe's one site. Names with no
module around them (``attn.q``, ``attn.scores``) have no point: the test checks that they are
present and that one input always gives one value (``Spec.opaque``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

Point = tuple[str, str, int]  # (module path, "in" | "out", call index within one forward)


@dataclass(frozen=True)
class Spec:
    """One model of the test, tapped one way."""

    name: str
    build: Callable[[], nn.Module]
    """The untapped model, in eval mode, with fixed weights."""
    tracer: str
    ops: Any
    """The selection of ``fxprobe.tap(ops=...)``."""
    points: dict[str, Point]
    """Every name with a hook reference, and where its value is in the untapped model."""
    taps: tuple[str, ...]
    """The names every plain forward must capture (selected by ``ops``)."""
    edits: tuple[str, ...]
    """Selectors ``intervene`` may edit (names or globs over ``points``)."""
    selectors: tuple[Any, ...]
    """Selectors of ``run_with_cache`` (``None``: every site)."""
    shapes: tuple[tuple[int, ...], ...]
    """Input shapes (token ids: (batch, positions); images: (batch, C, H, W))."""
    opaque: tuple[str, ...] = ()
    """Names with no module around them (see the module docstring)."""
    per_call: frozenset[str] | None = None
    """The names per-call runs reach (dynamo's sites), where not all of them."""
    tokens: bool = False
    """Inputs are token ids of a Hugging Face causal LM (``generate()`` too)."""
    dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.float64)
    z_heads: tuple[int, int] | None = None
    """(heads, head dim) of ``attn.z``, documented as (batch, positions, heads, head dim)."""

    def reach(self, name: str) -> bool:
        return self.per_call is None or name in self.per_call


def _tokens() -> dict[str, Any]:
    return dict(vocab_size=100, bos_token_id=0, eos_token_id=0, pad_token_id=0)


def gpt2() -> nn.Module:
    import transformers as tf
    config = tf.GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=64, resid_pdrop=0.0,
                           embd_pdrop=0.0, attn_pdrop=0.0, **_tokens())
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return tf.GPT2LMHeadModel(config).eval()


def llama() -> nn.Module:
    import transformers as tf
    config = tf.LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2,
                            num_key_value_heads=1, intermediate_size=64,
                            max_position_embeddings=64, **_tokens())
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return tf.LlamaForCausalLM(config).eval()


def _transformer_points(block: str, attn: str, z: str, mid: str, act: str, down: str,
                        mlp: str, norm: str, embed: str, head: str) -> dict[str, Point]:
    points: dict[str, Point] = {"embed": (embed, "out", 0), "ln_final": (norm, "out", 0),
                                "logits": (head, "out", 0)}
    for L in range(2):
        b = block.format(L=L)
        points.update({
            f"blocks.{L}.resid_pre": (block.format(L=L - 1), "out", 0) if L else (b, "in", 0),
            f"blocks.{L}.resid_post": (b, "out", 0),
            f"blocks.{L}.attn_out": (f"{b}.{attn}", "out", 0),
            f"blocks.{L}.attn.z": (f"{b}.{z}", "in", 0),
            f"blocks.{L}.resid_mid": (f"{b}.{mid}", "in", 0),
            f"blocks.{L}.mlp.pre": (f"{b}.{act}", "in", 0),
            f"blocks.{L}.mlp.post": (f"{b}.{down}", "in", 0),
            f"blocks.{L}.mlp_out": (f"{b}.{mlp}", "out", 0),
        })
    return points


_GPT2 = _transformer_points("transformer.h.{L}", "attn", "attn.c_proj", "ln_2", "mlp.act",
                            "mlp.c_proj", "mlp", "transformer.ln_f", "transformer.wte",
                            "lm_head")
_GPT2 |= {"pos_embed": ("transformer.wpe", "out", 0), "lm_head": ("lm_head", "out", 0),
          "transformer.h.0": ("transformer.h.0", "out", 0),
          "transformer.h.1.mlp": ("transformer.h.1.mlp", "out", 0)}
_LLAMA = _transformer_points("model.layers.{L}", "self_attn", "self_attn.o_proj",
                             "post_attention_layernorm", "mlp.act_fn", "mlp.down_proj", "mlp",
                             "model.norm", "model.embed_tokens", "lm_head")
_LLAMA |= {"model.layers.0": ("model.layers.0", "out", 0),
           "model.layers.1.mlp": ("model.layers.1.mlp", "out", 0)}
# No module computes these (GPT-2's eager attention calls no attn_dropout module in transformers
# 5): present, and equal for one input and one set of edits at every call.
_OPAQUE = tuple(f"blocks.{L}.attn.{k}" for L in range(2)
                for k in ("q", "k", "v", "scores", "pattern"))
_TOKEN_SHAPES = ((1, 5), (2, 5), (2, 7), (1, 3))
_LM_SELECTORS = ("blocks.0.*", "blocks.1.*", "logits", "blocks.*.attn.z", "blocks.*.mlp.pre",
                 "blocks.*.mlp.post", "blocks.*.resid_post", "blocks.*.attn.q", None)

GPT2 = Spec(
    "gpt2", gpt2, "dynamo",
    ops=["blocks.0.resid_post", "blocks.1.attn.z", "blocks.0.attn.q", "logits",
         "transformer.h.1.mlp"],
    points=_GPT2,
    taps=("blocks.0.resid_post", "blocks.1.attn.z", "blocks.0.attn.q", "logits",
          "transformer.h.1.mlp"),
    edits=("blocks.0.resid_post", "blocks.1.resid_pre", "blocks.1.attn.z", "blocks.0.mlp.pre",
           "blocks.1.mlp.post", "blocks.0.attn_out", "blocks.1.mlp_out", "logits",
           "transformer.h.0", "blocks.*.mlp.post", "ln_final"),
    selectors=(*_LM_SELECTORS, "blocks.*.attn.pattern", ["transformer.h.0", "lm_head"],
               "transformer.h.*.mlp"),
    shapes=_TOKEN_SHAPES, opaque=_OPAQUE, tokens=True, z_heads=(2, 16))

LLAMA = Spec(
    "llama", llama, "auto",
    ops=["blocks.1.resid_post", "blocks.0.attn.z", "blocks.1.mlp.pre", "blocks.0.attn.k",
         "logits"],
    points=_LLAMA,
    taps=("blocks.1.resid_post", "blocks.0.attn.z", "blocks.1.mlp.pre", "blocks.0.attn.k",
          "logits"),
    edits=("blocks.0.resid_post", "blocks.1.attn.z", "blocks.0.mlp.pre", "blocks.1.mlp.post",
           "blocks.0.attn_out", "blocks.1.mlp_out", "logits", "model.layers.0", "ln_final",
           "blocks.*.mlp.pre"),
    selectors=(*_LM_SELECTORS, ["model.layers.0", "lm_head"]),
    shapes=_TOKEN_SHAPES, opaque=_OPAQUE, tokens=True, z_heads=(2, 16))


class BasicBlock(nn.Module):
    """torchvision's BasicBlock: in-place ReLU after BatchNorm, ``out += identity`` (whose
    site dynamo names ``iadd``, where fx names it ``add``)."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += x
        return self.relu(out)


class ResNetLike(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)
        self.relu = nn.ReLU(inplace=True)
        self.layer1 = nn.Sequential(BasicBlock(8), BasicBlock(8))
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layer1(self.relu(self.bn1(self.conv1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet() -> nn.Module:
    torch.manual_seed(0)
    model = ResNetLike()
    for m in model.modules():  # running statistics that are not the identity
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 2.0)
    return model.eval()


_IMAGES = ((1, 3, 8, 8), (2, 3, 8, 8), (2, 3, 8, 12), (3, 3, 12, 8))

RESNET = Spec(
    "resnet", resnet, "dynamo",
    ops=[nn.BatchNorm2d, "layer1.0.iadd", "flatten"],
    points={"conv1": ("conv1", "out", 0), "bn1": ("bn1", "out", 0),
            "layer1.0.bn1": ("layer1.0.bn1", "out", 0),
            "layer1.0.bn2": ("layer1.0.bn2", "out", 0),
            "layer1.1.conv2": ("layer1.1.conv2", "out", 0),
            "layer1.0.iadd": ("layer1.0.relu", "in", 1),
            "layer1.1.iadd": ("layer1.1.relu", "in", 1),
            "layer1.0": ("layer1.0", "out", 0), "flatten": ("fc", "in", 0),
            "fc": ("fc", "out", 0)},
    taps=("bn1", "layer1.0.bn1", "layer1.0.bn2", "layer1.0.iadd", "flatten"),
    edits=("bn1", "layer1.0.bn2", "layer1.1.iadd", "layer1.0", "flatten", "layer1.*.iadd",
           "fc"),
    selectors=(nn.BatchNorm2d, "layer1.*.iadd", "layer1.0", ["fc", "flatten"], nn.Conv2d,
               None),
    shapes=_IMAGES)


class WindowAttention(nn.Module):
    """Attention within 2x2 windows of an NHWC map, as Swin's (without the shift)."""

    def __init__(self, c: int, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.qkv, self.proj = nn.Linear(c, 3 * c), nn.Linear(c, c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, h, w, c = x.shape
        win = x.reshape(b, h // 2, 2, w // 2, 2, c).permute(0, 1, 3, 2, 4, 5).reshape(-1, 4, c)
        q, k, v = self.qkv(win).reshape(-1, 4, 3, self.heads, c // self.heads).permute(
            2, 0, 3, 1, 4).unbind(0)
        out = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(-1, 4, c)
        out = self.proj(out).reshape(b, h // 2, w // 2, 2, 2, c).permute(0, 1, 3, 2, 4, 5)
        return out.reshape(b, h, w, c)


class SwinBlock(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(c), WindowAttention(c)
        self.norm2 = nn.LayerNorm(c)
        self.mlp = nn.Sequential(nn.Linear(c, 2 * c), nn.GELU(), nn.Linear(2 * c, c))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class SwinLike(nn.Module):
    """Patch embedding, then NHWC blocks (channels last, as Swin's), then a pooled head."""

    def __init__(self) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, 16, 2, stride=2)
        self.norm = nn.LayerNorm(16)
        self.stages = nn.ModuleList([SwinBlock(16), SwinBlock(16)])
        self.head = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(self.patch(x).permute(0, 2, 3, 1))
        for stage in self.stages:
            x = stage(x)
        return self.head(x.mean((1, 2)))


def swin() -> nn.Module:
    torch.manual_seed(0)
    return SwinLike().eval()


SWIN = Spec(
    "swin", swin, "dynamo",
    ops=[nn.LayerNorm, "stages.1.mlp.1", "stages.0.attn.proj"],
    points={"norm": ("norm", "out", 0), "stages.0.norm1": ("stages.0.norm1", "out", 0),
            "stages.0.attn.proj": ("stages.0.attn.proj", "out", 0),
            "stages.0.norm2": ("stages.0.norm2", "out", 0),
            "stages.1.norm1": ("stages.1.norm1", "out", 0),
            "stages.1.norm2": ("stages.1.norm2", "out", 0),
            "stages.1.mlp.1": ("stages.1.mlp.1", "out", 0),
            "stages.1.mlp": ("stages.1.mlp", "out", 0),
            "stages.0": ("stages.0", "out", 0), "head": ("head", "out", 0)},
    taps=("norm", "stages.0.norm1", "stages.1.norm2", "stages.1.mlp.1",
          "stages.0.attn.proj"),
    edits=("norm", "stages.1.mlp.1", "stages.0", "stages.*.norm2",
           "stages.0.attn.proj", "head"),
    selectors=(nn.LayerNorm, "stages.0.*", "stages.1.mlp", ["head", "stages.0.attn.proj"],
               nn.Linear, None),
    shapes=((1, 3, 8, 8), (2, 3, 8, 8), (2, 3, 8, 16), (1, 3, 16, 8)))


class Inner(nn.Module):
    """fx cannot trace it (a data-dependent ``if``); dynamo breaks its graph twice."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > -1e9:  # taken for every input here
            x = self.fc(x).relu()
        torch._dynamo.graph_break()
        return self.fc(x)


class Twice(nn.Module):
    """A module dynamo runs as a frame of its own, called twice in one forward."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = Inner()
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.inner(self.inner(x) + 1))


def twice() -> nn.Module:
    torch.manual_seed(0)
    return Twice().eval()


_TWICE = {"inner.fc": ("inner.fc", "out", 0), "inner.fc_1": ("inner.fc", "out", 1),
          "inner.fc_2": ("inner.fc", "out", 2), "inner.fc_3": ("inner.fc", "out", 3),
          "inner.relu": ("inner.fc", "in", 1), "inner.relu_1": ("inner.fc", "in", 3),
          "add": ("inner", "in", 1), "head": ("head", "out", 0)}
# Any rank: (batch dims..., 4); the last entry of a shape is the rank's batch size.
_RANKS = ((3, 4), (4,), (2, 3, 4), (2, 2, 2, 4), (1, 2, 1, 2, 4), (5, 4))


def _twice(tracer: str) -> Spec:
    inner = frozenset(n for n in _TWICE if n.startswith("inner."))
    return Spec(
        f"twice-{tracer}", twice, tracer, ops=[nn.Linear, torch.relu],
        points=_TWICE,
        taps=("inner.fc", "inner.fc_1", "inner.fc_2", "inner.fc_3", "inner.relu",
              "inner.relu_1", "head"),
        edits=("inner.fc", "inner.fc_1", "inner.fc_2", "inner.fc_3", "inner.relu_1",
               "inner.fc_*", *(("add", "head") if tracer == "dynamo" else ())),
        selectors=(nn.Linear, "inner.*", "inner.fc_2", ["inner.relu_1", "inner.fc"], None),
        shapes=_RANKS, per_call=None if tracer == "dynamo" else inner)


TWICE_DYNAMO = _twice("dynamo")
TWICE_AUTO = _twice("auto")
SPECS = {s.name: s for s in (GPT2, LLAMA, RESNET, SWIN, TWICE_DYNAMO, TWICE_AUTO)}
