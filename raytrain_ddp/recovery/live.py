"""`run.recovery: live` on a worker (issue #28; a `WorkerRecovery` of `table.py`): the survivors keep their
processes; only the lost worker is replaced.

Owns: one torchft `Manager` per worker (each worker is its own replica group in Ray's
`TorchftConfig`), listening on this node's address only (`bound_manager`), the
reconfigurable gloo group every collective of the run goes through
(`LiveGroup`, installed as torch's default group), the step's commit decision, putting a
failed step back to its boundary and retrying it, re-wrapping the model after each
reconfiguration, and loading the state a newcomer receives from a survivor. Must not
touch: what a step computes (`worker/step.py`), the checkpoint cadence (`worker/checkpointer.py`),
the wrappers (`raytrain_ddp.parallel`: used as they are, over this group), Ray's replacement
of the dead worker (`live_driver.py` selects it).

On torchft's public API: `Manager` (`start_quorum`, `should_commit`, `report_error`, `errored`,
`load_state_dict`, state transfer over `PGTransport`) and its reconfigurable group's
`configure` (which hands it the quorum id). Not its `OptimizerWrapper`: its `zero_grad` starts
a quorum every step, a round trip to the lighthouse that a steady step here does not make.
Not its `DistributedDataParallel` / `ManagedProcessGroup`: `torchft_compat.py` says why. The group
is still installed as torch's default (c10d's registry, `parallel/torch_compat.py`): the collectives
that name no group (`worker/step.py`'s loss and finiteness vote, the preemption agreement, validation,
`NativeDDP`'s side group from `dist.new_group`) run on it; naming it in each is left to those modules.

How a loss goes (the survivors' side):
1. A peer dies. This rank's next collective in the step fails at once (gloo: connection
   reset). The failure is reported to the manager; `should_commit` says no, so nothing the
   step would change is touched (the optimizer step, the schedule and the step count come
   after the commit, `worker/step.py`).
2. The step is put back to its boundary: gradients dropped, buffers and RNG streams from
   the boundary snapshot (`replica.LastStep`), the loss scaler's per-step state cleared.
3. `start_quorum` (called at the start and after a failed try only: a steady step makes
   no round trip to the lighthouse) blocks until every worker is a member again (the
   lighthouse's and the manager's minimum is the worker count): the survivors wait, the
   global batch never shrinks. Ray meanwhile starts the replacement; it joins the quorum behind (its step
   is 0), and torchft sends it the survivors' state over the reconfigured group
   (`PGTransport`: no storage read).
4. Every member re-wraps the model on the new group (the newcomer wraps it for the first
   time): fresh wrapper state everywhere, the same on every rank. The same window of
   micro-batches is trained again: the step in flight was never completed, so no
   completed step is redone, and the trajectory is the uninterrupted run's.

The manager's step is `progress.step + 1` on every member in the loop and 0 on a worker
that just started, so a newcomer always heals, even before the first commit. A full start
(every member at 0) heals nobody and restores like any attempt (`Checkpointer.resume`).
Bounded: a quorum that does not form within `JOIN_TIMEOUT_S` (no replacement came, or it
died while joining) ends this worker with an error naming the wait, after it wrote its
copy of the last step; Ray then restarts the group and `replica` recovery takes over.
"""

from __future__ import annotations

import contextlib
import os
import random
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence, Union

import numpy as np
import torch

from raytrain_ddp.parallel import registry, torch_compat
from raytrain_ddp.parallel.native import NativeDDP
from raytrain_ddp.recovery.live_group import (LIGHTHOUSE_ENV, install_default_group, lighthouse_address,
                                              live_group_class, node_address)
from raytrain_ddp.recovery.replica import is_peer_loss, map_tensors
from raytrain_ddp.recovery.steady import Steady
from raytrain_ddp.torchft_compat import bound_manager, raised_in_torchft

if TYPE_CHECKING:
    from raytrain_ddp.config.schema import TrainConfig
    from raytrain_ddp.job import Job
    from raytrain_ddp.recovery.table import WorkerParts
    from raytrain_ddp.worker.checkpointer import Checkpointer
    from raytrain_ddp.worker.context import Rank
    from raytrain_ddp.worker.hooks import Hooks
    from raytrain_ddp.worker.meter import RunLog
    from raytrain_ddp.worker.runtime import Runtime
    from raytrain_ddp.worker.state import TrainState
    from raytrain_ddp.worker.step import StepResult

