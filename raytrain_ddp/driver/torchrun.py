"""`scaling.launcher: torchrun`: the workers of one machine started by `torch.distributed.run`,
with no Ray at all (issue #39), the way Ray Train V2's local mode runs under torchrun.

Owns: the `torchrun` row's launcher (`TorchrunLauncher`, launch/table.py: torchrun started first,
in its own session, so its processes import torch while this one reads the data once; the job
and its rows handed to the ranks in one pickle) and each rank's (`rank_main`, run as
`python -m raytrain_ddp.driver.torchrun`: the
process group from torchrun's environment, then the same loop as every other host, through
`worker/runtime.LocalRuntime`). Rank 0's records reach the driver's `Recorder` through a
local socket (`MailboxServer` / `MailboxClient`, the calls of `stream.LocalMailbox`).
A user's own `torchrun --nproc-per-node=N -m raytrain_ddp train ...` runs the same fit
(`under_torchrun`, `torchrun_config`): rank 0 is the driver and rank 0 (`RankZeroLauncher`),
the other ranks take its job from torchrun's store (`follow_rank_0`); all run `run_rank`.
Must not touch: the loop, the data's order (`ExactReader`: every rank gets the whole table,
as on Ray under data.sharding=exact, so the weights are the Ray path's bit for bit), files.

A launch whose ranks' process group failed to form for a reason a new launch can mend (a taken
port, a peer not reachable yet) is stopped and started again, at most `START_TRIES` launches,
each failed one an attempt (as Ray's failed starts: `driver/startup.py`).

What it does not do, said in docs/usage.md#torchrun: restarts (a rank that dies ends the run:
status failed; the same command resumes from the last checkpoint), elastic sizes, more than
this machine, Ray Data's streaming or sharded paths.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from multiprocessing.connection import Client, Listener
from typing import Any, Optional

from raytrain_ddp.config import Config
from raytrain_ddp.driver.local import LocalLauncher
from raytrain_ddp.errors import START_TRIES, start_fault


DRIVER_PID_ENV = "RAYTRAIN_DDP_TORCHRUN_DRIVER"  # the ranks wait for their job while this process runs
PAYLOAD_WAIT_S = 600.0  # and no longer (a driver that hangs before writing it)
START_FAULT_SUFFIX = ".start-fault"  # beside the payload: a rank's process group failed to form, mendably


class MailboxServer:
    """Serves a `LocalMailbox` to rank 0's process: one thread, one connection, calls in order."""

    def __init__(self, mailbox: Any) -> None:
        self.mailbox, self.authkey = mailbox, secrets.token_bytes(16)
        self._listener = Listener(("127.0.0.1", 0), authkey=self.authkey)
        self._thread = threading.Thread(target=self._serve, name="raytrain-ddp-torchrun-mailbox", daemon=True)
        self._thread.start()

    def client(self) -> "MailboxClient":
        return MailboxClient(self._listener.address, self.authkey)

    def _serve(self) -> None:
        while True:
            try:
                conn = self._listener.accept()
            except OSError:  # closed
                return
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: Any) -> None:
        with conn:
            while True:
                try:
                    method, args = conn.recv()
                except (EOFError, OSError):
                    return
                conn.send(getattr(self.mailbox, method)(*args))

    def close(self) -> None:
        self._listener.close()


class MailboxClient:
    """Rank 0's end: the mailbox's calls over the socket (picklable: it connects on first use).
    Every call `LocalMailbox` answers for the loop's side is here (a missing one ends rank 0 at
    its first use: tests/local/unit/test_torchrun_mailbox.py holds the two lists together)."""

    def __init__(self, address: Any, authkey: bytes) -> None:
        self.address, self.authkey = address, authkey
        self._conn: Any = None
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        return {"address": self.address, "authkey": self.authkey}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["address"], state["authkey"])  # type: ignore[misc]

    def _call(self, method: str, *args: Any) -> Any:
        with self._lock:
            if self._conn is None:
                self._conn = Client(self.address, authkey=self.authkey)
            self._conn.send((method, args))
            return self._conn.recv()

    def attempt(self, record: dict[str, Any]) -> int:
        return self._call("attempt", record)

    def put(self, event: dict[str, Any]) -> None:
        self._call("put", event)

    def flush(self, attempt: int = 0, sent: int = 0, timeout_s: float = 10.0) -> bool:
        return True  # every put was answered: it is queued

    def stop_requested(self) -> bool:
        return bool(self._call("stop_requested"))

    def durable_for(self, attempt: int) -> int:
        """The newest step of `attempt` that metrics.jsonl durably holds (`Outbox.durable_step`)."""
        return int(self._call("durable_for", attempt))

    def request_stop(self) -> None:
        self._call("request_stop")


