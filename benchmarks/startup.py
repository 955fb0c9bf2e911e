"""The `startup` section (issue #39): how soon the quickstart's first step comes, ours beside
two references of the section's own on the same job, and the issue's Targets table.

Owns: the runs (each a command of its own, timed from its start by this process), their
order (rotated each round, so drift on a shared machine spreads over every system), the
medians, the ratios (paired: taken within a round, then the median) and the table.
Must not touch: the product (it runs `raytrain-ddp train` as a user does), any run
directory but its temporary ones, any Ray instance but the head it starts.

Systems, each on the quickstart (benchmarks/startup_refs.py holds the references):
    ours_embedded   `raytrain-ddp train examples/configs/quickstart.yaml` (embedded Ray)
    ours_joined     the same with RAY_ADDRESS set to a `ray start` head this section started
                    (its own RAY_TMPDIR, stopped by process group at the end; not timed)
    ours_torchrun   the same with scaling.launcher=torchrun (no Ray); its final weights are
                    compared with ours_embedded's, tensor for tensor
    torchrun_ref    `torchrun --nproc_per_node=2` + a plain torch DDP script
    bare_trainer    a bare two-worker `TorchTrainer`: one DDP step of a linear layer
    bare_joined     the same `TorchTrainer` joining the head ours_joined joins
A/B of each start-up override (issue #53): `<ours system>-<override>` is that system with the
override left out (`RAYTRAIN_DDP_STARTUP_WITHOUT`, read in `ray_compat.override_on`); its gain
is paired within a round (without minus with), then the median. None is about restarts: each
acts once per fit (a controller's actors, the node, the backend's import, the exit).
Kill -> next step (replica, live) are the `recovery` section's figures; the table points there.

`python -m benchmarks.startup [--quick] [--out FILE.json]` (or `make bench-startup`) runs this
section alone (1 round with --quick, else 3) and publishes it: benchmarks/results/startup-<date>.json
(`meta`, `rounds`, `medians`: each system's metric over rounds, `figures`) and the table beside it (.md).
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "examples" / "configs" / "quickstart.yaml"
SYSTEMS = ("ours_embedded", "ours_joined", "ours_torchrun", "torchrun_ref", "bare_trainer", "bare_joined")
# override (ray_compat.override_on's name) -> (the ours systems it acts on, the metric it buys)
OVERRIDES: dict[str, tuple[tuple[str, ...], str]] = {
    "lean_trainer": (("ours_embedded",), "first_step_s"),  # a joined fit's (its dataset manager) went: 2026-12-08
    "lean_node": (("ours_embedded",), "first_step_s"),
    "torch_free_backend": (("ours_embedded",), "first_step_s"),
    "fast_exit": (("ours_embedded",), "last_to_exit_s"),
}
AB_SYSTEMS = tuple(f"{system}-{name}" for name, (systems, _) in OVERRIDES.items() for system in systems)
KEEP_S = 1.0  # an override stays if it buys at least this (issue #53)
RUN_TIMEOUT_S = 900
# (figure, how it is computed, required, aim): "<system>.<metric>" or "<a>/<b>" (a paired ratio)
TARGETS: tuple[tuple[str, str, Any, Any], ...] = (
    ("first step, embedded Ray (s)", "ours_embedded.first_step_s", 14.0, 10.0),
    ("first step / bare TorchTrainer's, same run", "ours_embedded.first_step_s/bare_trainer.first_step_s", 0.7, None),
    ("first step, running Ray head (s after the driver starts)", "ours_joined.first_step_s", 10.0, 6.0),
    ("first step, running head / a bare TorchTrainer joining it", "ours_joined.first_step_s/bare_joined.first_step_s",
     0.8, None),
    ("first step, scaling.launcher=torchrun, no Ray (s)", "ours_torchrun.first_step_s", 6.0, None),
    ("first step, torchrun launcher / torchrun + torch DDP's", "ours_torchrun.first_step_s/torchrun_ref.first_step_s",
     1.2, None),
    ("torchrun launcher's weights == the Ray path's", "ours_torchrun.same_weights", True, None),
    ("wall time, embedded Ray (s)", "ours_embedded.wall_s", 20.0, 18.0),
    ("last step -> exit (s)", "ours_embedded.last_to_exit_s", 2.0, None),
    ("steady step / torchrun + torch DDP's", "ours_embedded.step_ms/torchrun_ref.step_ms", 1.10, None),
    ("kill -> next trained step, replica (s)", "recovery", 6.0, None),
    ("kill -> next trained step, live (s)", "recovery", 3.0, None),
)


def run(sizes: Any, log: Callable[[str], None] = print, rounds: Optional[int] = None,
        partial: Optional[Path] = None) -> dict[str, Any]:
    """Every system and A/B, `rounds` times (1 in --quick, 3 in full); the smoke preset skips it.
    `partial`: the rounds so far are written there after each (a long run on a busy machine)."""
    if sizes.name == "smoke":
        return {"skipped": "the smoke preset runs no fit (python -m benchmarks.startup --quick does)"}
    rounds = rounds or (1 if sizes.name == "quick" else 3)
    results: list[dict[str, dict[str, Any]]] = []
    loads: list[dict[str, str]] = []  # /proc/loadavg before and after each round: how shared the machine was
    every = SYSTEMS + AB_SYSTEMS
    # short: Ray's socket paths under it must stay within AF_UNIX's 107 bytes
    with tempfile.TemporaryDirectory(prefix="rtds_") as tmp, _ray_head(Path(tmp)) as head:
        if head is None:
            log("  startup: the section's ray start --head did not come up; the joined systems are skipped")
        for number in range(rounds):
            shift = number * len(every) // rounds  # each system starts a round in a different third
            order = every[shift:] + every[:shift]
            one: dict[str, dict[str, Any]] = {}
            loads.append({"before": _loadavg()})
            for system in order:
                where = Path(tmp) / f"r{number}_{every.index(system)}"  # short (AF_UNIX), as tmp
                where.mkdir()
                try:
                    one[system] = _runner(system)(where, head)
                except Exception as exc:  # noqa: BLE001 - recorded; the other systems still run
                    one[system] = {"error": f"{type(exc).__name__}: {str(exc)[-1500:]}"}
                log(f"  startup round {number + 1}/{rounds}: {system} {_brief(one[system])}")
            if "checkpoint" in one.get("ours_torchrun", {}) and "checkpoint" in one.get("ours_embedded", {}):
                one["ours_torchrun"]["same_weights"] = same_weights(one["ours_torchrun"]["checkpoint"],
                                                                    one["ours_embedded"]["checkpoint"])
            loads[-1]["after"] = _loadavg()
            log(f"  startup round {number + 1}/{rounds}: load {loads[-1]['before']} -> {loads[-1]['after']}")
            results.append(one)
            if partial is not None:
                partial.write_text(json.dumps({"rounds": results, "loads": loads}, indent=1, default=str))
    table, ab = figures(results), overrides(results)
    for line in table_lines(table) + ab_lines(ab):
        log(line)
    return {"rounds": results, "loads": loads, "medians": medians(results), "figures": table, "overrides": ab}


def _loadavg() -> str:
    try:
        return Path("/proc/loadavg").read_text().strip()
    except OSError:
        return " ".join(f"{v:.2f}" for v in os.getloadavg())


def overrides(rounds: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Each `<system>-<override>`'s gain: its metric without the override minus with it, paired
    within a round, then the median (also the wall time's); `keep` if it buys `KEEP_S` or more."""
    out = {}
    for name, (systems, metric) in OVERRIDES.items():
        for system in systems:
            row: dict[str, Any] = {"override": name, "system": system, "metric": metric}
            for what in dict.fromkeys((metric, "first_step_s", "wall_s")):
                pairs = [(r.get(f"{system}-{name}", {}).get(what), r.get(system, {}).get(what)) for r in rounds]
                gains = [None if None in pair else pair[0] - pair[1] for pair in pairs]
                row[f"{what}_gain_by_round"] = gains
                known = [g for g in gains if g is not None]
                row[f"{what}_gain"] = statistics.median(known) if known else None
            row["keep"] = None if row[f"{metric}_gain"] is None else row[f"{metric}_gain"] >= KEEP_S
            out[f"{system}-{name}"] = row
    return out


