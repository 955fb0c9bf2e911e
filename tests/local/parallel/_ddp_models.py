"""Models with the features torch DDP handles and a from-scratch wrapper can get wrong.

Shared by the torch-parity tests (tests/local/parallel/test_torch_parity.py) and the verify
tests: BatchNorm buffers, an embedding tied to the output head, a branch no rank uses and
one only rank 0 uses, and a plain MLP for freezing. All float64, all deterministic given
the seed set before building them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class BNNet(nn.Module):
    """Linear -> BatchNorm1d -> ReLU -> Linear: running stats differ per rank's batch."""

    def __init__(self) -> None:
        super().__init__()
        self.lin1, self.bn, self.lin2 = nn.Linear(5, 8), nn.BatchNorm1d(8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin2(F.relu(self.bn(self.lin1(x))))


class TiedLM(nn.Module):
    """Token embedding shared with the output head (one parameter, two uses)."""

    VOCAB, DIM = 11, 6

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(self.VOCAB, self.DIM)
        self.mix = nn.Linear(self.DIM, self.DIM)
        self.head = nn.Linear(self.DIM, self.VOCAB, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mix(self.emb(tokens))))


class Branchy(nn.Module):
    """`dead` is never used; `solo` only when the caller says so (rank 0 in the tests)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.dead, self.solo, self.head = (nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4),
                                                   nn.Linear(4, 2))

    def forward(self, x: torch.Tensor, use_solo: bool = False) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        return self.head(h + self.solo(x) if use_solo else h)


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin1, self.lin2 = nn.Linear(5, 6), nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin2(torch.tanh(self.lin1(x)))


def build(name: str, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return {"bn": BNNet, "tied": TiedLM, "branchy": Branchy, "mlp": MLP}[name]().double()


def batch(name: str, step: int, micro: int, world_rank: int, n: int = 4):
    """(inputs, target) of one rank's micro-batch; different on every rank."""
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + world_rank)
    if name == "tied":
        tokens = torch.randint(0, TiedLM.VOCAB, (n, 3), generator=g)
        return tokens, torch.randint(0, TiedLM.VOCAB, (n, 3), generator=g)
    width = 4 if name == "branchy" else 5
    out = 2 if name == "branchy" else 3
    return (torch.randn(n, width, generator=g, dtype=torch.float64),
            torch.randn(n, out, generator=g, dtype=torch.float64))


def loss_of(name: str, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    if name == "tied":
        return F.cross_entropy(out.flatten(0, 1), target.flatten())
    return F.mse_loss(out, target)
