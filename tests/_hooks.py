"""Test hooks: kill, poison or stall one rank at one step; fake Ray's preemption signal.

Owns: the fault plans (`RAYTRAIN_DDP_FAULT`, `RAYTRAIN_DDP_FAULT_AT_START`, `RAYTRAIN_DDP_PORT_FAULT`) and the simulated
preemption signal (`RAYTRAIN_DDP_PREEMPT`), all read on the worker, and `from_env`, the factory a test
names in `RAYTRAIN_DDP_HOOKS` (by this file's path: `ENABLE`). Must not touch:
anything but the `Hooks` interface — the product never imports this module.

    RAYTRAIN_DDP_FAULT="rank=1,step=3,attempt=1,mode=exit[,pidfile=PATH]"

After optimizer step `step` on rank `rank` during attempt `attempt` (`attempt=any`:
every attempt), `exit` kills the process (`os._exit`, as a crashed node would), `raise`
raises; `hang` stops that rank taking part in collectives (it sleeps until killed),
first writing its pid to `pidfile` if given, so a test can SIGKILL it from outside;
`nan` instead makes that rank's forward output NaN during step `step` (a forward hook on
the model, as Lightning's tests inject faults from the model), which exercises the
non-finite path; `midstep` SIGKILLs the rank from inside the first forward pass of step
`step + 1` (also a forward hook), so its peers lose it in the middle of a step;
`validation` SIGKILLs it from inside the first validation forward pass (eval mode) after
step `step` (the epoch's last), so its peers lose it while validating (`run.validation:
async`: in rank 0's validator thread, validating the first epoch end at or after `step`,
while the loop trains on). `exit`, `midstep`
and `validation` first write the time of death (`time.time()`) to `mark=PATH` if given,
which the recovery tests and `raytrain-ddp bench`'s recovery section measure from.

    RAYTRAIN_DDP_FAULT_AT_START="rank=1,after=PATH,when=start+joined,mark=PATH"

SIGKILLs processes of rank `rank` that start once the file `after` exists (the first
fault's `mark`: so only replacements die), the n-th of them at the n-th phase of `when`:
`start`, as its loop starts, before it joins any group (in live recovery: before the
quorum), or `joined`, once it has joined (live: after the quorum and the survivor's state,
before its first step). Each appends its time of death to `mark`, which counts them; once
every phase of `when` has had its death, replacements live.

    RAYTRAIN_DDP_PORT_FAULT="rank=0,mark=PATH[,after=PATH]"

takes the port of the process group that rank `rank`'s worker is about to form, once (while
`mark` does not exist; it writes it), and only once the file `after` exists if given (live
recovery: only a replacement): the next port Ray's torch backend picks in that process is
bound and listened on by another socket right after the pick, as another program of a busy
machine would, so the group's store cannot listen (EADDRINUSE). The torchrun launcher has no
such window (its store binds port 0); there the rank's process group fails with torch's
EADDRINUSE error instead, before it forms.

    RAYTRAIN_DDP_PREEMPT="step=6,attempt=1,ranks=1,deadline_s=none"

makes the preemption poll return a synthetic signal from optimizer step `step` of
attempt `attempt` on (deadline `deadline_s` seconds after it first fires, or none), and
polls every step so the checkpoint step is deterministic. Ray's real poll (a
collective) stays in the path.

    RAYTRAIN_DDP_SAMPLE_LOG=DIR

records which samples every optimizer step trained on: a forward pre-hook digests each
row of the model's first input during training, and after each step every rank appends
`{"attempt", "step", "rank", "world_size", "rows": [digest, ...]}` to
`DIR/samples-rank<R>-<pid>.jsonl` (the data tests compare these across worker counts
and across a kill and resume), with the wall-clock `time` it was written. Each forward's
rows also go at once, as the same fields, to `DIR/pending-rank<R>-<pid>.jsonl`: a rank
killed after its step's exchange but before the samples line (a lost node) leaves its
rows of a step the survivors committed there.

    RAYTRAIN_DDP_STEP_DELAY_S=0.15

sleeps that long after every optimizer step, so that a test acting on a run from
outside (a Ctrl-C at step 30) finds it still running at a step it can aim for.
"""

from __future__ import annotations

import math
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

from raytrain_ddp.worker.hooks import HOOKS_ENV, Hooks

if TYPE_CHECKING:
    from raytrain_ddp.worker.context import Rank
    from raytrain_ddp.worker.preemption import Signal  # imports Ray Train: only where a signal is made

