"""The fault-sequence soak: the plan of `tests/cluster/test_fault_sequences.py` over a range
of seeds, one row per seed (faults, invocations, result, seconds), outside `make test`.

    .venv/bin/python -m benchmarks.soak --seeds 0-19              # or: make soak SEEDS=0-19
    .venv/bin/python -m benchmarks.soak --seeds 3 --kinds late    # one seed, fewer kinds

Each seed is a sequence of `raytrain-ddp train` invocations of one run (worker kills, Ctrl-C,
a SIGKILLed driver, resizes), then the same command until it exits 0 and once more (which must
say the run is complete); the three properties are checked against one uninterrupted run
(every row once per epoch, the same final weights, the attempts accounting for everything).
`--kinds` adds fault kinds (default all: `s3`, the run directory in a moto bucket for the
whole sequence; `load`, one CPU-bound process per core during an invocation; `late`, a Ctrl-C
aimed at the last steps; `node`, about one seed in five on a two-node cluster of its own, every
process of the second node SIGKILLed during one invocation and the node started again before
the next). A failing seed becomes a fixed case of the suite (`SEEDS` there). The table and
the rows are published as benchmarks/results/soak-<date>.{md,json} (or `--out`), with the
`meta` block (date, commit, command, machine) of every bench.

Must not touch: the product. It runs pytest, so the test's own deadlines and clean-up hold.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TEST = "tests/cluster/test_fault_sequences.py"


def faults(story: list[str]) -> str:
    """The faulted invocations of a seed's story, shortened: `2w async fault=(1, 0, 'exit') end=sigint+5`."""
    kept = [line.split(" ", 1)[1].rsplit(" -> ", 1)[0].replace("fault=None ", "") for line in story[1:]
            if "fault=None end=finish+0" not in line]
    return "; ".join(kept) or "-"


def table(rows: list[dict]) -> str:
    lines = ["| seed | faults | invocations | result | time (s) |", "|---|---|---|---|---|"]
    for row in rows:
        tags = row["story"][0].split()[2:] if row["story"] else []  # "seed 7 s3 two-node"
        where = f" ({', '.join(tags)})" if tags else ""
        codes = ",".join(line.rsplit(" -> ", 1)[1] for line in row["story"][1:] if " -> " in line)
        lines.append(f"| {row['seed']}{where} | {faults(row['story'])} | {len(row['story']) - 1} ({codes}) | "
                     f"{row['result']} | {row['seconds']:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default="0-19", help="LOW-HIGH or one seed")
    parser.add_argument("--kinds", default="s3,load,late,node", help="extra fault kinds, comma-separated ('' for none)")
    parser.add_argument("--rows", default=None, help="the JSON lines of the rows (default: a temporary file)")
    parser.add_argument("--out", default=None, help="the published JSON (default: benchmarks/results/soak-<date>.json)")
    args = parser.parse_args(argv)
    rows_path = Path(args.rows or tempfile.mkstemp(prefix="soak-", suffix=".jsonl")[1])
    rows_path.write_text("")
    env = {**os.environ, "RAYTRAIN_DDP_FAULT_SEEDS": args.seeds, "RAYTRAIN_DDP_FAULT_KINDS": args.kinds,
           "RAYTRAIN_DDP_SOAK_ROWS": str(rows_path), "RAYTRAIN_DDP_SOAK_TIMEOUT_S": "3600"}  # per seed
    started = time.monotonic()
    # Every seed runs (no -x); each gets an hour (the suite's 900 s was spent by a busy machine).
    # A failed seed's invocation logs, samples and cluster logs stay under the rows' folder
    basetemp = rows_path.with_suffix(".pytest")
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0",
                           f"--basetemp={basetemp}", TEST],
                          cwd=REPO, env=env)
    from benchmarks.session import meta, publish, results_path

    rows = [json.loads(line) for line in rows_path.read_text().splitlines() if line.strip()]
    passed = sum(r["result"] == "passed" for r in rows)
    wall_s = time.monotonic() - started
    text = (f"{table(rows)}\n\n{passed} of {len(rows)} seeds passed in {wall_s:.0f} s "
            f"(seeds {args.seeds}, kinds {args.kinds or 'none'})")
    print(text)
    out = Path(args.out) if args.out else results_path("soak")
    results = {"meta": meta("soak", "cpu"), "soak": {"seeds": args.seeds, "kinds": args.kinds, "passed": passed,
                                                     "total": len(rows), "wall_s": wall_s, "rows": rows}}
    publish(results, out, text)
    print(f"rows in {rows_path}, logs in {basetemp}; published {out} and {out.with_suffix('.md')}")
    return done.returncode


if __name__ == "__main__":
    sys.exit(main())
