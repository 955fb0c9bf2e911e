"""One fit at a time per run directory: the hold.

Owns: `<run dir>/hold.json` (`rundir.HOLD_FILE`): who holds the run -- host, pid, fit
id, start time, last heartbeat, its resource request's name in Ray --, taking it, the background thread that refreshes its
heartbeat, and releasing it. Must not touch: any other file of the run directory, Ray.

The rules (docs/reliability.md states them for users, with the race window):

* A fit takes the hold before it reads or writes anything else of the run, and releases
  it in a `finally` (normal end, failure, Ctrl-C, SIGTERM) once its Ray instance is down.
* A hold is live unless its holder is gone: on the same host, its pid no longer runs (a
  SIGKILLed driver is taken over at once); anywhere, its heartbeat is older than
  `STALE_S` (a lost head node, another host's dead driver). The holder rewrites its
  heartbeat every `HEARTBEAT_S`. Hosts' clocks are assumed to agree within seconds (NTP).
* A live hold refuses the new fit with `RunHeld` (a `UserError`: exit 2, one line naming
  the holder and the ways on), before Ray starts; the holder's files are untouched.
* Taking is atomic where the store can do it: locally the file is created with `O_EXCL`
  semantics (`Location.create_new`). A dead holder's file, and any file on an object
  store (pyarrow has no conditional PUT), is written, then read back after `SETTLE_S`:
  whoever's record is there then holds the run, the others look again and are refused.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from raytrain_ddp.errors import UserError
from raytrain_ddp.rundir import HOLD_FILE, Location, run_dir_of, unused_name

if TYPE_CHECKING:
    from raytrain_ddp.config import Config

HEARTBEAT_S = 5.0  # the holder rewrites its heartbeat this often
STALE_S = 20.0  # a hold whose heartbeat is older is taken over (four heartbeat periods)
SETTLE_S = 1.0  # a write that is not an atomic create is read back after this long


class RunHeld(UserError):
    """Another fit holds the run directory."""


@dataclass(frozen=True)
class Holder:
    """What `hold.json` says: who holds the run, and since when (Unix seconds)."""

    host: str
    pid: int
    fit_id: str
    started: float
    heartbeat: float
    pid_start: Optional[str] = None  # the process's start tick (Linux): a reused pid is not the holder
    # The fit's resource request in Ray's autoscaling coordinator (a cluster's Ray Train run asks
    # under `train-<run id>`): the fit that takes over from a dead holder cancels it (driver/launcher.py)
    requester: Optional[str] = None

    @classmethod
    def me(cls, fit_id: str) -> "Holder":
        now = time.time()
        return cls(socket.gethostname(), os.getpid(), fit_id, now, now, _process_start(os.getpid()))

    def gone(self, now: float) -> Optional[str]:
        """Why this holder no longer holds the run, or None while it does."""
        if self.host == socket.gethostname() and not pid_runs(self.pid, self.pid_start):
            return f"pid {self.pid} no longer runs on {self.host}"
        if now - self.heartbeat > STALE_S:
            return f"its last heartbeat is {now - self.heartbeat:.0f} s old (stale after {STALE_S:.0f} s)"
        return None

    def describe(self, now: float) -> str:
        return (f"host {self.host}, pid {self.pid}, fit {self.fit_id[:8]}, started {_utc(self.started)}, "
                f"last heartbeat {max(0.0, now - self.heartbeat):.0f} s ago")


def refuse_if_held(cfg: "Config") -> None:
    """Raise `RunHeld` if a live fit holds `cfg`'s run directory (read only: the CLI asks
    this before importing torch and Ray, so a refusal takes about a second)."""
    run_dir = run_dir_of(cfg)
    held = _read(run_dir / HOLD_FILE)
    if held is not None and held.gone(time.time()) is None:
        raise RunHeld(_refusal(run_dir, held, cfg))


def held_live(run_dir: Location) -> bool:
    """Whether a live fit holds `run_dir` now (a sweep waits for its stopping trials so)."""
    held = _read(run_dir / HOLD_FILE)
    return held is not None and held.gone(time.time()) is None


def take(cfg: "Config", fit_id: str) -> "Hold":
    """Hold `cfg`'s run directory for fit `fit_id`, or raise `RunHeld` naming its live holder."""
    run_dir = run_dir_of(cfg)
    loc = run_dir / HOLD_FILE
    made_dir = _missing_dirs(run_dir)  # the run directory and its parents that this fit creates
    mine, dead = Holder.me(fit_id), None
    for _ in range(3):  # each pass: judge what is there, write ours, check it stuck
        held = _read(loc)
        if held is None:
            if not loc.create_new(_dumps(mine)):
                continue  # another fit created it first: judge that one
            if loc.is_local:
                return Hold(loc, mine, made_dir)  # an atomic create: nothing to check
        elif (why := held.gone(time.time())) is not None:
            print(f"raytrain-ddp: taking over {run_dir} from fit {held.fit_id[:8]} ({held.host}, pid {held.pid}): "
                  f"{why}", file=sys.stderr, flush=True)
            loc.write_bytes(_dumps(mine))
            dead = held
        else:
            raise RunHeld(_refusal(run_dir, held, cfg))
        time.sleep(SETTLE_S)  # a racing writer's PUT lands within this (docs/reliability.md)
        now_there = _read(loc)
        if now_there is not None and now_there.fit_id == fit_id:
            return Hold(loc, mine, made_dir, taken_from=dead)
    held = _read(loc)
    raise RunHeld(_refusal(run_dir, held, cfg) if held else f"could not take the hold of {run_dir}; try again")


