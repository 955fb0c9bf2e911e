"""A small model zoo: the articles' MLP, a CNN for 8x8 digits, a tiny GPT.

Owns: building an `nn.Module` from `cfg.model` and the data's `DataSpec`, and the loss;
`model.activation_checkpointing` on any built model (`checkpoint_activations`, `Checkpointed`).
Must not touch: devices, distribution, data loading. Models are deterministic functions
of the seed set by the caller before `build_model`.
"""

from __future__ import annotations

import functools
import importlib
import math
from typing import Any, Union

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from raytrain_ddp.config import Config
from raytrain_ddp.errors import UserError
from raytrain_ddp.job import DataSpec
from raytrain_ddp.parallel import torch_compat


class MLP(nn.Module):
    """The source articles' model: Linear 1024->1024->1024->256 with ReLUs; a classifier
    head is appended only when the data has a different number of classes than the last width."""

    def __init__(self, in_features: int, hidden_sizes: list[int], num_classes: int, dropout: float = 0.0):
        super().__init__()
        layers: list[nn.Module] = []
        width = in_features
        for i, size in enumerate(hidden_sizes):
            layers.append(nn.Linear(width, size))
            if i < len(hidden_sizes) - 1:
                layers.append(nn.ReLU())
                if dropout:
                    layers.append(nn.Dropout(dropout))
            width = size
        if width != num_classes:
            layers += [nn.ReLU(), nn.Linear(width, num_classes)]
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x.flatten(1))


class SmallCNN(nn.Module):
    """Two conv blocks sized for 8x8 single-channel images (scikit-learn digits)."""

    def __init__(self, in_shape: tuple[int, ...], num_classes: int, dropout: float = 0.0):
        super().__init__()
        channels, height, width = in_shape
        self.features = nn.Sequential(
            nn.Conv2d(channels, 32, 3, padding=1), nn.ReLU(),
            nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        )
        flat = 64 * (height // 2) * (width // 2)
        self.head = nn.Sequential(nn.Flatten(), nn.Dropout(dropout), nn.Linear(flat, 128), nn.ReLU(),
                                  nn.Linear(128, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


class Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int, dropout: float):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.attn = nn.MultiheadAttention(d_model, n_heads, dropout=dropout, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model),
                                 nn.Dropout(dropout))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """A decoder-only transformer over token ids: enough to measure tokens/s and MFU."""

    def __init__(self, vocab_size: int, seq_len: int, d_model: int, n_layers: int, n_heads: int, dropout: float):
        super().__init__()
        self.seq_len = seq_len
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Parameter(torch.zeros(1, seq_len, d_model))
        self.blocks = nn.ModuleList(Block(d_model, n_heads, dropout) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        nn.init.normal_(self.pos, std=0.02)
        causal = torch.triu(torch.full((seq_len, seq_len), float("-inf")), diagonal=1)
        self.register_buffer("causal_mask", causal, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        x = self.tok(tokens) + self.pos[:, :length]
        mask = self.causal_mask[:length, :length]
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.ln_f(x))

    def flops_per_token(self) -> float:
        """6N + attention term (PaLM appendix B): the standard MFU numerator.

        N leaves out the token and position embeddings: a lookup is no matrix product, and
        the token table is untied from `head` here, so counting it overstated MFU by ~27 %
        on the GPU preset (107.8 M parameters, N = 81.9 M; issue #41).
        """
        n_params = sum(p.numel() for p in self.parameters()) - self.pos.numel() - self.tok.weight.numel()
        d, layers = self.tok.embedding_dim, len(self.blocks)
        return 6 * n_params + 12 * layers * d * self.seq_len


def build_model(cfg: Config, spec: DataSpec) -> nn.Module:
    m = cfg.model
    if m.name == "gpt":
        if spec.task != "lm":
            raise ValueError("model.name='gpt' needs token data")
        return TinyGPT(spec.num_classes, spec.feature_shape[0], m.d_model, m.n_layers, m.n_heads, m.dropout)
    if spec.task != "classification":
        raise ValueError(f"model.name={m.name!r} needs classification data")
    if m.name == "cnn":
        return SmallCNN(spec.feature_shape, spec.num_classes, m.dropout)
    return MLP(math.prod(spec.feature_shape), list(m.hidden_sizes), spec.num_classes, m.dropout)


def cross_entropy(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy in fp32; over every token position when logits are (B, T, V)."""
    if logits.dim() == 3:
        return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
    return F.cross_entropy(logits.float(), y)


class Checkpointed(nn.Module):
    """`block` whose activations are recomputed in backward instead of kept (non-reentrant
    `torch.utils.checkpoint`: works with autocast, accumulation and every strategy's hooks).

    It shares the block's own parameter, buffer and child tables (the same dicts, not
    copies), so its names are the block's; `train()` reaches the block itself too. Why not
    hold the block as a child, as torch's `checkpoint_wrapper` does (`_checkpoint_wrapped_module.`
    in every name): parameter names, state_dict and optimizer keys stay as without it, so a
    checkpoint loads either way, `verify` compares names with torch DDP's, and errors name
    the user's parameters."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        torch_compat.share_module_tables(self, block)
        object.__setattr__(self, "block", block)  # not a child: its contents are already ours

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return checkpoint(self.block, *args, use_reentrant=False, **kwargs)

    def train(self, mode: bool = True) -> "Checkpointed":
        self.block.training = mode
        return super().train(mode)

    def extra_repr(self) -> str:
        return f"checkpointed {type(self.block).__name__}"


def checkpoint_activations(module: nn.Module, targets: Union[str, list[str], None]) -> int:
    """Replace every outermost submodule of `module` whose class `targets` names (a class name,
    or an import path 'package.module:Class'; `auto`: the built-in gpt's blocks) by a
    `Checkpointed` of it, in place. Returns how many; a `UserError` when none matched."""
    if not targets:
        return 0
    matches = _matcher(targets)
    chosen = [name for name, sub in module.named_modules() if name and matches(sub)]
    chosen = [n for n in chosen if not any(n.startswith(o + ".") for o in chosen if o != n)]  # outermost only
    if not chosen:
        what = ("transformer blocks of the built-in gpt (raytrain_ddp.models.Block)" if targets == "auto"
                else f"submodule of class {', '.join(targets)}")
        raise UserError(f"model.activation_checkpointing={targets!r}: {type(module).__name__} has no {what}; "
                        "list the classes of its repeated blocks (a class name or 'package.module:Class')")
    for name in chosen:
        parent_name, _, child = name.rpartition(".")
        parent = module.get_submodule(parent_name)
        setattr(parent, child, Checkpointed(parent.get_submodule(child)))  # a ModuleList's "0" too
    return len(chosen)


def _matcher(targets: Union[str, list[str]]) -> Any:
    if targets == "auto":
        return lambda sub: isinstance(sub, Block)
    classes, names = [], set()
    for target in targets:
        if ":" in target:  # imported as model.name's factory is (the config's directory on sys.path)
            module_name, _, attr = target.partition(":")
            try:
                cls = functools.reduce(getattr, attr.split("."), importlib.import_module(module_name))
            except Exception as exc:  # noqa: BLE001 - the user's path: one line
                raise UserError(f"model.activation_checkpointing={target!r}: {type(exc).__name__}: {exc}") from None
            if not isinstance(cls, type):
                raise UserError(f"model.activation_checkpointing={target!r} is a {type(cls).__name__}, not a class")
            classes.append(cls)
        else:
            names.add(target)
    return lambda sub: not isinstance(sub, Checkpointed) and (
        type(sub).__name__ in names or isinstance(sub, tuple(classes)))