def ab_lines(ab: dict[str, dict[str, Any]]) -> list[str]:
    lines = ["", "**Start-up overrides** (issue #53: each left out, paired within a round; kept if it buys >= "
             f"{KEEP_S:g} s)", "", "| override | on | metric | gain (s), by round | median gain (s) | wall gain (s) | kept |",
             "|---|---|---|---|---|---|---|"]
    for row in ab.values():
        metric, shown = row["metric"], lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
        lines.append(f"| `{row['override']}` | `{row['system']}` | {metric} | "
                     f"{', '.join(shown(g) for g in row[metric + '_gain_by_round'])} | {shown(row[metric + '_gain'])} | "
                     f"{shown(row['wall_s_gain'])} | {({True: 'yes', False: 'no', None: '-'})[row['keep']]} |")
    return lines


def medians(rounds: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, float]]:
    """Each system's numeric metrics, the median over rounds: what the docs cite."""
    out: dict[str, dict[str, float]] = {}
    for system in SYSTEMS + AB_SYSTEMS:
        records = [r.get(system, {}) for r in rounds]
        keys = {k for rec in records for k, v in rec.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        out[system] = {k: statistics.median(rec[k] for rec in records if isinstance(rec.get(k), (int, float)))
                       for k in sorted(keys)}
    return out


def rounds_table(rounds: list[dict[str, dict[str, Any]]]) -> list[str]:
    """Each system's figures round by round, as the docs show them."""
    lines = ["| system | first step (s), by round | wall (s) | last step -> exit (s) | step ms | val_accuracy |",
             "|---|---|---|---|---|---|"]
    for system in SYSTEMS + AB_SYSTEMS:
        cells = []
        for metric in ("first_step_s", "wall_s", "last_to_exit_s", "step_ms", "val_accuracy"):
            values = [r.get(system, {}).get(metric) for r in rounds]
            cells.append(", ".join("-" if v is None else f"{v:.4g}" if metric == "val_accuracy" else f"{v:.1f}"
                                   for v in values))
        lines.append(f"| `{system}` | " + " | ".join(cells) + " |")
    return lines


def figures(rounds: list[dict[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """Each target's figure: the median over rounds (a ratio: of the per-round ratios)."""
    out = []
    for name, how, required, aim in TARGETS:
        if how == "recovery":
            out.append({"figure": name, "value": None, "required": required, "aim": aim,
                        "note": "the recovery section's kill_to_next_step_s"})
            continue
        values = [v for v in (_value(r, how) for r in rounds) if v is not None]
        if values and all(isinstance(v, bool) for v in values):
            value: Any = all(values)
        else:
            value = statistics.median(values) if values else None
        out.append({"figure": name, "value": value, "required": required, "aim": aim,
                    "met": _met(value, required)})
    return out


def table_lines(table: list[dict[str, Any]]) -> list[str]:
    lines = ["", "**Targets** (startup, issue #39)", "", "| figure | measured | required | aim | met |",
             "|---|---|---|---|---|"]
    for row in table:
        value = row["value"]
        shown = row.get("note", "-") if value is None else ("yes" if value is True else "no" if value is False
                                                            else f"{value:.2f}")
        met = {True: "yes", False: "NO", None: "-"}[row.get("met")]
        lines.append(f"| {row['figure']} | {shown} | {_fmt(row['required'])} | {_fmt(row['aim'])} | {met} |")
    return lines


def _value(one: dict[str, dict[str, Any]], how: str) -> Any:
    def get(ref: str) -> Any:
        system, metric = ref.split(".")
        return one.get(system, {}).get(metric)

    if "/" in how:
        a, b = (get(part) for part in how.split("/"))
        return a / b if a is not None and b else None
    return get(how)


def _met(value: Any, required: Any) -> Optional[bool]:
    if value is None:
        return None
    if isinstance(required, bool):
        return value is required
    return value <= required


def _fmt(value: Any) -> str:
    return "-" if value is None else ("yes" if value is True else f"{value:g}")


def _brief(record: dict[str, Any]) -> str:
    return " ".join(f"{k} {v:.2f}" for k, v in record.items() if isinstance(v, float))


# ---------------------------------------------------------------- the runs


def _timed(command: list[str], env: dict[str, str], cwd: Path) -> tuple[float, float, subprocess.CompletedProcess]:
    started = time.time()
    proc = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    ended = time.time()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(command[:6])} ... exited {proc.returncode}:\n{proc.stdout[-2000:]}\n"
                           f"{proc.stderr[-3000:]}")
    return started, ended, proc


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "RAYTRAIN_DDP_"))}
    env.update(PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]), **extra)
    return env


