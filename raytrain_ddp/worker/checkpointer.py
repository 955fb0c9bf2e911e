"""When to save and where to start: the checkpoint cadence of one worker group.

Owns: restoring the state a worker group starts from (and saying where from: scratch, a
durable checkpoint, or a survivor's copy); saving at the cadences a run has — periodic
(`run.checkpoint_every_steps`; `auto`: Young's interval from the run's own measurements,
chosen again at each worker group's start, `goodput.py`), just-in-time before a preemption (`preemption.py`
decides when), at every epoch end, which is also the final save, and when a peer dies
(each survivor writes the last completed step: `replica.py`);
handing each checkpoint to `ray.train.report`, and measuring how long each one held the
step loop. Must not touch: what a checkpoint holds (`state.py`), the file format
(`checkpoint.py`), training, the run directory's files (checkpoints reach storage
through Ray's upload, and come back through `ray.train.get_checkpoint()`).

Why only rank 0 writes and every rank reports: all ranks hold identical state after a
step, and `ray.train.report` is a barrier, so no rank runs ahead of a checkpoint that is
not yet reported.

Why asynchronous upload (`run.checkpoint_upload: async`, Ray 2.60's
`checkpoint_upload_mode=ASYNC`): a synchronous report waits for the copy to storage and
then for Ray Train's controller to poll (every 2 s), which stalls the step loop for the
poll at every checkpoint (docs/design.md#measurements-behind-the-code). With ASYNC, rank 0 serialises the state into a local staging directory
(that copy is what the checkpoint holds: training may go on at once), the ranks agree
on the directory name, and Ray uploads in a background thread, deletes the staging
copy, and only then registers the checkpoint. A crash mid-upload therefore never makes
the half-copied directory Ray's latest, and on storage it fails the manifest check
(`checkpoint.py`), so a resume takes the newest *valid* one. Just-in-time saves before
a preemption stay synchronous: they must be in storage before the node goes. When a
training function returns, Ray waits for the uploads still running.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional, Sequence

import pyarrow.fs as pafs

from raytrain_ddp import checkpoint as ckpt
from raytrain_ddp.goodput import PROBE_STEPS
from raytrain_ddp.job import Job
from raytrain_ddp.parallel.collectives import check_same, from_main, max_over_ranks
from raytrain_ddp.rundir import Location
from raytrain_ddp.worker.context import Rank
from raytrain_ddp.worker.meter import RunLog
from raytrain_ddp.worker.preemption import PreemptionGuard
from raytrain_ddp.recovery.replica import WINDOW, is_peer_loss, write_last_step, written_by_survivor
from raytrain_ddp.worker.runtime import RayTrainRuntime
from raytrain_ddp.worker.state import TrainState

if TYPE_CHECKING:
    from raytrain_ddp.worker.hooks import Hooks
    from raytrain_ddp.worker.runtime import Runtime

STAGING_PREFIX, STAGING_NAME_SEP = "raytrain_ddp_ckpt_", "--"  # rank 0's staging copy: <prefix><random>--<name>
MAX_PENDING_UPLOADS = 2  # staging copies waiting for Ray's asynchronous upload, at most
UPLOAD_WAIT_S = 600.0  # bounded: a stuck upload delays the next checkpoint, never hangs the run


class Checkpointer:
    """`before_report`: asked before each save, False skips it (live recovery: a member is gone);
    `agree`: the preemption poll's agreement (`PreemptionGuard`), default a MAX all-reduce."""

    def __init__(self, job: Job, rank: Rank, state: TrainState, log: RunLog, hooks: Hooks,
                 runtime: Optional[Runtime] = None, *, before_report: Optional[Callable[[], bool]] = None,
                 agree: Optional[Callable[[Sequence[float]], list[float]]] = None) -> None:
        self.job, self.rank, self.state, self.log = job, rank, state, log
        self.runtime = runtime or RayTrainRuntime()  # where checkpoints go (worker/runtime.py)
        self.every = job.cfg.run.checkpoint_every_steps  # "auto": chosen in `restore` (`choose_auto`)
        self.every_epochs = getattr(job.cfg.run, "checkpoint_every_epochs", 1)
        self._signalled_at_epoch_end = False  # a preemption signal at an epoch's last step: that epoch end saves
        self._probe_from: Optional[tuple[int, float]] = None  # auto, unmeasured: (step, time) the attempt began
        self.upload = getattr(job.cfg.run, "checkpoint_upload", "async")
        self._hooks, self._agree, self._before_report = hooks, agree, before_report
        self.guard = self._new_guard()
        # The newest step known to be in storage: a survivor's copy must be newer. An
        # asynchronous save does not count: its upload runs in rank 0's process, and a kill
        # of rank 0 before it finished left a restart with nothing (issue #25).
        self.saved_step = 0
        self.last_saved = ""  # the name of this group's newest checkpoint
        self._copied_step, self._copy_lock = 0, threading.Lock()
        self._last_blocked = 0.0  # the newest save's stall
        self._staged: list[str] = []  # rank 0's staging copies Ray has not uploaded (and deleted) yet
        if state.last_step is not None:
            WINDOW.attach(self.write_copy)  # Ray's shutdown call writes it if the loop cannot

    @classmethod
    def resume(cls, job: Job, rank: Rank, state: TrainState, log: RunLog, hooks: Hooks,
               accumulation_steps: int, runtime: Optional[Runtime] = None, **composed: Any) -> "Checkpointer":
        """A checkpointer for this worker group, with `state` restored from where the fit stands
        (`composed`: the constructor's keywords)."""
        checkpointer = cls(job, rank, state, log, hooks, runtime, **composed)
        checkpointer.restore(accumulation_steps)
        return checkpointer

    def _new_guard(self) -> PreemptionGuard:
        """Spot reclaims, and the driver's Ctrl-C (rank 0 asks the driver at the same polls)."""
        return PreemptionGuard.for_worker(self.job.cfg, self.rank, self._hooks,
                                          stop_source=self.log.outbox.stop_requested,
                                          real=self.runtime.preemption_source(), agree=self._agree)

    def restart_preemption_poll(self) -> None:
        """The preemption poll's schedule from scratch, as a new worker's: after live recovery
        re-formed the group, every member polls at the same steps again."""
        self.guard = self._new_guard()

    def restore(self, accumulation_steps: int) -> None:
        """Load the newest valid checkpoint of this fit (or the driver's choice) into every component."""
        if self.rank.is_main:
            for where in publish_orphaned_uploads(self.job, self.runtime.run_dir(self.job.run_dir)):
                self.rank.say(f"uploaded {where}: its asynchronous upload had died with an earlier rank 0")
        max_over_ranks([0.0], self.rank.device)  # a barrier: every rank lists storage after that
        found = find_resume_state(self.job, self.runtime)
        if found is not None:
            self.state.load_state_dict(found[0])
        step = self.state.progress.step
        manifest = _manifest_of(found[1]) if found else {}
        survivor = written_by_survivor(manifest)
        origin = {"resumed_from": "scratch"} if found is None else {
            "resumed_from": "checkpoint" if survivor is None else "replica", "checkpoint": found[1].name}
        self.log.resumed_at(step, origin, lines=manifest.get("lines", []))  # the driver takes those it lacks
        check_same(step, "the step to resume from", self.rank.device)
        self.saved_step = step
        if found is None:
            where = "scratch"
        elif survivor is not None:
            where = f"step {step}, the last completed one, written by surviving rank {survivor} ({found[1]})"
        else:
            where = f"checkpoint {found[1]} (step {step})"
            if self.log.attempt > 1 and self.state.last_step is not None:
                where = ("the newest durable " + where + ", falling back: no survivor wrote a later step "
                         "(every worker was lost, or none finished writing before Ray stopped it)")
        workers, micro = self.rank.world_size, accumulation_steps
        self.rank.say(f"attempt {self.log.attempt}: {workers} worker{'s' * (workers != 1)} on {self.rank.device}, "
                      f"{micro} micro-step{'s' * (micro != 1)} per optimizer step, starting from {where}")
        if self.job.cfg.run.checkpoint_every_steps == "auto":
            self.choose_auto()

    def choose_auto(self, measured: Optional[dict[str, float]] = None) -> None:
        """`run.checkpoint_every_steps: auto`: Young's interval, chosen by rank 0 from the run
        directory's figures (`goodput.cadence_inputs`), or from `measured` (this attempt's first
        save), the same on every rank, said in one line. Until a save was measured: a probe save
        `PROBE_STEPS` into the attempt (`every` 0 meanwhile)."""
        from raytrain_ddp.goodput import auto_interval, cadence_inputs

        steps = 0
        if self.rank.is_main:
            inputs = cadence_inputs(self.runtime.run_dir(self.job.run_dir), self.job.cfg.run.expected_mtbf_s,
                                    self.job.fit_id)
            chosen, why = auto_interval({**inputs, **(measured or {})})
            steps = chosen or 0
            self.rank.say(why)
        self.every = int(from_main(steps, self.rank.device))
        self._probe_from = (self.state.progress.step, time.perf_counter()) if not self.every else None

    @contextlib.contextmanager
    def last_step_on_peer_loss(self) -> Iterator[None]:
        """Around the step loop: a collective that lost its peer first leaves the last step behind."""
        try:
            yield
        except BaseException as exc:
            if self.state.last_step is not None and is_peer_loss(exc):
                WINDOW.enter("writing")  # Ray's shutdown of this worker waits for it (GraceForSurvivors)
                first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:160]
                self.write_copy(f"a collective failed ({first}): a peer was lost")
            raise
        finally:
            WINDOW.enter("ended")

    def write_copy(self, why: str) -> None:
        """Write the last completed step as a survivor's copy (`replica.py`), once per step.

        Called by the step loop's thread when its collective fails, or by Ray's thread
        when Ray stops the group while the loop is blocked (`CopyWindow`). Never raises:
        the original failure is what Ray must see, and the durable checkpoint is the fallback.
        """
        with self._copy_lock:
            state = self.state.last_step_state_dict()
            say = f"[rank {self.rank.world_rank}] {why}"
            if state is None:
                print(f"{say}; an optimizer step held the state: no copy", flush=True)
                return
            step = int(state["progress"]["step"])
            if step <= max(self.saved_step, self._copied_step):
                print(f"{say}; step {step} is already in a checkpoint", flush=True)
                return
            lines = [r for r in list(self.log.step_lines) if r.get("step") == step]
            try:
                where, took = write_last_step(state, self.runtime.run_dir(self.job.run_dir), self.job.fit_id,
                                              self.rank.world_rank, lines=lines)
            except Exception as exc:  # noqa: BLE001 - the durable checkpoint is the fallback
                print(f"{say}; could not write the last completed step {step}: {exc}", flush=True)
                return
            self._copied_step = step
            print(f"{say}; wrote the last completed step {step} to {where} in {took:.2f}s", flush=True)

    def _wait_for_uploads(self) -> None:
        """At most `MAX_PENDING_UPLOADS` staging copies wait for Ray's background upload.

        Ray deletes a staging copy once it is uploaded; a cadence faster than the uploads
        (the tiny config checkpointing every 5 steps) otherwise queues a full copy on local
        disk per checkpoint, all left behind when the run is interrupted.
        The wait counts as checkpoint time (`checkpoint_blocked_s`).
        """
        deadline = time.monotonic() + UPLOAD_WAIT_S
        while True:
            self._staged = [path for path in self._staged if os.path.exists(path)]
            if len(self._staged) < MAX_PENDING_UPLOADS or time.monotonic() > deadline:
                return
            time.sleep(0.05)

    def after_step(self, end_of_epoch: bool) -> bool:
        """Periodic and just-in-time saves, at a step boundary that is not the run's last.

        True: stop here -- the driver asked (Ctrl-C), and this step is now in storage.
        """
        step = self.state.progress.step
        periodic = bool(self.every) and step % self.every == 0
        probe = self._probe_from is not None and step - self._probe_from[0] >= PROBE_STEPS
        signalled = self.guard.after_step(step)  # a collective: the same answer on every rank
        preempted = signalled and not self.guard.stopping
        self._signalled_at_epoch_end = signalled and end_of_epoch
        # Never on an epoch's last step: the epoch-end save follows at the same step,
        # right after validation (a stop then waits for the next boundary).
        if (periodic or signalled or probe) and not end_of_epoch:
            self.save({"loss": self.log.last_loss, **({"preemption": 1} if preempted else {})}, durable=signalled)
            if probe:  # auto's first save on this run: its stall and the steps before it decide
                began_step, began = self._probe_from
                took = self._last_blocked
                self.choose_auto({"save_stall_s": took, "step_s": (time.perf_counter() - began - took)
                                  / max(1, step - began_step)})
            if self.guard.stopping:
                self.log.stopped(step, self.last_saved)
                return True
        return False

    def epoch_end_due(self, epoch: int, last: bool) -> bool:
        """`run.checkpoint_every_epochs`: epoch `epoch` (0-based) has ended; save at every Nth, at
        the run's last step, and where a signal arrived at the epoch's last step."""
        return last or self._signalled_at_epoch_end or (epoch + 1) % self.every_epochs == 0

    def save(self, metrics: dict[str, Any], durable: bool = False) -> Optional[dict[str, Any]]:
        """Rank 0 writes the checkpoint; every rank reports (Ray's report is a barrier).

        `durable`: wait until the checkpoint is in storage (synchronous upload), as a
        just-in-time save before a preemption must. Returns the model's state as saved (rank
        0: whole; `worker/validator.py` validates it), None when the save was skipped.
        """
        if self._before_report is not None and not self._before_report():
            return None
        progress = self.state.progress
        # The epoch position is in the name: a periodic save on a streaming epoch's last
        # window and the epoch-end save can share a step, and must not share a directory.
        name = (f"{ckpt.CHECKPOINT_PREFIX}{progress.step:08d}_e{progress.epoch}"
                f"s{progress.steps_into_epoch}_{self.job.fit_id[:8]}")
        with self.log.paused():
            state = self.state.state_dict()  # on every rank: zero1 / fsdp gather it here (a collective)
            if self.rank.is_main:
                self._wait_for_uploads()
            staged = report_checkpoint((lambda: state) if self.rank.is_main else None,
                                       {"step": progress.step, "epoch": progress.epoch, **metrics}, name,
                                       asynchronous=self.upload == "async" and not durable, runtime=self.runtime,
                                       lines=self.log.lines_to_save())
            self._staged += [staged] if staged else []
        blocked = self._last_blocked = self.log.last_pause_s  # exactly what the step time leaves out
        if self.upload != "async" or durable:  # in storage now (see `saved_step`)
            self.saved_step = progress.step
        self.last_saved = name
        self.log.checkpoint_saved(progress.step, name, blocked, preemption=bool(metrics.get("preemption")))
        # What the preemption policy plans with. Asynchronous saves block for less than
        # a synchronous just-in-time save takes; its own duration replaces this one.
        self.guard.checkpoint_took(blocked)
        return state.get("model")