FAULT_ENV = "RAYTRAIN_DDP_FAULT"
START_FAULT_ENV = "RAYTRAIN_DDP_FAULT_AT_START"
PREEMPT_ENV = "RAYTRAIN_DDP_PREEMPT"
PORT_FAULT_ENV = "RAYTRAIN_DDP_PORT_FAULT"
SAMPLE_LOG_ENV = "RAYTRAIN_DDP_SAMPLE_LOG"
STEP_DELAY_ENV = "RAYTRAIN_DDP_STEP_DELAY_S"
ENABLE = {HOOKS_ENV: f"{os.path.abspath(__file__)}:from_env"}  # a test's driver env (by file: any sys.path)


def read_env_spec(name: str, required: tuple[str, ...] = ()) -> Optional[dict[str, str]]:
    """The plan spelled `key=value,key=value` in `$name` as a dict (None when unset), read the
    same way by every plan here; a missing required key raises."""
    spec = os.environ.get(name)
    if not spec:
        return None
    fields = dict(item.split("=", 1) for item in spec.split(",") if "=" in item)
    missing = [key for key in required if key not in fields]
    if missing:
        raise ValueError(f"{name}={spec!r}: needs {', '.join(f'{k}=...' for k in missing)}")
    return fields


@dataclass(frozen=True)
class FaultPlan:
    rank: int = 0
    step: int = -1
    attempt: int = 1  # 0: every attempt
    mode: str = "exit"
    pidfile: Optional[str] = None
    mark: Optional[str] = None  # exit / midstep: where to write the time of death

    @classmethod
    def from_env(cls) -> Optional["FaultPlan"]:
        fields = read_env_spec(FAULT_ENV, required=("step",))
        if fields is None:
            return None
        attempt = fields.get("attempt", "1")
        plan = cls(rank=int(fields.get("rank", 0)), step=int(fields["step"]),
                   attempt=0 if attempt == "any" else int(attempt), mode=fields.get("mode", "exit"),
                   pidfile=fields.get("pidfile"), mark=fields.get("mark"))
        if plan.mode not in ("exit", "raise", "nan", "hang", "midstep", "validation"):
            raise ValueError(f"{FAULT_ENV}: mode must be exit|raise|nan|hang|midstep|validation, got {plan.mode!r}")
        return plan

    def hits(self, world_rank: int, step: int, attempt: int) -> bool:
        return world_rank == self.rank and step == self.step and self.attempt in (0, attempt)

    def strike(self, world_rank: int, step: int) -> None:
        """Carry out an exit / raise / hang plan (never returns for exit and hang)."""
        print(f"[fault injection] rank {world_rank} {self.mode} after step {step}", flush=True)
        if self.mark:
            _write_atomically(self.mark, repr(time.time()))
        if self.mode in ("midstep", "validation"):
            os.kill(os.getpid(), signal.SIGKILL)
        if self.mode == "exit":
            os._exit(1)
        if self.mode == "hang":
            if self.pidfile:
                _write_atomically(self.pidfile, str(os.getpid()))
            while True:  # never returns: peers are left waiting in their next collective
                time.sleep(1)
        raise RuntimeError(f"injected fault on rank {world_rank} after step {step} ({FAULT_ENV})")


@dataclass(frozen=True)
class StartFault:
    """`RAYTRAIN_DDP_FAULT_AT_START`: replacements of one rank die as they start (module docstring)."""

    rank: int
    after: str
    mark: str
    when: tuple[str, ...] = ("start",)

    @classmethod
    def from_env(cls) -> Optional["StartFault"]:
        fields = read_env_spec(START_FAULT_ENV, required=("rank", "after", "mark"))
        if fields is None:
            return None
        when = tuple(fields.get("when", "start").split("+"))
        if set(when) - {"start", "joined"}:
            raise ValueError(f"{START_FAULT_ENV}: when must be phases start|joined joined by '+', got {when}")
        return cls(rank=int(fields["rank"]), after=fields["after"], mark=fields["mark"], when=when)

    def strike_if_due(self, world_rank: int, phase: str) -> None:
        if world_rank != self.rank or not os.path.exists(self.after):
            return
        done = len(Path(self.mark).read_text().splitlines()) if os.path.exists(self.mark) else 0
        if done >= len(self.when) or self.when[done] != phase:
            return
        print(f"[fault injection] rank {world_rank} killed at {phase} ({done + 1} of {len(self.when)})", flush=True)
        with open(self.mark, "a") as handle:
            handle.write(f"{time.time()!r}\n")
            handle.flush()
            os.fsync(handle.fileno())
        os.kill(os.getpid(), signal.SIGKILL)


