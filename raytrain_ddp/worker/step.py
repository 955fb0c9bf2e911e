"""One optimizer step and one validation pass: the code that runs between checkpoints.

Owns: accumulate micro-batches (the wrapper syncs on the last), unscale, clip, the
all-ranks decision on non-finite values, step, schedule, counting the step; validation over this rank's
share of the held-out rows. Must not touch: cadence (log, checkpoint, epoch
bookkeeping: the loop and its components), Ray.

Invariants:
- After the last backward of a window (outside `no_sync`) the wrapper has averaged the
  gradients, so the gradient norm, and therefore clipping, is the same on every rank.
- Non-finite losses differ per rank, so a finiteness flag is summed over ranks together
  with the loss before `optimizer.step()`: all ranks skip (or abort) together.
- One host sync per step: reading that verdict. The loss stays a device tensor until a
  logging step reads it (`StepResult.loss`); the wrappers never wait on the host for a
  CUDA collective (docs/parallel.md, "CUDA/NCCL path: audit").
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from raytrain_ddp.parallel.accumulate import accumulation_window
from raytrain_ddp.parallel.base import broadcast_coalesced
from raytrain_ddp.parallel.collectives import all_sum_, sum_over_ranks, union_over_ranks
from raytrain_ddp.worker.context import Rank
from raytrain_ddp.worker.state import TrainState

if TYPE_CHECKING:
    from raytrain_ddp.job import DataSpec
    from raytrain_ddp.config.schema import TrainConfig
    from raytrain_ddp.data.worker_data import WorkerData


class NonFiniteAbort(Exception):
    """Raised inside the loop, caught at its top: every rank stops together, no restart."""


@dataclass(frozen=True)
class StepResult:
    """What a step reports. The loss stays on the device until asked for: reading it is a
    host sync, and only logging steps ask (`RunLog`)."""

    loss_sum: torch.Tensor  # summed over ranks (already reduced: reading it sends nothing)
    world_size: int
    lr: float  # the rate this step used

    @functools.cached_property
    def loss(self) -> float:
        """Mean over ranks and micro-batches."""
        return self.loss_sum.item() / self.world_size


def train_step(state: TrainState, window: list, accumulation_steps: int, train: "TrainConfig", rank: Rank,
               commit: Optional[Callable[[], None]] = None) -> StepResult:
    """One optimizer step over a window of micro-batches.

    Reads one device value on the host (the ranks' verdict on non-finite values, which
    decides whether the optimizer steps); everything else stays on the device.
    `commit`: run.recovery=live's decision (`recovery/live.py`), after the step's last
    collective and before anything it changes: it raises when a member's collective failed.
    """
    lr = state.schedule.lr
    state.module.train()
    local_loss = torch.zeros((), device=rank.device)
    for batch, loss_scale in accumulation_window(state.wrapper, window, expected=accumulation_steps, partial="scale"):
        with state.autocast():
            _, loss = state.batch.run(state.wrapper, batch)
        state.scaler.scale(loss * loss_scale).backward()  # the wrapper syncs on the last one
        local_loss += loss.detach().float() * loss_scale

    state.scaler.unscale_(state.optimizer)
    grad_norm = state.wrapper.clip_grad_norm_(train.clip_grad_norm or math.inf)  # global, even when sharded
    # fp16: an overflowing gradient is the GradScaler's business (it skips and rescales).
    bad = ~torch.isfinite(local_loss)
    if not state.scaler.is_enabled():
        bad |= ~torch.isfinite(grad_norm.to(local_loss.device))
    # One all-reduce for the loss and the verdict; one read of the verdict, the step's only sync.
    votes = all_sum_(torch.stack([local_loss, bad.to(local_loss.dtype)]))
    skip = votes[1].item() > 0
    if commit is not None:
        commit()
    with state.updating():  # a survivor's copy (recovery/replica.py) never sees half of this
        if skip:
            _skip_step(state, train.nonfinite)
        else:
            state.progress.consecutive_nonfinite = 0
            state.scaler.step(state.optimizer)
            state.scaler.update()
        state.optimizer.zero_grad(set_to_none=True)
        state.schedule.step()
        state.step_done()
    return StepResult(votes[0], rank.world_size, lr)


def _skip_step(state: TrainState, policy: Any) -> None:
    progress = state.progress
    progress.nonfinite_steps += 1
    progress.consecutive_nonfinite += 1
    if policy.action == "abort" or progress.consecutive_nonfinite >= policy.max_consecutive:
        raise NonFiniteAbort(
            f"non-finite loss or gradient at step {progress.step + 1} "
            f"({progress.consecutive_nonfinite} in a row; train.nonfinite.action={policy.action}, "
            f"max_consecutive={policy.max_consecutive}); lower train.lr, set train.clip_grad_norm "
            "or use train.precision=fp32"
        )
    if state.scaler.is_enabled():
        state.scaler.update()


@torch.no_grad()
def validate(state: TrainState, data: "WorkerData", rank: Rank, spec: "DataSpec", alone: bool = False) -> dict[str, float]:
    """Loss, accuracy (`accuracy_counts`), perplexity (lm) and the user's `train.metrics` over
    the whole validation set, summed over ranks: exact, whatever the split of rows.
    `alone`: this rank validates every row, with no collective (`worker/validator.py`'s thread).

    The loss is each batch's mean weighted by its rows. Runs the bare module: ranks may
    hold different numbers of validation batches, and a wrapper's forward could take part
    in a collective. Every rank first takes rank 0's buffers (BatchNorm running stats
    drift apart after the last training forward), so what is validated is the model the
    checkpoint saves.
    """
    if rank.world_size > 1 and not alone and getattr(state.wrapper, "broadcast_buffers", True):
        broadcast_coalesced(list(state.module.buffers()), None)
    state.module.eval()
    totals = torch.zeros(4, dtype=torch.float64, device=rank.device)  # loss sum, rows, correct, rows scored
    user: dict[str, torch.Tensor] = {}  # train.metrics: name -> (sum, count) on this rank
    shifted = shifts_labels(state.module, state.batch)
    with state.wrapper.summon_full_params():  # fsdp: gathered once, so no forward communicates
        for batch in (data.val_batches(share=(0, 1)) if alone else data.val_batches()):
            with state.autocast():
                output, loss = state.batch.run(state.module, batch)
            n = state.batch.rows(batch)
            totals[0] += loss.detach().double() * n
            totals[1] += n
            counts = accuracy_counts(output, state.batch.target(batch), spec.task, shifted)
            if counts is not None:
                totals[2] += counts[0]
                totals[3] += counts[1]
            for name, (total, rows) in state.batch.metrics(output, batch).items():
                user.setdefault(name, torch.zeros(2, dtype=torch.float64, device=rank.device))
                user[name][0] += total
                user[name][1] += rows
    loss_sum, count, correct, scored = totals.tolist() if alone else sum_over_ranks(totals)
    user_means = _user_metrics_over_ranks(user, rank, alone) if state.batch.user_metrics is not None else {}
    state.module.train()
    if count == 0:
        return {}
    out = {"val_loss": loss_sum / count}
    if scored:
        out["val_accuracy"] = correct / scored
    if spec.task == "lm":  # the mean token cross-entropy's exponential, as Hugging Face's recipes report it
        out["val_perplexity"] = math.exp(min(out["val_loss"], 700.0))
    return {**out, **user_means}


def _user_metrics_over_ranks(user: dict[str, torch.Tensor], rank: Rank, alone: bool = False) -> dict[str, float]:
    """`train.metrics`: every rank's (sum, count) of each name, summed over ranks -> `val_<name>`.

    The names are agreed first (a rank may have seen no validation batch), so every rank
    sends the same tensor."""
    names = sorted(user) if alone else union_over_ranks(list(user))
    if not names:
        return {}
    zero = torch.zeros(2, dtype=torch.float64, device=rank.device)
    stacked = torch.stack([user.get(name, zero) for name in names])
    sums = stacked.flatten().tolist() if alone else sum_over_ranks(stacked)
    return {f"val_{name}": sums[2 * i] / sums[2 * i + 1] for i, name in enumerate(names) if sums[2 * i + 1]}


IGNORE_INDEX = -100  # a label position that is not scored (torch's cross_entropy and Hugging Face's default)


def logits_of(output: Any) -> Optional[torch.Tensor]:
    """The logits in a model's output: the tensor itself, a dict's or a Hugging Face
    `ModelOutput`'s `logits`; None when there are none."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, Mapping):  # a ModelOutput is a Mapping too
        logits = output.get("logits")
    else:
        logits = getattr(output, "logits", None)
    return logits if isinstance(logits, torch.Tensor) else None