STOP_WAIT_S = 10.0  # how long a stop before the job waits for the killed processes to be gone


class TorchrunLaunch:
    """torchrun started for a fit whose job is not written yet: its agent and ranks import
    torch while the driver does, and each rank waits for `payload` (`_wait_for_payload`),
    which appears at once, whole (`hand_over`: written beside it, then renamed). `stop()`
    ends it (its agent stops its ranks) and removes the payload; it is a no-op once torchrun
    has exited. `TorchrunLauncher` starts one for each launch."""

    def __init__(self, cfg: Config) -> None:
        self.dir = tempfile.mkdtemp(prefix="raytrain_ddp_torchrun_")  # the payload, torchrun's log dir
        self.payload = os.path.join(self.dir, "job.pkl")
        self.began = time.time()
        self.proc = subprocess.Popen(torchrun_command(cfg, self.payload, log_dir=os.path.join(self.dir, "torchrun")),
                                     env=_rank_env(cfg), start_new_session=True)  # Ctrl-C reaches the driver only

    def hand_over(self, given: dict[str, Any]) -> None:
        with open(self.payload + ".part", "wb") as handle:
            pickle.dump(given, handle)
        os.replace(self.payload + ".part", self.payload)

    def wait(self) -> tuple[int, Optional[str]]:
        """torchrun's exit code, or (1, the cause) once a rank said its process group failed to
        form for a reason a new launch can mend (`_start_fault`): the launch is then stopped."""
        while True:
            try:
                return self.proc.wait(timeout=0.05), None
            except subprocess.TimeoutExpired:
                pass
            if os.path.exists(self.payload + START_FAULT_SUFFIX):
                with open(self.payload + START_FAULT_SUFFIX) as handle:
                    cause = handle.read()
                os.remove(self.payload)  # stopped as before its job: quietly (`stop`)
                self.stop()
                return 1, cause

    def stop(self) -> None:
        """Never waits on a stopped process, nor longer than its bounds; leaves no process of
        this launch and no temp dir."""
        if os.path.exists(self.payload):
            _stop(self.proc)  # ranks at work: the agent stops them
        elif self.proc.poll() is None:  # no job yet (a refusal): nothing to stop gracefully (torchrun's
            _signal_group(self.proc, signal.SIGKILL)  # SIGTERM handling printed a traceback under the one line)
        _kill_naming(self.payload, STOP_WAIT_S)  # its ranks, each in a session of its own (the agent starts no more)
        try:
            self.proc.wait(timeout=STOP_WAIT_S)  # killed: reaped at once
        except subprocess.TimeoutExpired:
            pass
        shutil.rmtree(self.dir, ignore_errors=True)


