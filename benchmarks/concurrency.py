"""Many jobs on one machine (issue #56): fits started at once, round after round, each ending ok.

    .venv/bin/python -m benchmarks.concurrency --rounds 10        # the table: benchmarks/results/

Each round starts, at the same moment, `raytrain-ddp train` of the tiny config three ways
(an embedded Ray instance; one joining a local head this command started with
`cluster/local-head.sh`; the torchrun launcher) and a `raytrain-ddp sweep` of 2 trials run 2
at a time on an embedded instance: four drivers, up to five process groups forming at once
beside whatever else the machine runs. Checked per round: every command exits 0, every fit
and trial says `ok` in its summary.json, and nothing is left running (this process is the
subreaper of everything it starts: every process below it but the head's must be gone once
the round's commands have exited). Counted: the worker-group starts each fit retried
(attempts.jsonl's `start_failed`, with their causes). The table (date, commit, machine,
command, one row per fit per round) is printed and written to `benchmarks/results/`.

Must not touch: the product, any process it did not start (the head is stopped by its state dir).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from benchmarks.recovery import two_node_env

REPO = Path(__file__).resolve().parents[1]
CLI = str(Path(sys.executable).parent / "raytrain-ddp")
TINY, SWEEP = REPO / "examples/configs/tiny.yaml", REPO / "examples/configs/sweep.yaml"
HEAD = REPO / "cluster/local-head.sh"
RESULTS = REPO / "benchmarks/results"
FIT_TIMEOUT_S = 1500.0  # one round's commands, on a machine others load too
PR_SET_CHILD_SUBREAPER = 36


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()
            if fields[0] != "Z":  # a zombie is gone, only not reaped yet
                tree.setdefault(int(fields[1]), []).append(int(entry))
    return tree


def descendants(root: int, skip: frozenset[int] = frozenset()) -> set[int]:
    """Every live process below `root`, none below a pid in `skip` (nor those pids)."""
    tree, out, todo = _children(), set(), [root]
    while todo:
        for child in tree.get(todo.pop(), []):
            if child not in skip and child not in out:
                out.add(child)
                todo.append(child)
    return out


def _reap() -> None:
    """Reap the orphans this subreaper inherited."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def start_head(env: dict[str, str]) -> Path:
    up = subprocess.run([str(HEAD), "start"], env={**env, "RT2N_UP_TIMEOUT_S": "420"}, capture_output=True,
                        text=True, timeout=480)
    if up.returncode != 0:
        raise SystemExit(f"concurrency: the local head did not start:\n{up.stdout[-2000:]}{up.stderr[-2000:]}")
    return Path(up.stdout.strip().splitlines()[-1])


def commands(root: Path) -> dict[str, list[str]]:
    tiny = [CLI, "train", str(TINY), f"run.storage_path={root}", "train.epochs=1"]
    return {"embedded": [*tiny, "name=embedded"], "joined": [*tiny, "name=joined"],
            "torchrun": [*tiny, "name=torchrun", "scaling.launcher=torchrun"],
            "sweep": [CLI, "sweep", str(SWEEP), f"run.storage_path={root}", "train.epochs=1",
                      "sweep.num_trials=2", "sweep.max_concurrent_trials=2"]}


def fit_row(name: str, run_dir: Path, rc: int, seconds: float) -> dict[str, Any]:
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").exists() else {}
    attempts = [json.loads(line) for line in (run_dir / "attempts.jsonl").read_text().splitlines()
                ] if (run_dir / "attempts.jsonl").exists() else []
    mine = [a for a in attempts if a.get("fit_id") == summary.get("fit_id")]
    causes = Counter(a["start_failed"] for a in mine if "start_failed" in a)
    return {"fit": name, "rc": rc, "status": summary.get("status", "no summary"), "attempts": summary.get("attempts"),
            "retries": sum(causes.values()), "causes": dict(causes), "seconds": round(seconds, 1),
            "error": summary.get("error")}


