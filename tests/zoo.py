"""Tiny PyTorch models standing in for real model families, used by the fxprobe test-suite.

Every model is small (a CPU forward takes a few milliseconds), deterministic to build
under ``torch.manual_seed`` and written from scratch. Each class exposes a static
``example_input()`` returning a tuple of positional args; ``MultiIO`` also has
``example_kwargs()``. Use :func:`make` to get a seeded model in eval mode plus inputs.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

# ---------------------------------------------------------------------------
# 1. ResNet-style CNN
# ---------------------------------------------------------------------------


class BasicBlock(nn.Module):
    """ResNet basic residual block (two 3x3 convs, optional downsample)."""

    def __init__(
        self,
        inplanes: int,
        planes: int,
        stride: int = 1,
        downsample: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x
        out = self.conv1(x)
        out = self.bn1(out)
        out = self.relu(out)
        out = self.bn2(self.conv2(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        out = self.relu(out)
        return out


class ResNetish(nn.Module):
    """Stands for the ResNet family (torchvision resnet18-style CNN)."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, kernel_size=3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.layer1 = nn.Sequential(BasicBlock(8, 8), BasicBlock(8, 8))
        downsample = nn.Sequential(
            nn.Conv2d(8, 16, kernel_size=1, stride=2, bias=False),
            nn.BatchNorm2d(16),
        )
        self.layer2 = nn.Sequential(
            BasicBlock(8, 16, stride=2, downsample=downsample),
            BasicBlock(16, 16),
        )
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(16, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv1(x)
        x = self.bn1(x)
        x = self.relu(x)
        x = self.maxpool(x)
        x = self.layer1(x)
        x = self.layer2(x)
        x = self.avgpool(x)
        x = torch.flatten(x, 1)
        x = self.fc(x)
        return x

    @staticmethod
    def example_input() -> tuple[torch.Tensor, ...]:
        return (torch.randn(2, 3, 16, 16),)


# ---------------------------------------------------------------------------
# 2. Transformer encoder block
# ---------------------------------------------------------------------------


class SelfAttention(nn.Module):
    """Hand-written multi-head self-attention (ViT/BERT style)."""

    def __init__(self, d_model: int = 16, n_heads: int = 2) -> None:
        super().__init__()
        assert d_model % n_heads == 0
        self.n_heads = n_heads
        self.head_dim = d_model // n_heads
        self.scale = 1.0 / math.sqrt(self.head_dim)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        qkv = self.qkv(x).view(B, T, 3, self.n_heads, self.head_dim)
        qkv = qkv.permute(2, 0, 3, 1, 4)  # (3, B, H, T, hd)
        q, k, v = qkv[0], qkv[1], qkv[2]
        att = torch.matmul(q, k.transpose(-2, -1)) * self.scale
        att = F.softmax(att, dim=-1)
        out = att @ v  # (B, H, T, hd)
        out = out.transpose(1, 2).reshape(B, T, C)
        return self.proj(out)


class EncoderBlock(nn.Module):
    """Stands for a pre-norm transformer encoder block (ViT / BERT family)."""

    def __init__(self, d_model: int = 16, n_heads: int = 2, mlp_ratio: int = 2) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(d_model)
        self.attn = SelfAttention(d_model, n_heads)
        self.norm2 = nn.LayerNorm(d_model)
        self.fc1 = nn.Linear(d_model, d_model * mlp_ratio)
        self.fc2 = nn.Linear(d_model * mlp_ratio, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        x = x + self.fc2(F.gelu(self.fc1(self.norm2(x))))
        return x

    @staticmethod
    def example_input() -> tuple[torch.Tensor, ...]:
        return (torch.randn(2, 5, 16),)


# ---------------------------------------------------------------------------
# 3. LSTM sequence tagger
# ---------------------------------------------------------------------------


class LSTMTagger(nn.Module):
    """Stands for recurrent sequence models (embedding + LSTM tagger); tuple output."""

    def __init__(self, vocab: int = 20, emb: int = 8, hidden: int = 12, tags: int = 5) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, emb)
        self.lstm = nn.LSTM(emb, hidden, batch_first=True)
        self.head = nn.Linear(hidden, tags)

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        e = self.embed(ids)
        out, (h, c) = self.lstm(e)
        logits = self.head(out)
        return logits, h

    @staticmethod
    def example_input() -> tuple[torch.Tensor, ...]:
        return (torch.randint(0, 20, (2, 6), dtype=torch.long),)


# ---------------------------------------------------------------------------
# 4. Data-dependent control flow inside a submodule
# ---------------------------------------------------------------------------


class Gate(nn.Module):
    """Submodule with data-dependent control flow: not fx-traceable."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.pos = nn.Linear(dim, dim)
        self.neg = nn.Sequential(nn.Linear(dim, dim), nn.Tanh())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return self.pos(x)
        else:
            return self.neg(x)


class DataDependent(nn.Module):
    """Stands for models with dynamic routing (e.g. MoE / early-exit gates) in a submodule."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(8, 8)
        self.gate = Gate(8)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        h = self.gate(h)
        return torch.relu(self.head(h))

    @staticmethod
    def example_input() -> tuple[torch.Tensor, ...]:
        return (torch.randn(3, 8),)


# ---------------------------------------------------------------------------
# 5. Untraceable top level with traceable children
# ---------------------------------------------------------------------------


class Residual(nn.Module):
    """Tiny traceable residual MLP block."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.relu(self.lin(x))


class UntraceableTop(nn.Module):
    """Stands for models whose top-level forward is dynamic (e.g. HF generate-style wrappers)
    while their building blocks are traceable."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(dim, dim), nn.ReLU(), nn.Linear(dim, dim))
        self.blocks = nn.ModuleList([Residual(dim), Residual(dim)])
        self.norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.enc(x)
        for blk in self.blocks:
            h = blk(h)
        # Data-dependent branch on a tensor value: symbolic_trace cannot handle this.
        if h.mean() > 0:
            h = self.norm(h)
        else:
            h = self.norm(-h)
        return h

    @staticmethod
    def example_input() -> tuple[torch.Tensor, ...]:
        return (torch.randn(4, 8),)


# ---------------------------------------------------------------------------
# 6. Shared (re-used) module
# ---------------------------------------------------------------------------


class SharedWeights(nn.Module):
    """Stands for weight-tied / recurrently applied layers (one module called twice)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.out = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.fc(F.relu(self.fc(x))))

    @staticmethod
    def example_input() -> tuple[torch.Tensor, ...]:
        return (torch.randn(3, 6),)


# ---------------------------------------------------------------------------
# 7. Multiple inputs / kwargs / dict output
# ---------------------------------------------------------------------------


class MultiIO(nn.Module):
    """Stands for multi-input models with keyword args and dict outputs (e.g. HF-style)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(
        self, x: torch.Tensor, y: torch.Tensor, scale: float = 2.0
    ) -> dict[str, torch.Tensor]:
        return {
            "sum": self.a(x) + self.b(y) * scale,
            "prod": self.a(x) * y,
        }

    @staticmethod
    def example_input() -> tuple[torch.Tensor, ...]:
        return (torch.randn(2, 4), torch.randn(2, 4))

    @staticmethod
    def example_kwargs() -> dict[str, Any]:
        return {"scale": 0.5}


# ---------------------------------------------------------------------------
# 8. Train/eval dependent forward
# ---------------------------------------------------------------------------


class TrainEvalBranch(nn.Module):
    """Stands for models whose graph differs between train and eval (dropout/aux paths)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 8)
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            h = F.dropout(self.fc1(x), p=0.5, training=True)
            h = F.relu(h) + 1.0
        else:
            h = torch.sigmoid(self.fc1(x))
        return self.fc2(h)

    @staticmethod
    def example_input() -> tuple[torch.Tensor, ...]:
        return (torch.randn(2, 8),)


# ---------------------------------------------------------------------------
# 9. In-place operation hazards
# ---------------------------------------------------------------------------


class InplaceZoo(nn.Module):
    """Stands for code with in-place ops and aliasing views (common in older CNN code)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)
        self.act = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = self.act(self.bn(self.lin(x)))  # in-place module on bn output
        y = x2 * 2
        y.relu_()  # in-place tensor method
        z = y.view(-1)  # alias of y
        y.add_(1.0)  # mutates z's storage through the alias
        h = torch.sigmoid(z)
        h2 = F.relu(h, inplace=True)  # functional in-place
        out = torch.add(h2, 1)
        return out.reshape(-1, 8)

    @staticmethod
    def example_input() -> tuple[torch.Tensor, ...]:
        return (torch.randn(4, 8),)