def report_checkpoint(state_dict: Optional[Any], metrics: dict[str, Any], name: str,
                      asynchronous: bool = True, runtime: "Runtime" = None,
                      lines: Optional[list[dict[str, Any]]] = None) -> Optional[str]:
    """Hand one checkpoint to Ray Train: rank 0 passes `state_dict` (a callable), the others None.

    The state is serialised into a fresh staging directory; Ray copies it to
    `<storage>/<run>/<name>` and deletes the staging copy after the upload (in the
    background when `asynchronous`; in local mode the runtime copies it at once). Shared
    with `raytrain-ddp bench`'s checkpoint section, so the benchmark times exactly this
    path. `lines`: the metrics lines since the previous checkpoint, kept in its manifest.
    Returns rank 0's staging directory (gone once uploaded), None on the other ranks.
    """
    staging = None
    if state_dict is not None:
        staging = tempfile.mkdtemp(prefix=STAGING_PREFIX, suffix=STAGING_NAME_SEP + name)
        ckpt.save_checkpoint(staging, state_dict(), lines=lines)
    try:
        (runtime or RayTrainRuntime()).report(metrics, staging, name, asynchronous)
    except BaseException:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        raise
    return staging


def publish_orphaned_uploads(job: Job, run_dir: Location) -> list[Location]:
    """Rank 0, before a worker group picks its state: this fit's staging copies on this node
    whose asynchronous upload died with an earlier rank 0 go up under their own names.

    Ray uploads from rank 0's process, so a rank 0 killed right after an asynchronous save
    took the upload with it, and a group whose every worker died (one worker, a lost node)
    had no survivor to write the step either: it restarted from an older checkpoint, or
    from scratch (issue #25). The staging copy itself is complete on local disk (the
    manifest is written last); a copy that does not verify is deleted, not uploaded.
    Only this node's copies are found: a rank 0 restarted on another node falls back to
    the survivors' copy or the newest durable checkpoint.
    """
    published = []
    for staging in sorted(Path(tempfile.gettempdir()).glob(f"{STAGING_PREFIX}*{STAGING_NAME_SEP}*")):
        if _manifest_of(staging).get("fit_id") != job.fit_id:
            continue  # half-written (no manifest yet), or another fit's
        target = run_dir / staging.name.split(STAGING_NAME_SEP, 1)[1]
        try:
            ckpt.load_checkpoint(staging)
            if not (target / ckpt.MANIFEST_FILE).exists():
                target.upload_from(staging)
                published.append(target)
        except ckpt.CheckpointError:
            pass  # incomplete: never a candidate
        except OSError as exc:  # storage refused it: the group starts from what storage holds
            print(f"[rank 0] could not upload {staging} to {target}: {exc}", flush=True)
            continue
        shutil.rmtree(staging, ignore_errors=True)
    return published


