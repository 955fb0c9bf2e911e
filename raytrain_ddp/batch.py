"""How a batch reaches the model and the loss: the one place that knows what a batch looks like.

Owns: the two batch forms and what is done with them — an `(x, y)` tuple (the model is
called as `model(x)`) or a dict of named tensors (the model is called with the
`data.inputs` columns as keyword arguments, the way Hugging Face models take
`input_ids=...`); building a batch from column tensors, moving it to the device, calling
the model, the loss `(output, batch) -> scalar` (a built-in by name or the user's), the
user's `train.metrics` of a batch as `(sum, count)` pairs, and a batch's target and row count. Must not touch: reading or sharding data
(`data/worker_data.py`), optimisation, Ray. The driver's pipeline check (`user.py`) runs this
same code on one small batch before any worker starts.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

import torch

from raytrain_ddp.models import cross_entropy

if TYPE_CHECKING:
    from raytrain_ddp.config import Config

Batch = Union[tuple[torch.Tensor, torch.Tensor], dict[str, torch.Tensor]]


@dataclass(frozen=True)
class BatchFormat:
    features: str = "x"
    label: str = "y"
    inputs: Optional[tuple[str, ...]] = None  # None: (x, y) tuples; else the model's keyword arguments
    loss_name: str = "cross_entropy"  # a built-in (config.BUILTIN_LOSSES) unless user_loss is set
    user_loss: Optional[Callable[[Any, Any], torch.Tensor]] = None
    user_metrics: Optional[Callable[[Any, Any], Any]] = None  # train.metrics: (output, batch) -> {name: value}

    @classmethod
    def of(cls, cfg: "Config", user_loss: Optional[Callable[[Any, Any], torch.Tensor]] = None,
           user_metrics: Optional[Callable[[Any, Any], Any]] = None) -> "BatchFormat":
        inputs = tuple(cfg.data.inputs) if cfg.data.inputs else None
        return cls(cfg.data.features, cfg.data.label, inputs, cfg.train.loss, user_loss, user_metrics)

    @property
    def is_dict(self) -> bool:
        return self.inputs is not None

    def assemble(self, columns: dict[str, torch.Tensor]) -> Batch:
        """A batch from column tensors of equal length (the columns of one slice of rows)."""
        if self.is_dict:
            return dict(columns)
        return columns[self.features], columns[self.label]

    def run(self, model: Any, batch: Batch) -> tuple[Any, torch.Tensor]:
        """`(output, loss)` of one batch: the forward and the loss, nothing else."""
        output = self.forward(model, batch)
        return output, self.loss(output, batch)

    def forward(self, model: Any, batch: Batch) -> Any:
        if self.is_dict:
            return model(**{name: batch[name] for name in self.inputs})  # type: ignore[union-attr, index]
        return model(batch[0])  # type: ignore[index]

    def loss(self, output: Any, batch: Batch) -> torch.Tensor:
        if self.user_loss is not None:
            return self.user_loss(output, batch)
        if self.loss_name == "model":  # the model computed it (Hugging Face: given labels=...)
            if isinstance(output, Mapping):
                return output["loss"]
            return output if isinstance(output, torch.Tensor) else output.loss
        target = self.target(batch)
        if target is None:
            raise KeyError(f"train.loss=cross_entropy needs the label column {self.label!r} (data.label) in the batch")
        return cross_entropy(output, target)

    def metrics(self, output: Any, batch: Batch) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """The user's `train.metrics` of one batch as `{name: (sum, count)}` in float64, ready to
        be added up over batches and ranks: a mean counts the batch's rows; a pair is taken as is."""
        if self.user_metrics is None:
            return {}
        return metric_sums(self.user_metrics(output, batch), self.rows(batch))

    def target(self, batch: Batch) -> Optional[torch.Tensor]:
        """The label tensor (for cross_entropy and accuracy), or None when a dict batch has none."""
        if self.is_dict:
            return batch.get(self.label)  # type: ignore[union-attr]
        return batch[1]  # type: ignore[index]

    def rows(self, batch: Batch) -> int:
        first = next(iter(batch.values())) if self.is_dict else batch[0]  # type: ignore[union-attr, index]
        return int(first.shape[0])


def to_device(batch: Any, device: torch.device) -> Any:
    """A tensor, or a tuple / list / dict of them, on `device` (pinned, non-blocking copies)."""
    if getattr(device, "type", "cpu") == "cpu":
        return batch
    if isinstance(batch, torch.Tensor):
        return batch.pin_memory().to(device, non_blocking=True)
    if isinstance(batch, Mapping):
        return {key: to_device(value, device) for key, value in batch.items()}
    return type(batch)(to_device(value, device) for value in batch)


BUILTIN_METRICS = ("loss", "accuracy", "perplexity")  # val_<name> keys the loop reports itself


def metric_sums(values: Any, rows: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """`{name: mean | (sum, count)}` (what a `train.metrics` function returns) -> `{name: (sum, count)}`.

    Raises ValueError (the message names what is wrong, for the key's one line) on anything
    else: not a dict, a name that is not an identifier or is a built-in's, a value that is
    not one number.
    """
    if not isinstance(values, Mapping):
        raise ValueError(f"returned a {type(values).__name__}; it must return a dict of name -> value")
    out = {}
    for name, value in values.items():
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(f"metric name {name!r} must be an identifier (it is reported as val_<name>)")
        if name in BUILTIN_METRICS:
            raise ValueError(f"metric {name!r} would replace the built-in val_{name}; give it another name")
        if isinstance(value, (tuple, list)):
            if len(value) != 2:
                raise ValueError(f"metric {name!r}: a pair must be (sum, count), got {len(value)} values")
            out[name] = (_one_number(name, value[0]), _one_number(name, value[1]))
        else:
            out[name] = (_one_number(name, value) * rows, torch.tensor(float(rows), dtype=torch.float64))
    return out


def _one_number(name: str, value: Any) -> torch.Tensor:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.detach().reshape(()).to(torch.float64)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return torch.tensor(float(value), dtype=torch.float64)
    shape = f" of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else ""
    raise ValueError(f"metric {name!r} is a {type(value).__name__}{shape}; it must be one number "
                     "(a scalar tensor or a float) or a (sum, count) pair")