def one_round(number: int, root: Path, head_env: dict[str, str], head_pids: frozenset[int]) -> list[dict[str, Any]]:
    root.mkdir(parents=True)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "RAYTRAIN_DDP_"))}
    started, procs = time.monotonic(), {}
    for name, command in commands(root).items():
        env = head_env if name == "joined" else base
        log = open(root / f"{name}.log", "wb")
        procs[name] = (subprocess.Popen(command, env=env, cwd=root, stdout=log, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL), log, time.monotonic())
    ended: dict[str, float] = {}
    while len(ended) < len(procs) and time.monotonic() - started < FIT_TIMEOUT_S:
        ended.update({name: time.monotonic() for name, (proc, _, _) in procs.items()
                      if name not in ended and proc.poll() is not None})
        time.sleep(0.2)
    rows = []
    for name, (proc, log, t0) in procs.items():
        if proc.poll() is None:  # past the round's deadline: killed, and said in its row
            proc.kill()
        rc = proc.wait()
        log.close()
        seconds = ended.get(name, time.monotonic()) - t0
        if name == "sweep":
            trials = sorted(d for d in (root / "sweep" / "trials").iterdir() if d.is_dir()) \
                if (root / "sweep" / "trials").exists() else []
            rows += [fit_row(f"sweep/{d.name[:12]}", d, rc, seconds) for d in trials] or \
                [{"fit": "sweep", "rc": rc, "status": "no trials", "attempts": None, "retries": 0, "causes": {},
                  "seconds": round(seconds, 1), "error": None}]
        else:
            rows.append(fit_row(name, root / name, rc, seconds))
    deadline = time.monotonic() + 60  # an embedded Ray's last processes end after their driver (slowly, loaded)
    while (left := descendants(os.getpid(), head_pids)) and time.monotonic() < deadline:
        _reap()
        time.sleep(0.5)
    if left:
        names = [Path(f"/proc/{pid}/comm").read_text().strip() if Path(f"/proc/{pid}/comm").exists() else "?"
                 for pid in sorted(left)]
        print(f"concurrency: round {number}: left running: {dict(zip(sorted(left), names))}", flush=True)
    for row in rows:
        row["round"], row["left_running"] = number, len(left)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| round | fit | status | attempts | start retries | causes | seconds | left running |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        causes = "; ".join(f"{c} x{n}" for c, n in r["causes"].items()) or "-"
        status = r["status"] if r["rc"] == 0 else f"{r['status']} (exit {r['rc']})"
        lines.append(f"| {r['round']} | {r['fit']} | {status} | {r['attempts']} | {r['retries']} | {causes} | "
                     f"{r['seconds']} | {r['left_running']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--out", default=None,
                        help="the table's file (default: benchmarks/results/concurrency-DATE.md)")
    args = parser.parse_args(argv)
    ctypes.CDLL(None).prctl(PR_SET_CHILD_SUBREAPER, 1)  # orphans of what it starts come back to it
    work = Path(tempfile.mkdtemp(prefix="raytrain-concurrency-"))
    state = start_head(two_node_env())
    head_pids = frozenset(descendants(os.getpid()))  # the head's processes, and what they start
    rows: list[dict[str, Any]] = []
    started = time.monotonic()
    try:
        for number in range(1, args.rounds + 1):
            rows += one_round(number, work / f"round{number}", two_node_env(state), head_pids)
            print(table([r for r in rows if r["round"] == number]).split("\n", 2)[2], flush=True)
    finally:
        subprocess.run([str(HEAD), "stop", str(state)], env=two_node_env(), capture_output=True, timeout=120)
    ok = all(r["rc"] == 0 and r["status"] == "ok" and r["left_running"] == 0 for r in rows)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip()
    retries = sum(r["retries"] for r in rows)
    head = [f"# Concurrency soak (issue #56): {args.rounds} round(s)", "",
            f"- date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", f"- commit: {commit}",
            f"- machine: {platform.node()}, {os.cpu_count()} cores, load average at the end "
            f"{', '.join(f'{x:.1f}' for x in os.getloadavg())}",
            f"- command: `.venv/bin/python -m benchmarks.concurrency --rounds {args.rounds}`",
            f"- result: {'every fit and trial ok, nothing left running' if ok else 'FAILED'}; "
            f"{retries} worker-group start(s) retried; {time.monotonic() - started:.0f} s", ""]
    text = "\n".join(head) + "\n" + table(rows) + "\n"
    out = Path(args.out) if args.out else RESULTS / f"concurrency-{time.strftime('%Y%m%d-%H%M', time.gmtime())}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(text + f"\nwritten to {out}; logs in {work}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