def ours(where: Path, *overrides: str, env: Optional[dict[str, str]] = None) -> dict[str, Any]:
    """`raytrain-ddp train` on the quickstart, read back from its run directory."""
    command = [sys.executable, "-m", "raytrain_ddp", "train", str(QUICKSTART), f"run.storage_path={where}",
               "name=q", *overrides]
    started, ended, _ = _timed(command, env or _env(), where)
    return read_ours(where / "q", started, ended)


def read_ours(run_dir: Path, started: float, ended: float) -> dict[str, Any]:
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = [json.loads(line) for line in (run_dir / "timeline.jsonl").read_text().splitlines() if line.strip()]
    first = next(r["t"] for r in rows if r["phase"] == "first_step" and r["attempt"] == 1)
    last = next(r["t"] for r in rows if r["phase"] == "last_step")
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
    batch = 64  # the quickstart's global batch
    step_ms = [1e3 * batch / r["samples_per_s"] for r in lines[1:] if r.get("samples_per_s")]
    return {"first_step_s": first - started, "wall_s": ended - started, "last_to_exit_s": ended - last,
            "step_ms": statistics.median(step_ms) if step_ms else None, "checkpoint": summary["checkpoint"],
            "phases": summary["startup"]["attempts"][0]["phases"], "status": summary["status"],
            "val_accuracy": summary.get("final_metrics", {}).get("val_accuracy")}


