"""Gradient accumulation: one optimizer step's window of micro-batches.

Owns: which micro-steps skip gradient sync (all but the last, under `wrapper.no_sync()`),
the loss scale of each micro-step, and what happens to a short final window.
Must not touch: the optimizer (the caller steps it), Ray, data loading.

nanoGPT's loop, without anyone writing `(i + 1) % k` by hand:

    batches = iter(shard)                            # yields micro-batches of b samples
    while True:
        window = accumulation_window(model, batches, expected=k)
        for (x, y), loss_scale in window:
            loss = loss_fn(model(x), y) * loss_scale     # loss_fn: mean over the micro-batch
            loss.backward()                          # the last micro-step syncs
        if not window.should_step:                   # input exhausted (or partial dropped)
            break
        optimizer.step(); optimizer.zero_grad(set_to_none=True)

Why the scale is what it is. Each micro-step's loss is a mean over its b samples; scaled
by 1/n the n accumulated gradients add up to the mean over the window, and the wrapper
averages that over W ranks: the mean over W*b*k samples, exactly what one process would
get from a mean loss over all of them (the equivalence tests check this in float64).
When micro-batches can differ in size (a short last batch, uneven shards), pass
`count=` (samples in a micro-batch): every micro-step is then weighted by its sample
count, n_i * W / N, where N is the window's sample total over all ranks (one tiny
all-reduce per window), so the step still equals one process's mean over all N samples.

Short final window (fewer than `expected` micro-batches left):
    partial="scale"  run it; loss_scale uses its real size n (or its real sample count),
                     so the step is the mean over the samples that exist;
    partial="drop"   yield nothing; `should_step` is False and `dropped` says how many
                     micro-batches were discarded (their samples are not trained on).
Every rank must see the same number of micro-batches per window (the data layer's exact
sharding guarantees it), otherwise the ranks disagree on when to sync and wait forever
(or until `collective_timeout_s`).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Sized
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Optional

import torch
import torch.distributed as dist

from raytrain_ddp.parallel.collectives import collective

if TYPE_CHECKING:
    from raytrain_ddp.parallel.base import WrappedModel

PARTIAL_MODES = ("scale", "drop")


def chunked(iterable: Iterable[Any], size: int) -> Iterator[list[Any]]:
    """Consecutive lists of `size` items; the last one may be shorter."""
    if size < 1:
        raise ValueError(f"size={size} must be >= 1")
    iterator = iter(iterable)
    while chunk := list(itertools.islice(iterator, size)):
        yield chunk


class AccumulationWindow:
    """Iterate it for `(micro_batch, loss_scale)`; then read `should_step`.

    The window takes up to `expected` micro-batches from `micro_batches` when created (an
    iterator is advanced by that many, so the same iterator feeds the next window; a
    sequence must hold at most `expected`).
    """

    def __init__(self, wrapper: "WrappedModel", micro_batches: Iterable[Any], *, expected: int,
                 partial: str = "scale", count: Optional[Callable[[Any], int]] = None) -> None:
        if expected < 1:
            raise ValueError(f"expected={expected} micro-batches per window must be >= 1")
        if partial not in PARTIAL_MODES:
            raise ValueError(f"partial={partial!r} is not one of {PARTIAL_MODES}")
        if isinstance(micro_batches, Sized) and len(micro_batches) > expected:
            raise ValueError(
                f"got {len(micro_batches)} micro-batches for a window of expected={expected}; "
                "pass an iterator (each window takes the next `expected`) or chunked(batches, expected)"
            )
        self.wrapper = wrapper
        self.expected = expected
        self.items = list(itertools.islice(iter(micro_batches), expected))
        self.exhausted = len(self.items) < expected
        self.dropped = 0
        if self.exhausted and partial == "drop":
            self.dropped, self.items = len(self.items), []
        self.size = len(self.items)
        self.scales = self._scales(count)

    @property
    def should_step(self) -> bool:
        """True when a backward ran in this window, so the optimizer should step."""
        return self.size > 0

    def _scales(self, count: Optional[Callable[[Any], int]]) -> list[float]:
        if count is None:
            return [1.0 / self.size] * self.size if self.size else []
        counts = [int(count(mb)) for mb in self.items]
        world_size = getattr(self.wrapper, "world_size", 1)
        total = float(sum(counts))
        if world_size > 1:  # the window's samples over all ranks, so every rank scales alike
            device = next(iter(self.wrapper.module.parameters())).device
            t = torch.tensor([total], dtype=torch.float64, device=device)
            with collective("all-reduce of the window's sample count"):
                dist.all_reduce(t, group=getattr(self.wrapper, "process_group", None))
            total = t.item()
        if total <= 0:
            return [0.0] * self.size
        return [n * world_size / total for n in counts]

    def __iter__(self) -> Iterator[tuple[Any, float]]:
        last = self.size - 1
        for j, (micro_batch, scale) in enumerate(zip(self.items, self.scales)):
            # Flush gradients only on the window's last backward: one sync per optimizer step.
            with self.wrapper.no_sync() if j < last else contextlib.nullcontext():
                yield micro_batch, scale

    def __len__(self) -> int:
        return self.size


def accumulation_window(wrapper: "WrappedModel", micro_batches: Iterable[Any], *, expected: int,
                        partial: str = "scale",
                        count: Optional[Callable[[Any], int]] = None) -> AccumulationWindow:
    """One optimizer step's micro-steps: all but the last under `wrapper.no_sync()`.

    Yields `(micro_batch, loss_scale)`; multiply each micro-step's (mean) loss by
    `loss_scale` before `backward()`. See the module docstring for `partial` and `count`.
    """
    return AccumulationWindow(wrapper, micro_batches, expected=expected, partial=partial, count=count)
