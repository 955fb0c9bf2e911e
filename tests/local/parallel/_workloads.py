"""Small float64 models, data and a single-process reference shared by the parallel tests."""

from __future__ import annotations

import torch
from torch import nn

IN, HIDDEN, OUT = 5, 8, 3
# float64 parameters, reverse order: l3.bias 24 B + l3.weight 192 B + l1.bias 64 B | l1.weight 320 B
# (a bucket closes once it holds the cap, as torch DDP's do)
TINY_BUCKET_MB = 256 / 2**20
EXPECTED_BUCKETS = 2


def make_model(seed: int) -> nn.Module:
    """Linear-Tanh-Linear(frozen)-Tanh-Linear; ranks pass different seeds on purpose."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN), nn.Tanh(),
                          nn.Linear(HIDDEN, OUT)).double()
    model[2].requires_grad_(False)
    return model


def trainable_bytes(model: nn.Module, itemsize: int = 8) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad) * itemsize


def make_optimizer(name: str, params):
    params = [p for p in params if p.requires_grad]
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.05)


def step_data(step: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The samples of optimizer step `step` (same on every rank and in the reference)."""
    g = torch.Generator().manual_seed(1000 + step)
    return (torch.randn(n, IN, generator=g, dtype=torch.float64),
            torch.randn(n, OUT, generator=g, dtype=torch.float64))


def reference_params(optimizer: str, steps: int, samples_per_step: list[int]) -> list[torch.Tensor]:
    """One process, rank 0's initial weights (seed 1), each step's samples in one mean-loss batch."""
    model = make_model(seed=1)
    opt = make_optimizer(optimizer, model.parameters())
    for s in range(steps):
        x, y = step_data(s, samples_per_step[s])
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return [p.detach().clone() for p in model.parameters()]


def optimizer_state_bytes(optimizer) -> int:
    """Bytes of the tensors an optimizer holds on this rank (DTensors: the local shard)."""
    total = 0
    for entry in optimizer.state.values():
        for value in entry.values():
            if torch.is_tensor(value):
                local = value.to_local() if hasattr(value, "to_local") else value
                total += local.numel() * local.element_size()
    return total
