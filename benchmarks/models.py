"""The benchmark models, written here so that the suite needs nothing beyond torch.

Each model stands for a workload with a different ratio of host work to device work:

- ``chain``: 100 blocks of ``Linear(16, 16)`` + ``ReLU``: 200 module calls of almost no
  arithmetic. Launch-bound; its overhead is the host cost per site.
- ``resnet50``: the ResNet-50 layout (bottlenecks ``[3, 4, 6, 3]``, widths 64..2048, one
  ``ReLU(inplace=True)`` shared by the three calls of a block, ``out += identity``), 1000 classes.
- ``gpt2``: the GPT-2 small layout (12 pre-norm blocks, d=768, 12 heads, MLP 3072, learned
  positions, vocabulary 50257, tied output head), attention written with functional ops.
- ``mlp``: a small MLP for CPU (784-512-512-256-10) with functional GELUs between its layers.

A :class:`Workload` pairs a model with its inputs; ``quick`` shrinks the inputs (image side,
sequence length), never the architecture, so that sites and per-site costs keep their meaning.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class Chain(nn.Module):
    """``depth`` tiny ``Linear`` + ``ReLU`` blocks: the host cost of every call shows."""

    def __init__(self, depth: int = 100, width: int = 16) -> None:
        super().__init__()
        self.layers = nn.ModuleList()
        for _ in range(depth):
            linear = nn.Linear(width, width)
            # Near-identity weights and a small positive bias keep the activations O(1): with the
            # default init they shrink layer by layer into denormals, which are slow on CPUs.
            with torch.no_grad():
                linear.weight.copy_(torch.eye(width) + 0.01 * torch.randn(width, width))
                linear.bias.uniform_(0.0, 0.1)
            self.layers.append(linear)
            self.layers.append(nn.ReLU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class Bottleneck(nn.Module):
    """torchvision's ResNet-50 bottleneck: one in-place ReLU module called three times."""

    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1,
                 downsample: nn.Module | None = None) -> None:
        super().__init__()
        width = planes
        self.conv1 = nn.Conv2d(inplanes, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, planes * self.expansion, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        return self.relu(out)


class ResNet50(nn.Module):
    """The ResNet-50 layout (25.6 M parameters at ``width=64``), without torchvision."""

    def __init__(self, layers: tuple[int, ...] = (3, 4, 6, 3), num_classes: int = 1000,
                 width: int = 64) -> None:
        super().__init__()
        self.inplanes = width
        self.conv1 = nn.Conv2d(3, width, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        self.layer1 = self._make_layer(width, layers[0])
        self.layer2 = self._make_layer(width * 2, layers[1], stride=2)
        self.layer3 = self._make_layer(width * 4, layers[2], stride=2)
        self.layer4 = self._make_layer(width * 8, layers[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(width * 8 * Bottleneck.expansion, num_classes)

    def _make_layer(self, planes: int, blocks: int, stride: int = 1) -> nn.Sequential:
        downsample = None
        if stride != 1 or self.inplanes != planes * Bottleneck.expansion:
            downsample = nn.Sequential(
                nn.Conv2d(self.inplanes, planes * Bottleneck.expansion, 1, stride=stride,
                          bias=False),
                nn.BatchNorm2d(planes * Bottleneck.expansion),
            )
        mods = [Bottleneck(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes * Bottleneck.expansion
        mods += [Bottleneck(self.inplanes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*mods)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        x = torch.flatten(self.avgpool(x), 1)
        return self.fc(x)


class CausalSelfAttention(nn.Module):
    """GPT-2 attention with explicit functional ops (matmul, mask, softmax): tap-only sites."""

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.scale = 1.0 / math.sqrt(d_model // n_heads)
        self.c_attn = nn.Linear(d_model, 3 * d_model)
        self.c_proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Sizes read one by one (not unpacked) so that torch.fx can trace the block.
        b, t, c = x.size(0), x.size(1), x.size(2)
        q, k, v = self.c_attn(x).split(c, dim=2)
        h = self.n_heads
        q = q.view(b, t, h, c // h).transpose(1, 2)
        k = k.view(b, t, h, c // h).transpose(1, 2)
        v = v.view(b, t, h, c // h).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * self.scale
        # The causal mask is built from the traced size: slicing a stored buffer with a traced
        # size would make torch.fx give up on the block.
        mask = x.new_ones(t, t, dtype=torch.bool).tril()
        att = att.masked_fill(~mask, float("-inf"))
        att = F.softmax(att, dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(b, t, c)
        return self.c_proj(y)


class GPT2Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads)
        self.ln_2 = nn.LayerNorm(d_model)
        self.c_fc = nn.Linear(d_model, 4 * d_model)
        self.act = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.c_proj(self.act(self.c_fc(self.ln_2(x))))


class GPT2(nn.Module):
    """The GPT-2 small layout (124 M parameters with the tied head)."""

    def __init__(self, vocab: int = 50257, max_len: int = 1024, d_model: int = 768,
                 n_heads: int = 12, n_layers: int = 12) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, d_model)
        self.wpe = nn.Embedding(max_len, d_model)
        self.h = nn.ModuleList(GPT2Block(d_model, n_heads) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(ids.shape[1], device=ids.device)
        x = self.wte(ids) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


class MLP(nn.Module):
    """A small classifier MLP; its activations are functional calls, reachable only by taps."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(784, 512)
        self.fc2 = nn.Linear(512, 512)
        self.fc3 = nn.Linear(512, 256)
        self.fc4 = nn.Linear(256, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.gelu(self.fc1(x))
        x = F.gelu(self.fc2(x))
        x = F.gelu(self.fc3(x))
        return self.fc4(x)


@dataclass(frozen=True)
class ModelSpec:
    """How to build one benchmark model and its inputs."""

    name: str
    """Short name used on the command line and in the results (``resnet50``)."""
    description: str
    """What the model stands for, one line."""
    build: Callable[[], nn.Module]
    """Returns the model, freshly initialised (call under ``torch.manual_seed``)."""
    make_input: Callable[[int, bool, torch.device], tuple[Any, ...]]
    """``(batch, quick, device)`` -> positional inputs."""
    shape: Callable[[bool], str]
    """``quick`` -> a description of the input shape per example, for the records."""
    batches: dict[str, tuple[int, ...]]
    """Batch sizes per device type (``"cpu"``, ``"cuda"``), full run: 1 and a filling one."""
    quick_batches: tuple[int, ...] = (1,)
    """Batch sizes in ``--quick`` runs."""


def _image(side_full: int, side_quick: int) -> Callable[[int, bool, torch.device], tuple[Any, ...]]:
    def make(batch: int, quick: bool, device: torch.device) -> tuple[Any, ...]:
        side = side_quick if quick else side_full
        return (torch.randn(batch, 3, side, side, device=device),)
    return make


def _tokens(len_full: int, len_quick: int) -> Callable[[int, bool, torch.device], tuple[Any, ...]]:
    def make(batch: int, quick: bool, device: torch.device) -> tuple[Any, ...]:
        t = len_quick if quick else len_full
        return (torch.randint(0, 50257, (batch, t), device=device),)
    return make


def _vector(width: int) -> Callable[[int, bool, torch.device], tuple[Any, ...]]:
    def make(batch: int, quick: bool, device: torch.device) -> tuple[Any, ...]:
        return (torch.randn(batch, width, device=device),)
    return make


MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            "chain", "100 x (Linear(16,16) + ReLU): launch-bound, 200 module calls",
            Chain, _vector(16), lambda quick: "16 features",
            {"cpu": (1, 64), "cuda": (1, 4096)},
        ),
        ModelSpec(
            "mlp", "MLP 784-512-512-256-10 with functional GELU: small CPU model",
            MLP, _vector(784), lambda quick: "784 features",
            {"cpu": (1, 64), "cuda": (1, 8192)},
        ),
        ModelSpec(
            "resnet50", "ResNet-50 layout, in-place ReLU shared per block, 25.6 M params",
            ResNet50, _image(224, 64), lambda quick: f"3x{64 if quick else 224}^2 image",
            {"cpu": (1, 4), "cuda": (1, 128)},
        ),
        ModelSpec(
            "gpt2", "GPT-2 small layout (12 x d768, 12 heads), functional attention",
            GPT2, _tokens(64, 16), lambda quick: f"{16 if quick else 64} tokens",
            {"cpu": (1, 4), "cuda": (1, 32)},
        ),
    )
}