class TorchrunLauncher(LocalLauncher):
    """This machine's torchrun starts the ranks (launch/base.py's `Launcher`): started at
    construction (the CLI's, before it imports torch: the row's `early_start`), so that its
    processes import torch while this one reads the rows (as local mode, once, for every rank)
    and plans the job. Rank 0's records come through the mailbox served over a local socket."""

    def __init__(self, cfg: Config) -> None:
        super().__init__(cfg)
        self.cfg, self.launch, self.server = cfg, TorchrunLaunch(cfg), None
        self.start_: Any = None

    def start(self, start: Any, given: Optional[dict[str, Any]]) -> tuple[Any, Any]:
        self.start_ = start
        prepared, mailbox = super().start(start, given)
        self.server = MailboxServer(mailbox)
        return prepared, mailbox

    def run(self, job: Any, recorder: Any, interrupt: Any) -> tuple[str, Optional[str]]:
        """The job handed to the waiting ranks; a launch whose process group did not form for a
        mendable reason is started again (fresh ports), at most `START_TRIES` launches."""
        assert self.server is not None
        mailbox, job = job.mailbox, dataclasses.replace(job, mailbox=self.server.client())
        given = {"job": job, "shards": self.shards, "run_dir": self.run_dir}
        try:
            self.launch.hand_over(given)
            interrupt.register()
            (code, cause), launches = self.launch.wait(), 1
            while cause is not None and not interrupt.fired and launches < START_TRIES:  # mendable: fresh ports
                self._relaunch(given, mailbox, job.fit_id, cause, launches)
                (code, cause), launches = self.launch.wait(), launches + 1
        finally:
            self.launch.stop()  # the second Ctrl-C, an error: the ranks stop now
        if cause is not None:  # the tries spent (or a Ctrl-C between them)
            return ("interrupted", None) if interrupt.fired else \
                ("failed", f"the ranks' process group did not form, {launches} times: {cause}")
        if code != 0:
            return "failed", f"a torchrun rank exited with code {code} (its output is above)"
        return "ok", None

    def close(self) -> None:
        self.launch.stop()  # a refusal or an error before the ranks got their payload: they wait for none
        if self.server is not None:
            self.server.close()

    def _relaunch(self, given: dict[str, Any], mailbox: Any, fit_id: str, cause: str, tried: int) -> None:
        """A new torchrun for the same job after a start that `cause` failed: the failed start is an
        attempt of its own (said in one line by the recorder, `driver/startup.py`), in the timeline too."""
        now, timeline = time.time(), self.start_.timeline
        mailbox.attempt({"fit_id": fit_id, "world_size": self.cfg.scaling.num_workers, "time": now,
                         "start_failed": cause, "try": tried, "tries": START_TRIES})
        timeline.controller({"begin": self.launch.began, "failed": now})
        timeline.controller({"begin": now})  # the new launch's start; its ranks stamp the rest
        self.launch = TorchrunLaunch(self.cfg)
        self.launch.hand_over(given)


def _start_fault(payload: str, exc: BaseException) -> None:
    """A rank whose process group failed to form for a reason a new launch can mend (a taken
    port, a peer not reachable yet: `errors.start_fault`) tells the driver, which stops this
    launch and starts another (`TorchrunLaunch.wait`); it waits to be stopped, printing nothing."""
    cause = start_fault(exc)
    if cause is None:
        return
    with open(payload + START_FAULT_SUFFIX + ".part", "w") as handle:
        handle.write(cause)
    os.replace(payload + START_FAULT_SUFFIX + ".part", payload + START_FAULT_SUFFIX)
    time.sleep(STOP_WAIT_S * 3)
    os._exit(1)


def _kill_naming(text: str, timeout_s: float) -> None:
    """SIGKILL every process whose command line holds `text` (this launch's private payload path:
    its agent, its ranks, a rank the agent was forking as it was stopped, whose command line is
    still the agent's), until none is left or `timeout_s` passed (a kill is done when the process
    is gone or a zombie, whose command line is empty)."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = [pid for pid in _pids() if text.encode() in _cmdline(pid)]
        if not left or time.monotonic() > deadline:
            return
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:  # gone meanwhile
                pass
        time.sleep(0.05)


def _pids() -> list[int]:
    return [int(entry) for entry in (os.listdir("/proc") if os.path.isdir("/proc") else []) if entry.isdigit()]


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            return handle.read()
    except OSError:
        return b""


def _stop(proc: subprocess.Popen) -> None:
    """torchrun's session, stopped (its agent stops its ranks) if it still runs: SIGTERM (and
    SIGCONT, so a stopped agent takes it), then SIGKILL after 30 s."""
    if proc.poll() is None:
        _signal_group(proc, signal.SIGTERM)
        _signal_group(proc, signal.SIGCONT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            _signal_group(proc, signal.SIGKILL)


def _signal_group(proc: subprocess.Popen, signum: int) -> None:
    try:
        os.killpg(proc.pid, signum)
    except ProcessLookupError:  # the group is gone already
        pass


def torchrun_command(cfg: Config, payload: str, log_dir: Optional[str] = None) -> list[str]:
    """`python -m torch.distributed.run` on this machine, each rank running `rank_main`.

    The rendezvous store listens on a port the OS gives it when it binds (endpoint port 0,
    as `torchrun --standalone`), and the ranks' process group forms through that same
    store: a port picked here and bound later by torchrun could be taken in between by
    another process of a busy machine (a Ray instance starting, another run).
    """
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={cfg.scaling.num_workers}",
            "--nnodes=1", "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0", f"--rdzv-id={uuid.uuid4().hex}",
            "--local-addr=127.0.0.1", *([f"--log-dir={log_dir}"] if log_dir else []),  # else torchrun leaves
            "-m", "raytrain_ddp.driver.torchrun", payload]  # a torchelastic_* directory in the temp dir


def _rank_env(cfg: Config) -> dict[str, str]:
    """The ranks' environment: OMP_NUM_THREADS as Ray gives a worker of cpus_per_worker CPUs
    (torchrun would set 1, and say so); a user's own value wins."""
    env = {**os.environ, DRIVER_PID_ENV: str(os.getpid())}
    env.setdefault("OMP_NUM_THREADS", str(max(1, int(cfg.scaling.cpus_per_worker))))
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def rank_main(payload: str, stamps: Optional[dict[str, float]] = None) -> None:
    """One rank of a `TorchrunLaunch`: its job from the driver's payload, then `run_rank`."""
    from raytrain_ddp.worker.optim import preload_optimizer_imports

    preload_optimizer_imports()  # while the driver plans (issue #39)
    stamps = dict(stamps or {}, workers_up=time.time())  # this process up, torch imported
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the driver asks for a stop through the mailbox
    _wait_for_payload(payload, int(os.environ[DRIVER_PID_ENV]))
    with open(payload, "rb") as handle:
        given = pickle.load(handle)
    run_rank(given, stamps, on_start_fault=lambda exc: _start_fault(payload, exc))