# ---------------------------------------------------------------------------
# Registry / factory
# ---------------------------------------------------------------------------

ALL_MODELS: dict[str, type[nn.Module]] = {
    "resnet": ResNetish,
    "encoder": EncoderBlock,
    "lstm": LSTMTagger,
    "data_dependent": DataDependent,
    "untraceable_top": UntraceableTop,
    "shared": SharedWeights,
    "multi_io": MultiIO,
    "train_eval": TrainEvalBranch,
    "inplace": InplaceZoo,
}

_BN_TYPES = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


def _has_batchnorm(model: nn.Module) -> bool:
    return any(isinstance(m, _BN_TYPES) for m in model.modules())


def make(name: str, seed: int = 0) -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]]:
    """Build zoo model ``name`` deterministically and return ``(model, args, kwargs)``.

    The model is returned in eval mode. Models containing BatchNorm get two warm-up
    forward passes in train mode (under ``no_grad``) so their running stats are
    non-trivial.
    """
    cls = ALL_MODELS[name]
    torch.manual_seed(seed)
    model = cls()
    if _has_batchnorm(model):
        model.train()
        with torch.no_grad():
            for _ in range(2):
                model(*cls.example_input())  # type: ignore[attr-defined]
    model.eval()
    args = tuple(cls.example_input())  # type: ignore[attr-defined]
    example_kwargs = getattr(cls, "example_kwargs", None)
    kwargs: dict[str, Any] = dict(example_kwargs()) if example_kwargs is not None else {}
    return model, args, kwargs