class Hold:
    """A taken hold: a daemon thread refreshes its heartbeat until `release()`."""

    def __init__(self, loc: Location, holder: Holder, made_dir: list[Path], taken_from: Optional[Holder] = None) -> None:
        self.loc, self.holder, self._made_dir = loc, holder, made_dir
        self.taken_from = taken_from  # the dead holder this fit took the run over from
        self.lost: Optional[Holder] = None  # someone else's record found where ours was
        self._lock = threading.Lock()  # one writer of the record at a time: the heartbeat, `record_requester`
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="raytrain-ddp-hold", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                there = _read(self.loc)
                if there is not None and there.fit_id != self.holder.fit_id:
                    self.lost = there
                    print(f"raytrain-ddp: warning: {self.loc} now names fit {there.fit_id[:8]} ({there.host}, pid "
                          f"{there.pid}): another fit took this run's hold over (this fit's heartbeat was judged "
                          "stale, or both took it at once: docs/reliability.md); stop this fit",
                          file=sys.stderr, flush=True)
                    return
                with self._lock:
                    self.holder = dataclasses.replace(self.holder, heartbeat=time.time())
                    self.loc.write_bytes(_dumps(self.holder))
            except OSError as exc:  # storage unreachable for a moment: the next beat tries again
                print(f"raytrain-ddp: warning: heartbeat of {self.loc} failed: {exc}", file=sys.stderr, flush=True)

    def record_requester(self, requester: str) -> None:
        """Name this fit's resource request in the record (`Holder.requester`), written now."""
        with self._lock:
            self.holder = dataclasses.replace(self.holder, requester=requester)
            try:
                self.loc.write_bytes(_dumps(self.holder))
            except OSError as exc:  # the next heartbeat writes it
                print(f"raytrain-ddp: warning: could not write {self.loc}: {exc}", file=sys.stderr, flush=True)

    def release(self) -> None:
        """Stop the heartbeat; delete the hold if it is still ours (and a local run directory
        this fit created but left empty). Never raises: it runs in `finally` blocks."""
        self._stop.set()
        self._thread.join(timeout=30)
        try:
            there = _read(self.loc)
            if there is not None and there.fit_id == self.holder.fit_id:
                self.loc.delete()
            for directory in self._made_dir:  # deepest first: a fit refused before writing anything
                if directory.is_dir() and not any(directory.iterdir()):  # leaves no run directory, nor its parents
                    directory.rmdir()
        except OSError as exc:
            print(f"raytrain-ddp: warning: could not release {self.loc}: {exc}", file=sys.stderr, flush=True)


def _missing_dirs(run_dir: Location) -> list[Path]:
    """A local run directory's missing directories, deepest first (none on object stores)."""
    if not run_dir.is_local:
        return []
    missing, path = [], run_dir.local_path
    while not path.exists() and path != path.parent:
        missing.append(path)
        path = path.parent
    return missing


def _refusal(run_dir: Location, held: Holder, cfg: "Config") -> str:
    return (f"run directory {run_dir} is held by a running fit: {held.describe(time.time())}; a hold ends with "
            f"its fit, at once when its pid is gone from this host, else {STALE_S:.0f} s after its last heartbeat. "
            f"Train under another name ({unused_name(cfg)}), wait for it to end, or once it has ended continue "
            "this run with the same command (run.resume=latest)")


def _read(loc: Location) -> Optional[Holder]:
    """The holder named in `loc`, or None when there is none. An unreadable record (not
    written by this version) counts as a holder on no host, alive until it is stale."""
    try:
        raw = loc.read_bytes()
    except (FileNotFoundError, IsADirectoryError):
        return None
    try:
        return Holder(**json.loads(raw))
    except (ValueError, TypeError):
        mtime = loc.info().mtime
        return Holder("?", 0, "unknown", 0.0, mtime.timestamp() if mtime else 0.0)


def _dumps(holder: Holder) -> bytes:
    return (json.dumps(asdict(holder), indent=1) + "\n").encode()


def _process_start(pid: int) -> Optional[str]:
    """A process's start time in clock ticks since boot (Linux /proc), None elsewhere."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def pid_runs(pid: int, start: Optional[str] = None) -> bool:
    """Whether `pid` runs (a zombie has ended) and, given `start`, is the process that started
    then (a reused pid is another process). Also read by torchrun's ranks for their driver."""
    if not os.path.exists("/proc/self/stat"):  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    fields = stat.rsplit(")", 1)[1].split()
    return fields[0] not in ("Z", "X") and (start is None or fields[19] == start)


def _utc(seconds: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(seconds))