def torchrun_ref(where: Path, head: Optional[dict[str, str]] = None) -> dict[str, Any]:
    out = where / "ref.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--nnodes=1",
               "--master_addr=127.0.0.1", f"--master_port={_free_port()}", "-m", "benchmarks.startup_refs",
               "torchrun", str(out)]
    started, ended, _ = _timed(command, _env(OMP_NUM_THREADS="1"), REPO)
    record = json.loads(out.read_text())
    return {"first_step_s": record["first_step_t"] - started, "wall_s": ended - started,
            "last_to_exit_s": ended - record["last_step_t"], "step_ms": statistics.median(record["step_ms"])}


def bare_trainer(where: Path, head: Optional[dict[str, str]] = None) -> dict[str, Any]:
    out = where / "bare.json"
    started, ended, _ = _timed([sys.executable, "-m", "benchmarks.startup_refs", "bare", str(out)],
                               _env(RAY_TMPDIR=str(where)), REPO)
    record = json.loads(out.read_text())
    return {"first_step_s": record["first_step_t"] - started, "wall_s": ended - started}


def bare_joined(where: Path, head: Optional[dict[str, str]] = None) -> dict[str, Any]:
    out = where / "bare.json"
    started, ended, _ = _timed([sys.executable, "-m", "benchmarks.startup_refs", "bare", str(out)],
                               _env(**_required(head)), REPO)
    return {"first_step_s": json.loads(out.read_text())["first_step_t"] - started, "wall_s": ended - started}


RUNNERS: dict[str, Callable[..., dict[str, Any]]] = {
    "ours_embedded": lambda where, head, **without: ours(where, env=_env(RAY_TMPDIR=str(where), **without)),
    "ours_joined": lambda where, head, **without: ours(where, env=_env(**_required(head), **without)),
    "ours_torchrun": lambda where, head: ours(where, "scaling.launcher=torchrun"),
    "torchrun_ref": torchrun_ref,
    "bare_trainer": bare_trainer,
    "bare_joined": bare_joined,
}


def _runner(system: str) -> Callable[[Path, Optional[dict[str, str]]], dict[str, Any]]:
    """`system`'s run; `<ours system>-<override>`: that run with the override left out."""
    base, _, override = system.partition("-")
    if not override:
        return RUNNERS[system]
    return lambda where, head: RUNNERS[base](where, head, RAYTRAIN_DDP_STARTUP_WITHOUT=override)


def _required(head: Optional[dict[str, str]]) -> dict[str, str]:
    if not head:
        raise RuntimeError("no ray start head to join (see the head's error above)")
    return head


