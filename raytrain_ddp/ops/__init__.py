"""Operator tooling behind the CLI: cluster-file validation, plots, `verify`, the local rank launcher.

Owns: commands an operator runs beside training (`cluster validate`, `plot`, `verify`) and `ranks`, which starts W local processes with a gloo process group (`verify`
and the checkout's `benchmarks/` use it; tests reach it through `tests/_spawn.py`).
Must not touch: the training path (driver -> worker): nothing in `driver/` or `worker/`
imports from here.
"""
