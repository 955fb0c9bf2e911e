"""How a batch reaches the model and the loss: the one place that knows what a batch looks like.

Owns: the two batch forms and what is done with them — an `(x, y)` tuple (the model is
called as `model(x)`) or a dict of named tensors (the model is called with the
`data.inputs` columns as keyword arguments, the way Hugging Face models take
`input_ids=...`); building a batch from column tensors, moving it to the device, calling
the model, the loss `(output, batch) -> scalar` (a built-in by name or the user's), and a
batch's target and row count. Must not touch: reading or sharding data
(`worker/shard.py`), optimisation, Ray. The driver's pipeline check (`user.py`) runs this
same code on one small batch before any worker starts.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import torch

from raytrain_ddp.models import cross_entropy

Batch = Union[tuple[torch.Tensor, torch.Tensor], dict[str, torch.Tensor]]


@dataclass(frozen=True)
class BatchFormat:
    features: str = "x"
    label: str = "y"
    inputs: Optional[tuple[str, ...]] = None  # None: (x, y) tuples; else the model's keyword arguments
    loss_name: str = "cross_entropy"  # a built-in (config.BUILTIN_LOSSES) unless user_loss is set
    user_loss: Optional[Callable[[Any, Any], torch.Tensor]] = None

    @classmethod
    def of(cls, cfg: Any, user_loss: Optional[Callable[[Any, Any], torch.Tensor]] = None) -> "BatchFormat":
        inputs = tuple(cfg.data.inputs) if cfg.data.inputs else None
        return cls(cfg.data.features, cfg.data.label, inputs, cfg.train.loss, user_loss)

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
