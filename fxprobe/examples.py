"""Small built-in models for ``fxprobe demo``, the docs and the command line.

Each factory builds a seeded model in eval mode, so pictures and tables are reproducible, and
is usable as a ``MODEL`` spec: ``fxprobe graph fxprobe.examples:small_cnn --input 1x3x32x32``.
"""

from __future__ import annotations

import torch
from torch import nn


class ResidualBlock(nn.Module):
    """Two 3x3 convolutions with a skip connection, as in ResNet."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + x)


class EarlyExitHead(nn.Module):
    """A classifier head that skips its second layer when the first is confident.

    The ``if`` on a tensor value is what ``torch.fx`` cannot trace: fxprobe runs this module as
    written and reaches its layers by hooks.
    """

    def __init__(self, features: int, classes: int, threshold: float = 0.5) -> None:
        super().__init__()
        self.quick = nn.Linear(features, classes)
        self.refine = nn.Sequential(nn.Linear(classes, classes), nn.Tanh())
        self.threshold = threshold

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.quick(x)
        if logits.softmax(-1).max() > self.threshold:
            return logits
        return self.refine(logits)


class SmallCNN(nn.Module):
    """A tiny image classifier: stem, one residual block, pooling, an early-exit head."""

    def __init__(self, classes: int = 10, width: int = 8) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(inplace=True),
        )
        self.block = ResidualBlock(width)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = EarlyExitHead(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.block(self.stem(x))
        x = torch.flatten(self.pool(x), 1)
        return self.head(x)


class GatedMLP(nn.Module):
    """A tiny MLP whose middle module routes on a tensor value (not traceable by fx)."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.embed = nn.Linear(dim, dim)
        self.gate = Router(dim)
        self.out = nn.Linear(dim, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.gate(self.embed(x))))


class Router(nn.Module):
    """Sends the batch through one of two experts depending on the sign of its mean."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, dim)
        self.down = nn.Sequential(nn.Linear(dim, dim), nn.Sigmoid())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.mean() > 0:
            return self.up(x)
        return self.down(x)


def small_cnn() -> SmallCNN:
    """The demo model (seeded, eval mode); its example input is ``small_cnn_input()``."""
    torch.manual_seed(0)
    return SmallCNN().eval()


def small_cnn_input() -> torch.Tensor:
    """A seeded batch of two 3x32x32 images for :func:`small_cnn`."""
    return torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))


def gated_mlp() -> GatedMLP:
    """A tiny model with an untraceable submodule (seeded, eval mode); input ``Nx8``."""
    torch.manual_seed(0)
    return GatedMLP().eval()
