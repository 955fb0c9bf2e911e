"""The rank launcher for tests: `raytrain_ddp.ops.ranks` (the benchmarks and `verify` use it too)."""

from raytrain_ddp.ops.ranks import RankError, RankException, RankFailed, RankTimeout, free_port, run_ranks

__all__ = ["RankError", "RankException", "RankFailed", "RankTimeout", "free_port", "run_ranks"]