def run_rank(given: dict[str, Any], stamps: dict[str, float], on_start_fault: Any = None) -> None:
    """This rank's process group from torchrun's environment, then the loop on `given`'s job."""
    import datetime

    import torch
    import torch.distributed as dist

    from raytrain_ddp.parallel.watch import process_group_timeout_s
    from raytrain_ddp.worker.context import Rank, quiet_worker_console
    from raytrain_ddp.worker.hooks import load_hooks
    from raytrain_ddp.worker.loop import train_loop_per_worker
    from raytrain_ddp.worker.runtime import LocalRuntime

    job = given["job"]
    cfg = job.cfg
    world_rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", world_rank))
    device = torch.device("cuda", local_rank) if cfg.scaling.use_gpu else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = process_group_timeout_s(cfg.parallel.collective_timeout_s, cfg.scaling.use_gpu)
    try:
        load_hooks().before_process_group(world_rank)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                timeout=datetime.timedelta(seconds=timeout))
    except Exception as exc:
        if on_start_fault is not None:
            on_start_fault(exc)  # a fault a new launch can mend: the driver starts one
        raise
    stamps["process_group"] = time.time()
    quiet_worker_console()
    rank = Rank(world_rank, world_size, local_rank, device)
    try:
        train_loop_per_worker({"job": job, "startup_stamps": stamps,
                               "runtime": LocalRuntime(given["shards"], given["run_dir"], device, rank=rank)})
    finally:
        dist.destroy_process_group()


def under_torchrun() -> Optional[tuple[int, int, int]]:
    """(RANK, WORLD_SIZE, LOCAL_WORLD_SIZE) where a user's torchrun started this process
    (`torchrun --nproc-per-node=N -m raytrain_ddp train ...`), else None."""
    env = os.environ
    if "TORCHELASTIC_RUN_ID" not in env or "RANK" not in env or "WORLD_SIZE" not in env:
        return None
    return int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_WORLD_SIZE", env["WORLD_SIZE"]))


def torchrun_config(path: Any, overrides: list[str], world_size: int, local_world_size: int) -> Config:
    """The config of a fit a user's torchrun started: that of `raytrain-ddp train ...
    scaling.launcher=torchrun scaling.num_workers=WORLD_SIZE`; a scaling key the file or the
    command sets otherwise, or ranks on more than this machine, refused in one line."""
    from raytrain_ddp.config import ConfigError, load_config
    from raytrain_ddp.config.load import read_config

    scaling = read_config(path, overrides).get("scaling") or {}
    if local_world_size != world_size:
        raise ConfigError(f"torchrun started {world_size} ranks, {local_world_size} on this machine: "
                          "scaling.launcher=torchrun runs on one machine (--nnodes=1); for more, scaling.launcher=ray")
    if scaling.get("num_workers", world_size) != world_size:
        raise ConfigError(f"scaling.num_workers={scaling['num_workers']} but torchrun started WORLD_SIZE={world_size} "
                          f"ranks: set scaling.num_workers={world_size}, or leave it out (torchrun's count is taken)")
    if scaling.get("launcher", "torchrun") != "torchrun":
        raise ConfigError(f"scaling.launcher={scaling['launcher']} but torchrun started this fit's ranks: "
                          "set scaling.launcher=torchrun, or leave it out")
    return load_config(path, [*overrides, "scaling.launcher=torchrun", f"scaling.num_workers={world_size}"])