JOIN_TIMEOUT_S = 120.0  # survivors wait this long for a replacement, then fail by name
MAX_TRIES = 10  # a step not committed this many times in a row ends the worker, by name
# The group each wrapper class gets here (absent: 0, the reconfigurable group itself); N: a plain
# c10d sub-group of the current quorum, N made with each quorum. torch DDP's C++ reducer reads
# its group's size from the C++ base, which torchft builds once with size 1; `NativeDDP` takes
# its DDP group and the side group of its unused-parameter check.
SUBGROUPS: dict[type, int] = {NativeDDP: 2}


class StepNotCommitted(Exception):
    """The step's collectives failed on some member: nothing of it is applied; it is retried."""


class NoReplacement(RuntimeError):
    """The survivors waited `JOIN_TIMEOUT_S` for a full quorum and none formed."""


class LiveSession:
    """One worker's side of live recovery (see the module docstring)."""

    @classmethod
    def for_worker(cls, job: "Job", runtime: "Runtime", parts: "WorkerParts",
                   entered: Optional[float] = None) -> Union["LiveSession", Steady]:
        """A session, where Ray's torchft backend runs (our launcher selects it: `live_driver.py`);
        a worker without its lighthouse (your own `TorchTrainer` from `prepare_job`) says so once
        and recovers as `replica` does (`Steady`)."""
        if not os.environ.get(LIGHTHOUSE_ENV):
            rank = runtime.rank()
            if rank.is_main:
                _say(rank, f"run.recovery=live needs Ray Train's TorchftConfig backend (${LIGHTHOUSE_ENV} is not set: "
                           "this is not raytrain-ddp's launcher); recovering as run.recovery=replica does")
            return Steady(runtime, parts)
        return cls(job, runtime.rank(), runtime, parts, entered)

    def __init__(self, job: "Job", rank: "Rank", runtime: "Runtime", parts: "WorkerParts",
                 entered: Optional[float] = None) -> None:
        from torchft.checkpointing.pg_transport import PGTransport

        cfg = job.cfg
        self.rank, self.cfg, self.runtime, self.parts = rank, cfg, LiveRuntime(runtime), parts
        timeout = timedelta(seconds=cfg.parallel.collective_timeout_s)
        self._group = live_group_class(rank.device)(timeout=timeout)
        self.subgroups = self._group.ahead = SUBGROUPS.get(registry.get(cfg.parallel.strategy).load(), 0)
        self.state: Optional[TrainState] = None
        self.received: Optional[dict[str, Any]] = None  # a newcomer's state, until loaded
        self.bytes_received = 0
        self.write_copy: Callable[[str], None] = lambda why: None
        servers: list = []  # torchft's ManagerServer (the first rank's)
        self.manager = bound_manager(
            node_address(), servers, lighthouse_addr=lighthouse_address(), pg=self._group,
            min_replica_size=rank.world_size, load_state_dict=self._receive,
            state_dict=self._send, use_async_quorum=False, init_sync=False, rank=0, world_size=1,
            replica_id=f"rank{rank.world_rank:05d}", timeout=timeout,
            quorum_timeout=timedelta(seconds=JOIN_TIMEOUT_S), connect_timeout=timedelta(seconds=30),
            checkpoint_transport=PGTransport(self._group, timeout=timeout, device=rank.device),
        )
        _say(rank, f"live: torchft's manager listens on {servers[0].address() if servers else '?'}, the lighthouse on "
                   f"{lighthouse_address()} (this node's address only; no token: docs/security.md)")
        self.log: Optional[RunLog] = None
        self.checkpointer: Optional[Checkpointer] = None
        self._previous_default: Any = None
        self.marks = {"entered": entered or time.time(), "group": time.time()}  # a newcomer's timeline, said once
        started = time.perf_counter()
        if not self._quorum():  # a full start: every member at 0; a replacement heals from a survivor here
            raise NoReplacement(f"run.recovery=live: rank {rank.world_rank} could not join the group: "
                                f"{self.manager.errored().original_exception}")
        self.wrapped_quorum: Any = None
        self._quorum_due, self._vote_due = False, True  # that quorum is also the first step's
        if self.received is None:  # a full start: the whole setup (wrap, restore) runs on the group
            self._install()
            self.wrapped_quorum = self._group.quorum
        else:  # a newcomer: its setup stays local (the survivors are mid-step); wrapped at its first step
            self.marks["healed"] = time.time()
            _say(rank, f"live: joined the running group at step {self.received['progress']['step']}: "
                     f"received {self.bytes_received} bytes from a survivor in {time.perf_counter() - started:.2f}s")

    def wrapper_group(self) -> Any:
        """The group the wrapper runs on: none (local) for a newcomer until its state is loaded;
        then the reconfigurable group, or for a wrapper that needs a group torch's c10d knows
        (`SUBGROUPS`: torch DDP) a sub-group of the current quorum."""
        if self._previous_default is None:
            return None
        if self.subgroups:
            return self._group.adopt(torch.distributed.new_group(
                timeout=timedelta(seconds=self.cfg.parallel.collective_timeout_s)))
        return self._group

    def _install(self) -> None:
        self._previous_default = install_default_group(self._group)

    # -- the state a newcomer receives -------------------------------------------------
    def _send(self) -> dict[str, Any]:
        state = self.state.state_dict()
        # The step's metrics lines go along: a lost rank 0 may have died before sending its
        # own (after the step, before its line), and the newcomer hands them on as rank 0.
        step = self.state.progress.step
        state["lines"] = [r for r in list(getattr(self.log, "step_lines", [])) if r.get("step") == step]
        _say(self.rank, f"live: sending step {self.state.progress.step} to a replacement ({tensor_bytes(state)} bytes)")
        return state

    def _receive(self, state: dict[str, Any]) -> None:
        self.received = state
        self.bytes_received += tensor_bytes(state)

    def resume(self, job: "Job", rank: "Rank", state: "TrainState", log: "RunLog", hooks: "Hooks",
               accumulation_steps: int) -> "Checkpointer":
        """A full start restores like any attempt; a newcomer loads what a survivor sent."""
        made = self.parts.checkpointer  # the class
        self.state, self.log = state, log
        tolerant = {"before_report": self._before_report, "agree": self._agree}  # a lost member ends neither
        if self.received is None:
            checkpointer = made.resume(job, rank, state, log, hooks, accumulation_steps, self.runtime, **tolerant)
        else:
            checkpointer = made(job, rank, state, log, hooks, self.runtime, **tolerant)
            state.load_state_dict(self.received)
            step = state.progress.step
            log.resumed_at(step, {"resumed_from": "live", "bytes_received": self.bytes_received},
                           lines=self.received.get("lines", []))
            checkpointer.saved_step = step
            self.received = None
            m = {**self.marks, "loaded": time.time()}
            _say(rank, f"live: replacement rank {rank.world_rank} continues at step {step} with the survivors' "
                     f"state ({self.bytes_received} bytes over the group, no storage read); its training function "
                     f"started at {_clock(m['entered'])}, then torchft and its manager took "
                     f"{m['group'] - m['entered']:.2f}s, the quorum and the state {m['healed'] - m['group']:.2f}s, "
                     f"data, model and loading {m['loaded'] - m['healed']:.2f}s")
            self._install()  # from now on every collective is the group's; the first step wraps on it
        self.write_copy, self.checkpointer = checkpointer.write_copy, checkpointer
        self.manager.load_state_dict({"step": state.progress.step + 1, "batches_committed": 0})
        return checkpointer

    # -- the step ------------------------------------------------------------------------
    def train_step(self, state: "TrainState", window: list, accumulation_steps: int, train: "TrainConfig",
                   rank: "Rank") -> "StepResult":
        """`step.train_step`, committed only when every member's collectives succeeded; retried
        on the same window after a loss, once every worker is a member again."""
        for tries in range(1, MAX_TRIES + 1):
            outcome = self._attempt(state, window, accumulation_steps, train, rank)
            if not isinstance(outcome, str):
                return outcome
            rewind(state)
            _say(rank, f"live: step {state.progress.step + 1} not committed ({outcome}); waiting for every worker "
                     f"(try {tries}), then training the same micro-batches again")
        raise NoReplacement(f"run.recovery=live: step {state.progress.step + 1} was not committed in {MAX_TRIES} "
                            f"tries on rank {rank.world_rank}; workers keep failing")

    def _attempt(self, state: "TrainState", window: list, accumulation_steps: int, train: "TrainConfig",
                 rank: "Rank") -> Union["StepResult", str]:
        """The step's result, or why it was not committed.

        A quorum only after a failed try (and the start's): in steady state a step costs no
        round trip to the lighthouse. The first try after a quorum also asks the manager to
        commit (it finishes a state transfer in flight); later ones commit when their own
        collectives succeeded. A member that failed aborts its group, so a member whose
        collectives had completed (a ring all-reduce can finish on some ranks) fails at its
        next one and comes to the quorum too, where it is the one ahead and heals the others.
        """
        if self._quorum_due:
            self._quorum_due = False
            if not self._quorum():
                self._quorum_due = True
                self.manager.should_commit()  # no: the manager's step stays where it is
                return f"the group could not be re-formed: {self.manager.errored().original_exception}"
            self._vote_due = True
        try:
            if self._group.quorum != self.wrapped_quorum:  # a member lost while wrapping: a failed try too
                self._rewrap(state)
            result = self.parts.train_step(state, window, accumulation_steps, train, rank,
                                           commit=self._commit if self._vote_due else None)
            self._vote_due = False
            return result
        except StepNotCommitted as exc:
            why = str(exc)
        except RuntimeError as exc:
            if not self._lost(exc):
                raise
            self.manager.report_error(exc)
            self.manager.should_commit()
            why = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:160]
        self._quorum_due = True
        with contextlib.suppress(Exception):
            self._group.abort(errored=False)
        return why

    def _commit(self) -> None:
        if not self.manager.should_commit():
            raise StepNotCommitted("a member's collective failed")

    def _quorum(self) -> bool:
        """Wait until every worker is a member (bounded); False if the group could not be formed."""
        if self.state is not None:  # the manager's step is ours + 1: a newcomer (0) is always behind
            self.manager.load_state_dict({"step": self.state.progress.step + 1, "batches_committed": 0})
        try:
            self.manager.start_quorum()
        except Exception as exc:  # noqa: BLE001 - named, bounded: a timeout or a lighthouse gone
            message = (f"run.recovery=live: rank {self.rank.world_rank} waited for all {self.rank.world_size} "
                       f"workers to rejoin (at most {JOIN_TIMEOUT_S:g}s) and they did not "
                       f"({type(exc).__name__}: {str(exc).strip()[:200]}); stopping this worker so Ray restarts "
                       "the group from the survivors' copy")
            self.write_copy(message)
            raise NoReplacement(message) from exc
        if self.manager.errored() is not None:  # a member died while the group was re-formed
            return False
        if self._group.size() != self.rank.world_size or self._group.rank() != self.rank.world_rank:
            raise NoReplacement(f"run.recovery=live: the quorum placed rank {self.rank.world_rank} at "
                                f"{self._group.rank()} of {self._group.size()}; expected all workers in rank order")
        return True

    def _rewrap(self, state: "TrainState") -> None:
        """After a reconfiguration every member wraps afresh on the new group (the newcomer
        does it in `build_state`): the wrappers' per-run state is the same on every rank."""
        if hasattr(state.wrapper, "close"):
            state.wrapper.close()
        state.wrapper = self.parts.wrap(state.module, self.cfg, self.rank, self.wrapper_group())
        state.compiler = self.parts.compile_wrapper(state.wrapper, self.cfg) or state.compiler  # native: a new DDP
        self.wrapped_quorum = self._group.quorum
        if self.log is not None:  # the new wrapper counts its all-reduces from zero
            self.log.meter.count_comm_from(state.wrapper.comm_stats)
        if self.checkpointer is not None:  # the preemption poll's schedule starts afresh on every member
            self.checkpointer.restart_preemption_poll()

    # -- between steps: Ray's barriers, our agreements and validation never wait for a dead worker --
    def validate(self, state: "TrainState", data: Any, rank: "Rank", spec: Any) -> dict[str, float]:
        """The epoch's validation (`step.validate`: collectives on our group). A member lost
        during it skips it, said in one line: the replacement joins at the next step, which
        trains the next epoch, so the survivors cannot validate this epoch again with it. The
        checkpoint that follows is skipped too (`_before_report`); training goes on."""
        try:
            return self.parts.validate(state, data, rank, spec)
        except RuntimeError as exc:
            if not self._lost(exc):
                raise
            state.module.train()
            self._quorum_due = True  # the group is left as it is: the checkpoint's collective fails on it too
            _say(rank, f"live: the validation after step {state.progress.step} is skipped: a worker was lost "
                       "during it; training goes on once its replacement has joined")
            return {}

    def _lost(self, exc: BaseException) -> bool:
        return isinstance(exc, RuntimeError) and (is_peer_loss(exc) or raised_in_torchft(exc))

    def _before_report(self) -> bool:
        """Whether a checkpoint may go to Ray's report, a barrier over every worker in Ray's
        synchronisation actor that a dead worker's replacement never reaches for that step:
        first a collective on our group, which fails at once when a member is gone; then the
        report is skipped (said), and the next step waits for the replacement as any step does."""
        if self._agreed([0.0]) is not None:
            return True
        _say(self.rank, f"live: the checkpoint of step {self.state.progress.step} is skipped: a worker was "
                        "lost before Ray's report; training goes on once its replacement has joined")
        return False

    def _agree(self, values: Sequence[float]) -> list[float]:
        """The preemption poll's agreement (a collective): a lost member makes it this rank's own answer."""
        agreed = self._agreed(values)
        return [float(v) for v in values] if agreed is None else agreed

    def _agreed(self, values: Sequence[float]) -> Optional[list[float]]:
        """The maximum of `values` over the group; None if a member is lost (the next step re-forms it)."""
        from raytrain_ddp.parallel.collectives import max_over_ranks

        try:
            return max_over_ranks(values, self.rank.device)
        except RuntimeError as exc:
            if not self._lost(exc):
                raise
            self._quorum_due = True
            return None

    def close(self) -> None:
        """The manager stops serving (a late joiner must not find a finished worker), and torch's
        default group is Ray's again, so Ray's own teardown finds what it created."""
        if self._previous_default is not None:
            install_default_group(self._previous_default)
        self.manager.shutdown(wait=False)
        with contextlib.suppress(Exception):  # a member that failed: the others' collectives fail now,
            self._group.abort(errored=False)  # not at their timeout


