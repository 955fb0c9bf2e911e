"""A byte-level GPT, written the way a user writes their own model: plain PyTorch, no trainer.

`build(spec, **model.kwargs)` is the factory `model.name: "bytegpt:build"` names; the
context length is read from the data (`spec.columns["input_ids"]`, set by the
preprocess in `stdlib_corpus.py`). `loss(output, batch)` is `train.loss: "bytegpt:loss"`:
the mean next-byte cross-entropy in nats (divide by ln 2 for bits per byte).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(batch, length, 3, self.heads, width // self.heads).unbind(2)
        attended = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                  is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, length, width))
        return x + self.mlp(self.norm2(x))


class ByteGPT(nn.Module):
    """Embeddings for 256 byte values and `context` positions, `layers` pre-norm blocks, tied head."""

    def __init__(self, context: int, width: int = 128, layers: int = 4, heads: int = 4, vocab: int = 256) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Parameter(torch.randn(context, width) * 0.02)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.apply(_init)  # GPT-2's: small weights, so the first loss is about ln(256), not 20+


    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids) + self.position[: input_ids.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.norm(x) @ self.embed.weight.T  # (batch, length, 256) logits


def _init(module: nn.Module) -> None:
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


def build(spec, width: int = 128, layers: int = 4, heads: int = 4) -> ByteGPT:
    (context,), _dtype = spec.columns["input_ids"]
    return ByteGPT(context, width, layers, heads)


def loss(output: torch.Tensor, batch: dict) -> torch.Tensor:
    return F.cross_entropy(output.flatten(0, 1), batch["labels"].flatten())