class RankZeroLauncher(LocalLauncher):
    """Rank 0 of a user's `torchrun --nproc-per-node=N ... train` (launch/base.py's `Launcher`):
    this process runs the fit's steps and is rank 0; the job and the rows reach the other ranks
    (`follow_rank_0`) through the store torchrun serves at MASTER_ADDR:MASTER_PORT, rank 0's
    records the recorder through the mailbox served here, as `TorchrunLauncher`'s do."""

    def __init__(self, cfg: Any = None) -> None:
        super().__init__(cfg)
        self.server: Optional[MailboxServer] = None
        self.handed = False

    def start(self, start: Any, given: Optional[dict[str, Any]]) -> tuple[Any, Any]:
        prepared, mailbox = super().start(start, given)
        self.server = MailboxServer(mailbox)
        return prepared, mailbox

    def run(self, job: Any, recorder: Any, interrupt: Any) -> tuple[str, Optional[str]]:
        assert self.server is not None
        given = {"job": dataclasses.replace(job, mailbox=self.server.client()), "shards": self.shards,
                 "run_dir": self.run_dir}
        self._hand_over(given)
        interrupt.register()
        run_rank(given, {"workers_up": time.time()})
        return "ok", None

    def close(self) -> None:
        self._hand_over(None)  # a refusal, nothing to train, an error before the job: the ranks end quietly
        if self.server is not None:
            self.server.close()

    def _hand_over(self, given: Optional[dict[str, Any]]) -> None:
        if not self.handed:
            self.handed = True
            _store().set(_job_key(), pickle.dumps(given))


def follow_rank_0() -> int:
    """A rank other than 0 of a user's torchrun: rank 0's job, then `run_rank`; none (rank 0
    refused, or found nothing to train, and said so): exit 0, printing nothing."""
    from raytrain_ddp.worker.optim import preload_optimizer_imports

    preload_optimizer_imports()
    stamps = {"workers_up": time.time()}
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 asks for a stop
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # torchrun's agent stopping its ranks: no line from each
    store, deadline = _store(), time.monotonic() + PAYLOAD_WAIT_S
    while not store.check([_job_key()]):  # polled: a signal is taken between two checks
        if time.monotonic() > deadline:
            raise SystemExit(f"raytrain-ddp: torchrun rank: no job from rank 0 after {PAYLOAD_WAIT_S:.0f} s")
        time.sleep(0.05)
    given = pickle.loads(store.get(_job_key()))
    if given is not None:
        run_rank(given, stamps)
    return 0


def _store() -> Any:
    """A client of the store torchrun's agent serves to its ranks (TORCHELASTIC_USE_AGENT_STORE)."""
    import datetime

    import torch.distributed as dist

    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         timeout=datetime.timedelta(seconds=PAYLOAD_WAIT_S))


def _job_key() -> str:  # one per start of the ranks (torchrun --max-restarts starts them again)
    return f"raytrain_ddp/job/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def _wait_for_payload(payload: str, driver_pid: int, timeout_s: float = PAYLOAD_WAIT_S) -> None:
    """Until the driver has written this fit's payload. Exits if the driver or this rank's
    torchrun agent is gone first (the agent stops its ranks when asked; one SIGKILLed cannot)."""
    from raytrain_ddp.driver.hold import pid_runs

    deadline, agent = time.monotonic() + timeout_s, os.getppid()
    while not os.path.exists(payload):
        if os.getppid() != agent or not pid_runs(driver_pid):  # the driver stopped it, or died: its console
            os._exit(1)  # has the reason, a line from each rank would only repeat it
        if time.monotonic() > deadline:
            raise SystemExit(f"raytrain-ddp: torchrun rank: no job at {payload} after {timeout_s:.0f} s")
        time.sleep(0.01)


if __name__ == "__main__":
    rank_main(sys.argv[1])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # the loop's work is done and flushed: skip the interpreter's teardown of torch