def same_weights(a: str, b: str) -> bool:
    """Two checkpoints' model state_dicts, tensor for tensor."""
    import torch

    from raytrain_ddp import checkpoint as ckpt

    x, y = (ckpt.load_checkpoint(p)["model"] for p in (a, b))
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


class _ray_head:
    """A `ray start --head` of this section's own (its own RAY_TMPDIR and free port), stopped
    by its process group; never `ray stop`, which would stop every Ray of the machine."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp / "head"
        self.proc: Optional[subprocess.Popen] = None
        self.error = ""
        self.auth: dict[str, str] = {}  # what a client of this head needs

    def __enter__(self) -> Optional[dict[str, str]]:
        """What a client of the head needs (its address and token); None if it did not come up (`error` says why: ours_joined records it)."""
        self.tmp.mkdir()
        port, dash, client, nm, om, agent, agent_grpc, renv, metrics = (_free_port() for _ in range(9))
        ray = str(Path(sys.executable).with_name("ray"))
        token = self.tmp / "auth_token"  # token auth on, with a token private to this head (as cluster/local-head.sh)
        token.write_text(secrets.token_hex(32))
        token.chmod(0o600)
        self.auth = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)}
        env = _env(RAY_TMPDIR=str(self.tmp), **self.auth)
        with open(self.tmp / "head.log", "w") as log:  # every port its own, as cluster/local-two-node.sh does
            self.proc = subprocess.Popen(
                [ray, "start", "--head", "--block", f"--port={port}", f"--temp-dir={self.tmp / 'ray'}",
                 "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}",
                 f"--ray-client-server-port={client}", "--node-ip-address=127.0.0.1", f"--node-manager-port={nm}",
                 f"--object-manager-port={om}", f"--dashboard-agent-listen-port={agent}",
                 f"--dashboard-agent-grpc-port={agent_grpc}", f"--runtime-env-agent-port={renv}",
                 f"--metrics-export-port={metrics}", "--num-cpus=4", "--num-gpus=0", "--disable-usage-stats"],
                env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        address = f"127.0.0.1:{port}"
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and self.proc.poll() is None:
            probe = subprocess.run([ray, "status", f"--address={address}"], env=env, capture_output=True, timeout=120)
            if probe.returncode == 0:
                return {"RAY_ADDRESS": address, **self.auth}
            time.sleep(1.0)
        self.__exit__()
        self.error = f"the section's ray start --head did not come up: {(self.tmp / 'head.log').read_text()[-1500:]}"
        return None

    def __exit__(self, *exc: object) -> None:
        """The head's whole process group (raylet, GCS, workers), even if `ray start` itself ended."""
        if self.proc is None:
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                continue
            time.sleep(2.0 if sig == signal.SIGTERM else 0.0)
        self.proc = None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def main(argv: Optional[list[str]] = None) -> int:
    import argparse

    from benchmarks.common import FULL, QUICK
    from benchmarks.session import log, meta, publish, results_path

    parser = argparse.ArgumentParser(description="the startup section alone, published under benchmarks/results/")
    parser.add_argument("--quick", action="store_true", help="1 round instead of 3")
    parser.add_argument("--out", default=None, help="JSON file (default: benchmarks/results/startup-<date>.json)")
    args = parser.parse_args(argv)
    out = Path(args.out) if args.out else results_path("startup")
    started = time.perf_counter()
    results: dict[str, Any] = {"meta": meta("quick" if args.quick else "full", "cpu")}
    results["startup"] = run(QUICK if args.quick else FULL, log=log, partial=out.with_suffix(".partial.json"))
    out.with_suffix(".partial.json").unlink(missing_ok=True)
    results["meta"]["duration_s"] = time.perf_counter() - started
    results["meta"]["load_avg_at_end"] = list(os.getloadavg())
    section = results["startup"]
    loads = [f"round {n + 1}: {load['before']} -> {load['after']}" for n, load in enumerate(section["loads"])]
    table = "\n".join(["**Start-up** (the quickstart; each system a command timed from its start)", "",
                        "Load (/proc/loadavg before -> after each round): " + "; ".join(loads), "",
                        *rounds_table(section["rounds"]), *table_lines(section["figures"]),
                        *ab_lines(section["overrides"])])
    md = publish(results, out, table)
    print(table)
    log(f"wrote {out} and {md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