@dataclass(frozen=True)
class PortFault:
    """`RAYTRAIN_DDP_PORT_FAULT`: the process group's port is taken once, right after it is picked."""

    rank: int
    mark: str
    after: Optional[str] = None

    @classmethod
    def from_env(cls) -> Optional["PortFault"]:
        fields = read_env_spec(PORT_FAULT_ENV, required=("mark",))
        if fields is None:
            return None
        return cls(rank=int(fields.get("rank", 0)), mark=fields["mark"], after=fields.get("after"))

    def due(self, world_rank: int) -> bool:
        """Whether this rank's start is the one to fail (claimed at most once: `mark`)."""
        if world_rank != self.rank or (self.after and not os.path.exists(self.after)):
            return False
        try:
            os.close(os.open(self.mark, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return False
        return True

    def take_next_pick(self, world_rank: int) -> None:
        """Ray's next pick of a free port in this process is followed by a listener on that port."""
        import socket

        from raytrain_ddp import ray_compat

        if not self.due(world_rank):
            return

        def take(port: int) -> None:
            taken = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            taken.bind(("0.0.0.0", port))
            taken.listen(1)
            _TAKEN.append(taken)  # held for the life of this process
            print(f"[fault injection] rank {world_rank}: port {port} taken after its pick", flush=True)

        ray_compat.follow_port_pick(take)


_TAKEN: list[Any] = []  # the sockets holding taken ports


def _fail_listen(world_rank: int) -> None:
    """The torchrun launcher's ranks (whose store binds port 0: no pick to follow): this rank's
    process group fails before it forms with torch's own EADDRINUSE error."""
    import torch.distributed as dist

    print(f"[fault injection] rank {world_rank}: the process group's listen fails", flush=True)
    raise dist.DistNetworkError("[fault injection] The server socket has failed to listen on any local network "
                                "address. code: -98, name: EADDRINUSE, message: address already in use")


def _write_atomically(path: str, text: str) -> None:
    Path(f"{path}.tmp").write_text(text)
    os.replace(f"{path}.tmp", path)


@dataclass(frozen=True)
class SimulatedPreemption:
    step: int
    attempt: int = 1
    ranks: tuple[int, ...] = (1,)
    deadline_s: Optional[float] = None  # relative to when the signal first fires

    @classmethod
    def from_env(cls) -> Optional["SimulatedPreemption"]:
        fields = read_env_spec(PREEMPT_ENV, required=("step",))
        if fields is None:
            return None
        deadline = fields.get("deadline_s", "none")
        return cls(step=int(fields["step"]), attempt=int(fields.get("attempt", 1)),
                   ranks=tuple(int(r) for r in fields.get("ranks", "1").split("+")),
                   deadline_s=None if deadline.lower() == "none" else float(deadline))

    def source(self, attempt: int, real: Callable[[int], Optional[Signal]],
               clock: Callable[[], float]) -> Callable[[int], Optional[Signal]]:
        from raytrain_ddp.worker.preemption import Signal

        fired_at: list[float] = []

        def poll(step: int) -> Optional[Signal]:
            signal = real(step)  # keep the real collective in the path
            if signal is not None or attempt != self.attempt or step < self.step:
                return signal
            if not fired_at:
                fired_at.append(clock())
            deadline = None if self.deadline_s is None else fired_at[0] + self.deadline_s
            return Signal(deadline, self.ranks)

        return poll


class TestHooks(Hooks):
    """The hooks a test asks for through the environment (see the module docstring)."""

    __test__ = False  # not a pytest class

    def __init__(self, fault: Optional[FaultPlan] = None, preemption: Optional[SimulatedPreemption] = None,
                 start_fault: Optional[StartFault] = None) -> None:
        self.fault, self.preemption, self.start_fault = fault, preemption, start_fault
        self.world_rank, self.attempt, self.next_step = 0, 1, 1
        self.world_size, self.rows = 1, []  # RAYTRAIN_DDP_SAMPLE_LOG
        self.current_step = 0  # the step being trained (before_step): the pending lines' step

    def before_process_group(self, world_rank: int) -> None:
        plan = PortFault.from_env()
        if plan is None:
            return
        from raytrain_ddp.driver.torchrun import DRIVER_PID_ENV  # set in the torchrun launcher's ranks only

        if DRIVER_PID_ENV in os.environ:
            if plan.due(world_rank):
                _fail_listen(world_rank)
        else:
            plan.take_next_pick(world_rank)

    def on_start(self, rank: "Rank") -> None:
        if self.start_fault is not None:
            self.start_fault.strike_if_due(rank.world_rank, "start")

    def on_attempt(self, rank: "Rank", attempt: int, module: Any) -> None:
        if self.start_fault is not None:
            self.start_fault.strike_if_due(rank.world_rank, "joined")
        self.world_rank, self.attempt = rank.world_rank, attempt
        self.world_size, self.rows = rank.world_size, []
        if self.fault is not None and self.fault.mode == "nan":
            module.register_forward_hook(self._poison)
        if self.fault is not None and self.fault.mode in ("midstep", "validation"):
            module.register_forward_hook(self._die_midstep)
        if os.environ.get(SAMPLE_LOG_ENV):
            module.register_forward_pre_hook(self._record, with_kwargs=True)

    def on_validator(self, module: Any) -> None:
        if self.fault is not None and self.fault.mode == "validation":
            module.register_forward_hook(self._die_validating)

    def _die_validating(self, module: Any, inputs: Any, output: Any) -> Any:
        """run.validation=async: the validator's copy validates the epoch end at or after the
        fault's step, on rank 0's thread, while the loop trains on: this process dies there."""
        step = self.next_step - 1
        if self.fault.rank == self.world_rank and step >= self.fault.step and self.fault.attempt in (0, self.attempt):
            self.fault.strike(self.world_rank, step)
        return output

    def _record(self, module: Any, args: Any, kwargs: Any) -> None:
        import hashlib

        if not module.training:
            return
        first = args[0] if args else next(iter(kwargs.values()))
        rows = [hashlib.blake2b(row.tobytes(), digest_size=8).hexdigest()
                for row in first.detach().cpu().contiguous().numpy()]
        self.rows.extend(rows)
        self._write_line("pending", self.current_step, rows)  # durable before the step's exchange

    def before_step(self, step: int) -> None:
        self.current_step = step

    def _write_samples(self, step: int) -> None:
        self._write_line("samples", step, self.rows)
        self.rows = []

    def _write_line(self, kind: str, step: int, rows: list[str]) -> None:
        """One line of `<kind>-rank<r>-<pid>.jsonl`: `samples`, a finished step's rows (written
        after it); `pending`, one forward's rows as it runs. A rank killed between its step's
        exchange and the samples line (a lost node) leaves only the pending lines of a step
        the survivors committed."""
        import json

        out = Path(os.environ[SAMPLE_LOG_ENV]) / f"{kind}-rank{self.world_rank}-{os.getpid()}.jsonl"
        out.parent.mkdir(parents=True, exist_ok=True)
        line = {"attempt": self.attempt, "step": step, "rank": self.world_rank, "world_size": self.world_size,
                "time": time.time(), "rows": rows}
        with open(out, "a") as handle:
            handle.write(json.dumps(line) + "\n")

    def _poison(self, module: Any, inputs: Any, output: Any) -> Any:
        if module.training and self.fault.hits(self.world_rank, self.next_step, self.attempt):
            return output * math.nan
        return output

    def _die_midstep(self, module: Any, inputs: Any, output: Any) -> Any:
        in_mode = module.training == (self.fault.mode == "midstep")  # validation: an eval-mode forward
        if in_mode and self.fault.hits(self.world_rank, self.next_step - 1, self.attempt):
            self.fault.strike(self.world_rank, self.next_step - 1)
        return output

    def after_step(self, step: int) -> None:
        self.next_step = step + 1
        if os.environ.get(STEP_DELAY_ENV):
            time.sleep(float(os.environ[STEP_DELAY_ENV]))
        if os.environ.get(SAMPLE_LOG_ENV):
            self._write_samples(step)
        if (self.fault is not None and self.fault.mode not in ("nan", "midstep", "validation")
                and self.fault.hits(self.world_rank, step, self.attempt)):
            self.fault.strike(self.world_rank, step)

    def preemption_source(self, real: Callable[[int], Any]) -> Optional[tuple[Callable[[int], Any], float]]:
        if self.preemption is None:
            return None
        return self.preemption.source(self.attempt, real, time.time), 0.0


def from_env() -> Hooks:
    """`RAYTRAIN_DDP_HOOKS=<this file>:from_env`: the plans set in the environment."""
    return TestHooks(FaultPlan.from_env(), SimulatedPreemption.from_env(), StartFault.from_env())
