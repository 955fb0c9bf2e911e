"""Cross-field checks of a whole `Config`, each error naming its keys and what would work.

Owns: the batch arithmetic (global = workers x micro x accumulation, for every worker
count of an elastic range, with suggestions), data.chunk_rows against the micro batch,
the parallel options a strategy takes (read from `parallel/registry.py`), and precision
against the hardware. Must not touch: loading, the filesystem, torch.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Optional, Union

from raytrain_ddp.launch import table as launchers
from raytrain_ddp.parallel import registry

if TYPE_CHECKING:
    from raytrain_ddp.config import Config


def cross_field(cfg: "Config") -> None:
    """Raise a ValueError naming the keys when `cfg` (a `Config`) is inconsistent."""
    valid = cfg.valid_worker_counts()
    if not valid:
        raise ValueError(batch_error(cfg))
    invalid = sorted(set(range(cfg.scaling.min_workers, cfg.scaling.max_workers + 1)) - set(valid))
    if invalid:
        # Ray's elastic policy may start any size in [min, max]; a size that cannot keep
        # the global batch exact must be excluded before the run, not discovered mid-run.
        raise ValueError(_elastic_error(cfg, valid, invalid))
    chunk = cfg.data.chunk_rows
    if chunk is not None and cfg.train.micro_batch_size % chunk:
        raise ValueError(
            f"data.chunk_rows={chunk} must divide train.micro_batch_size={cfg.train.micro_batch_size} "
            "(each rank reads whole chunks)"
        )
    _check_parallel(cfg)
    if cfg.run.validation == "async" and cfg.run.checkpoint_every_epochs != 1:
        raise ValueError(  # async validates the epoch-end checkpoint: an epoch without one would go unvalidated
            f"run.validation=async validates the checkpoint saved at each epoch end, and "
            f"run.checkpoint_every_epochs={cfg.run.checkpoint_every_epochs} saves one every "
            f"{cfg.run.checkpoint_every_epochs} epochs: set run.checkpoint_every_epochs=1, or run.validation=inline"
        )
    refused = launchers.refusal(cfg)  # what the launcher's row does not support
    if refused:
        raise ValueError(refused)
    # fp16 with zero1 / fsdp: the scaler's overflow verdict is the same on every rank
    # (zero1 agrees on non-finite shards, FSDP2's DTensor unscale all-reduces found_inf).
    if cfg.train.precision == "fp16" and not cfg.scaling.use_gpu:
        raise ValueError(
            "train.precision='fp16' needs scaling.use_gpu=true (CPU autocast supports bf16 only)"
        )


def _check_parallel(cfg: "Config") -> None:
    """parallel.* against the strategy's row of the registry."""
    p = cfg.parallel
    spec = registry.get(p.strategy, "parallel.strategy")
    if p.compress and "compress" not in spec.options:
        raise ValueError(f"parallel.compress is supported by {registry.quoted(registry.accepting('compress'))}, "
                         f"not {p.strategy!r}")
    for key in ("bucket_cap_mb", "compress"):
        if getattr(p, key) == "auto" and not spec.tunes:
            raise ValueError(f"parallel.{key}=auto (timed tuning) is supported by parallel.strategy="
                             f"{' or '.join(registry.TUNERS)} only, not {p.strategy!r}; set a value instead")
    if cfg.train.compile is not False and not spec.compiles:
        raise ValueError(f"train.compile is not supported with parallel.strategy={p.strategy!r} "
                         f"({registry.COMPILE_REFUSAL}); use {' or '.join(registry.COMPILERS)}, or train.compile=false")
    if cfg.train.precision not in spec.precision:
        raise ValueError(f"train.precision={cfg.train.precision!r} is not supported by parallel.strategy="
                         f"{p.strategy!r} (it supports {', '.join(spec.precision)})")


def batch_error(cfg: "Config", num_workers: Optional[int] = None) -> str:
    g, b = cfg.train.global_batch_size, cfg.train.micro_batch_size
    lo, hi = (num_workers, num_workers) if num_workers else (cfg.scaling.min_workers, cfg.scaling.max_workers)
    span = math.lcm(*range(lo, min(hi, lo + _MAX_SUGGEST_SPAN) + 1))
    micro_ok = [m for m in _divisors(g // span)] if g % span == 0 else []
    global_ok = [span * b * k for k in range(1, 5)]
    workers_ok = [w for w in range(1, 65) if g % (w * b) == 0]
    where = (f"scaling.num_workers={num_workers}" if num_workers
             else f"scaling.num_workers={fmt_workers(cfg.scaling.num_workers)}")
    micro_hint = (f"valid train.micro_batch_size for these workers: {micro_ok}; " if micro_ok
                  else f"no train.micro_batch_size fits {where} with this global batch; ")
    return (
        f"train.global_batch_size={g} is not divisible by {where} x train.micro_batch_size={b}; "
        f"global_batch_size must equal workers x micro_batch_size x accumulation steps. "
        f"{micro_hint[0].upper()}{micro_hint[1:]}"
        f"valid train.global_batch_size: {global_ok}...; "
        + (f"worker counts that work with these batch sizes: {workers_ok}" if workers_ok
           else "no worker count works with these batch sizes")
    )


def _elastic_error(cfg: "Config", valid: list[int], invalid: list[int]) -> str:
    g, b = cfg.train.global_batch_size, cfg.train.micro_batch_size
    lo, hi = cfg.scaling.min_workers, cfg.scaling.max_workers
    every = math.lcm(*range(lo, min(hi, lo + _MAX_SUGGEST_SPAN) + 1)) * b
    runs = _contiguous_runs(valid)
    return (
        f"scaling.num_workers=[{lo}, {hi}]: worker counts {invalid} cannot keep "
        f"train.global_batch_size={g} exact with train.micro_batch_size={b}; valid counts are {valid}. "
        f"Use a range of valid counts (e.g. {', '.join(f'[{r[0]}, {r[-1]}]' for r in runs)}) or a "
        f"train.global_batch_size that every count divides (a multiple of {every})"
    )


def _contiguous_runs(values: list[int]) -> list[list[int]]:
    runs: list[list[int]] = []
    for v in values:
        if runs and runs[-1][-1] + 1 == v:
            runs[-1].append(v)
        else:
            runs.append([v])
    return runs


_MAX_SUGGEST_SPAN = 16  # suggestions use lcm(min..max); beyond this span it explodes


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def fmt_workers(value: Union[int, tuple[int, int]]) -> str:
    return f"[{value[0]}, {value[1]}]" if isinstance(value, tuple) else str(value)


def default_chunk_rows(micro_batch_size: int) -> int:
    """The largest divisor of the micro batch that is at most 64 (the micro batch itself when
    that divisor would be under 8: a handful of rows per read costs more than it shuffles)."""
    best = max(d for d in range(1, min(64, micro_batch_size) + 1) if micro_batch_size % d == 0)
    return best if best >= 8 or micro_batch_size <= 64 else micro_batch_size