def shifts_labels(module: Any, fmt: Any) -> bool:
    """Whether the model shifts the labels itself: a Hugging Face causal LM (`...ForCausalLM`,
    `...LMHeadModel`) that computes the loss (`train.loss: model`) from `labels=` among its inputs."""
    if fmt.user_loss is not None or fmt.loss_name != "model" or not fmt.is_dict or fmt.label not in fmt.inputs:
        return False
    return type(module).__name__.endswith(("ForCausalLM", "LMHeadModel"))


def accuracy_counts(output: Any, target: Optional[torch.Tensor], task: str,
                    shifted: bool = False) -> Optional[tuple[torch.Tensor, int]]:
    """(correct, scored) of one batch, or None when accuracy does not apply.

    classification: argmax over the last dimension of the logits `(rows, classes)` against
    the labels `(rows,)`. lm: token accuracy, the same over every position of logits
    `(rows, tokens, vocab)` against labels `(rows, tokens)`, skipping labels of -100;
    `shifted`: the model predicts position t + 1 from position t and takes the unshifted
    labels (a Hugging Face causal LM given `labels=`), so logits[:, :-1] are scored against
    labels[:, 1:]. Anything else (no logits, no integer labels, other shapes): None.
    """
    logits = logits_of(output)
    if logits is None or target is None or task not in ("classification", "lm") or target.is_floating_point():
        return None
    if task == "lm" and shifted and logits.dim() == 3:
        logits, target = logits[:, :-1], target[:, 1:]
    if logits.dim() != target.dim() + 1 or logits.shape[:-1] != target.shape:
        return None
    keep = target != IGNORE_INDEX
    correct = ((logits.argmax(dim=-1) == target) & keep).sum()
    return correct, int(keep.sum())
