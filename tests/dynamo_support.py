"""What test_dynamo_auto, test_dynamo, test_dynamo_tied_anchor and test_untapped_sequences
share."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SplitBlock(nn.Module):
    """A residual block (``x + out(relu(fc(x)))``), its frame split by a graph break where
    ``split``: then each block's frame is its own graph, reused for every instance."""

    def __init__(self, split: bool) -> None:
        super().__init__()
        self.fc, self.out, self.split = nn.Linear(8, 8), nn.Linear(8, 8), split

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc(x))
        if self.split:
            torch._dynamo.graph_break()
        return x + self.out(h)


class Attention(nn.Module):
    """timm's ``Attention`` with ``fused_attn=True``."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.head_dim = dim // heads
        self.scale = self.head_dim ** -0.5
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        x = F.scaled_dot_product_attention(q, k, v)
        x = x.transpose(1, 2).reshape(b, n, c)
        return self.proj(x)


class Mlp(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, dim * 2)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(dim * 2, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, brk: bool = False) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = Mlp(dim)
        self.brk = brk

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        if self.brk:
            torch._dynamo.graph_break()  # a no-op in eager; splits the captured graph
        return x + self.mlp(self.norm2(x))


class ViT(nn.Module):
    """A timm-style ViT: patch embedding, class token, blocks with fused attention."""

    def __init__(self, dim: int = 32, heads: int = 2, depth: int = 2, brk: bool = False) -> None:
        super().__init__()
        self.patch_embed = nn.Conv2d(3, dim, kernel_size=4, stride=4)
        self.cls_token = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
        self.pos_embed = nn.Parameter(torch.randn(1, 5, dim) * 0.02)
        self.blocks = nn.Sequential(*[Block(dim, heads, brk) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        x = self.norm(self.blocks(x))
        return self.head(x[:, 0])


def make_vit(brk: bool = False) -> ViT:
    torch.manual_seed(0)
    return ViT(brk=brk).eval()


def image(batch: int = 2, seed: int = 1) -> torch.Tensor:
    return torch.randn(batch, 3, 8, 8, generator=torch.Generator().manual_seed(seed))


OPS = [F.scaled_dot_product_attention, torch.add, nn.Linear, nn.LayerNorm, nn.GELU]


class InplaceAfter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        h.relu_()  # overwrites the Linear's output in place
        h += 1.0
        return h * 2

