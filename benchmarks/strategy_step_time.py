"""Step time of naive / bucketed / native (and no communication) on the articles' MLP.

Owns: launching W gloo ranks on 127.0.0.1 (no Ray) and printing the numbers of
`raytrain_ddp.parallel.measure.time_strategies`. Must not touch: anything but stdout and
the optional --json file.

    .venv/bin/python benchmarks/strategy_step_time.py                # 2 ranks, batch 64/rank
    .venv/bin/python benchmarks/strategy_step_time.py --compress bf16 --json out.json

Each rank runs with `torch.set_num_threads(--threads)` (default 1: two ranks on a
two-core machine would otherwise oversubscribe the cores with intra-op threads). The
"none (1 process)" row is a single process with no process group and the same thread
count: the compute-only floor.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import sys
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank(world_rank: int, world_size: int, port: int, args: argparse.Namespace, out_q) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch
    import torch.distributed as dist

    from raytrain_ddp.parallel.measure import time_strategies

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=world_rank,
                            world_size=world_size, timeout=timedelta(seconds=120))
    result = time_strategies(args.strategies, batch_size=args.batch_size, warmup=args.warmup,
                             rounds=args.rounds, bucket_cap_mb=args.bucket_cap_mb,
                             compress=args.compress)
    if world_rank == 0:
        out_q.put(result)
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64, help="per rank")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0)
    parser.add_argument("--compress", choices=["bf16"], default=None)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank")
    parser.add_argument("--strategies", nargs="+",
                        default=["none", "naive", "bucketed", "native", "torch_ddp"],
                        help="native = torch DDP behind our wrapper (with the counting comm hook); "
                             "torch_ddp = torch DDP untouched")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args(argv)

    ctx = mp.get_context("spawn")
    out_q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, args.world_size, port, args, out_q))
             for r in range(args.world_size)]
    for proc in procs:
        proc.start()
    result = out_q.get(timeout=900)
    for proc in procs:
        proc.join(timeout=60)
        if proc.is_alive():
            proc.kill()

    import torch

    from raytrain_ddp.parallel.measure import NO_COMM, time_strategies

    torch.set_num_threads(args.threads)
    single = time_strategies([NO_COMM], batch_size=args.batch_size, warmup=args.warmup, rounds=args.rounds)
    result[f"{NO_COMM} (1 process)"] = single[NO_COMM]

    bar = result.get("torch_ddp", result.get("native", {})).get("median_s")
    print(f"articles' MLP, {args.world_size} gloo ranks x batch {args.batch_size}, {args.threads} "
          f"thread(s)/rank, bucket_cap_mb={args.bucket_cap_mb}, compress={args.compress}, "
          f"median of {args.rounds} interleaved rounds ({args.warmup} warm-up excluded)")
    print(f"{'strategy':<20}{'median ms':>10}{'p10 ms':>9}{'p90 ms':>9}{'vs torch_ddp':>13}"
          f"{'calls/step':>11}{'MB/step':>9}")
    for name, r in result.items():
        ratio = f"{r['median_s'] / bar:.3f}" if bar else "-"
        print(f"{name:<20}{r['median_s'] * 1e3:>10.2f}{r['p10_s'] * 1e3:>9.2f}{r['p90_s'] * 1e3:>9.2f}"
              f"{ratio:>13}{r['allreduce_calls_per_step']:>11.1f}"
              f"{r['allreduce_bytes_per_step'] / 2**20:>9.2f}")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: (str(v) if isinstance(v, Path) else v)
                                                  for k, v in vars(args).items()},
                                         "results": result}, indent=2))
    return result


if __name__ == "__main__":
    main()