def find_resume_state(job: Job, runtime: "Runtime" = None) -> Optional[tuple[dict, Any]]:
    """The state this worker group starts from, or None for a fresh start.

    First the newest valid checkpoint this fit wrote: the one Ray offers a restarted
    group, and the fit's others in the run directory, listed through Ray's storage
    filesystem -- Ray registers a checkpoint only when its controller next polls (one
    result per poll), so a worker lost right after a save leaves a complete, verified
    checkpoint Ray does not offer. Then the one the driver chose from `run.resume`.
    Checkpoints of earlier fits that Ray also offers are ignored: the driver already
    applied `run.resume` to them. Nothing here opens the run directory as a local path:
    it may be a bucket.
    """
    runtime = runtime or RayTrainRuntime()
    offered = runtime.offered()
    ours: list[Location] = []
    if offered is not None:
        here = _location_of(offered, job)
        if _fit_id_of(here) == job.fit_id:
            ours.append(here)
    run_dir = ours[0].parent if ours else runtime.run_dir(job.run_dir)
    ours += [p for p in ckpt.find_checkpoints(run_dir) if _fit_id_of(p) == job.fit_id and p.path not in
             {o.path for o in ours}]
    ours.sort(key=_step_of, reverse=True)  # newest first, Ray's offer or not
    candidates = ours + ([Location.parse(job.resume_from)] if job.resume_from else [])
    found = ckpt.load_latest_valid(candidates)
    return (found[0], found[1].plain()) if found else None


def _step_of(where: Location) -> int:
    try:
        return int(ckpt.read_manifest(where).get("step", -1))
    except Exception:  # noqa: BLE001 - unreadable: last
        return -1


def _location_of(offered: Any, job: Job) -> Location:
    """Ray's `Checkpoint` (a filesystem and a path in it) as a `Location` shown like the run directory."""
    fs = getattr(offered, "filesystem", None) or pafs.LocalFileSystem()
    path = str(offered.path).rstrip("/")
    if isinstance(fs, pafs.LocalFileSystem):
        return Location(fs, path, path)
    return Location(fs, path, f"{str(job.run_dir).rstrip('/')}/{path.rsplit('/', 1)[-1]}")


def _fit_id_of(where: Location) -> Optional[str]:
    return _manifest_of(where).get("fit_id")


def _manifest_of(where: Any) -> dict[str, Any]:
    try:
        return ckpt.read_manifest(where)
    except Exception:  # noqa: BLE001 - unreadable manifests are simply not ours
        return {}