class LiveRuntime:
    """The Ray Train runtime, minus Ray's preemption poll: it is a barrier over every worker
    through Ray's synchronisation actor, which a replacement resets; Ray turns its
    preemption watcher off for replica groups anyway."""

    def __init__(self, inner: "Runtime") -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def preemption_source(self) -> Callable[[int], Any]:
        return lambda step: None


def rewind(state: "TrainState") -> None:
    """Put a step that was not committed back to its boundary (only what a step touches
    before its commit: gradients, buffers, RNG streams, the loss scaler's per-step record)."""
    state.optimizer.zero_grad(set_to_none=True)
    last = state.last_step
    if last is not None:
        with torch.no_grad():
            for name, buffer in state.module.named_buffers():
                if name in last.buffers:
                    buffer.copy_(last.buffers[name])
        torch_state, np_state, py_state, cuda = last.rng
        torch.set_rng_state(torch_state)
        np.random.set_state(np_state)
        random.setstate(py_state)
        if cuda is not None:  # `capture_rng`'s (device index, state) of this worker's own device
            index, cuda_state = cuda
            torch.cuda.set_rng_state(cuda_state, index)
    if state.scaler.is_enabled():
        torch_compat.forget_unscaled(state.scaler)  # unscale_ marked the optimizer as unscaled


def tensor_bytes(tree: Any) -> int:
    """Bytes of every tensor in a state dict (what a newcomer is sent)."""
    sizes: list[int] = []
    map_tensors(tree, lambda t: sizes.append(t.numel() * t.element_size()) or t)
    return sum(sizes)


def _say(rank: "Rank", message: str) -> None:
    """A line from any rank (`Rank.say` speaks for rank 0 only): survivors and newcomers alike."""
    print(f"[rank {rank.world_rank}] {message}", flush=True)


def _clock(t: float) -> str:
    """A wall-clock time as HH:MM:SS.mmm (local time), for lines read next to other logs."""
    return time.strftime("%H:%M:%S", time.localtime(t)) + f".{int(t % 1 * 1000):03d}"
