"""One all-reduce alone, by size: gloo against bucketed's shared-memory exchange.

Owns: `python -m benchmarks.transport`, a markdown table of the median time
of one all-reduce of N MiB between 2 local ranks (each with one thread), through the
process group (gloo, what torch DDP uses) and through `parallel.shm` (copy into the
rank's slot, a one-element all-reduce as the barrier, the sum of the slots). The two are
interleaved and each rep starts from a barrier; a rep's time is the slowest rank's.
Must not touch: the wrappers (the step-level comparison is `strategies`' parity launches).
Not part of `raytrain-ddp bench`: the step times there already include it.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

SIZES_MIB = (0.0625, 0.25, 1.0, 4.0, 8.0, 32.0)


def _rank(world_rank: int, world_size: int, sizes_mib: tuple[float, ...], reps: int) -> dict[float, Any]:
    import torch
    import torch.distributed as dist

    from raytrain_ddp.parallel.shm import open_exchange

    out = {}
    for mib in sizes_mib:
        n = int(mib * 2**20) // 4
        x = torch.randn(n)
        exchange = open_exchange([x], None, world_rank, world_size)
        if exchange is None:
            raise RuntimeError("the ranks could not share memory (/dev/shm)")
        gloo, shm = [], []
        for _ in range(reps + 2):
            dist.barrier()
            start = time.perf_counter()
            dist.group.WORLD.allreduce([x]).wait()
            gloo.append(time.perf_counter() - start)
            dist.barrier()
            start = time.perf_counter()
            exchange.launch(0, x, 0, n).wait()
            exchange.synced()
            shm.append(time.perf_counter() - start)
        out[mib] = {"gloo": gloo[2:], "shm": shm[2:]}
    return out


def measure(sizes_mib: tuple[float, ...] = SIZES_MIB, reps: int = 30) -> list[dict[str, float]]:
    from raytrain_ddp.ops.ranks import run_ranks

    ranks = run_ranks(_rank, 2, sizes_mib, reps, timeout_s=600, threads=1)
    rows = []
    for mib in sizes_mib:
        median = {kind: 1e3 * statistics.median(max(r[mib][kind][i] for r in ranks) for i in range(reps))
                  for kind in ("gloo", "shm")}
        rows.append({"mib": mib, "gloo_ms": median["gloo"], "shm_ms": median["shm"],
                     "shm_over_gloo": median["shm"] / median["gloo"]})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=30)
    args = parser.parse_args()
    print("| MiB | gloo ms | shared memory ms | shm / gloo |\n|---|---|---|---|")
    for row in measure(reps=args.reps):
        print(f"| {row['mib']:g} | {row['gloo_ms']:.2f} | {row['shm_ms']:.2f} | {row['shm_over_gloo']:.2f} |")


if __name__ == "__main__":
    main()
