"""The driver side: the command line, the launch on Ray, and what the user sees.

`cli` parses and dispatches; `launcher` connects to Ray, builds the `TorchTrainer` and
writes the summary; `resume` decides where a run starts; `preflight` refuses what it can
before Ray starts (the data's `precheck` among it); `console` prints the plan, progress and
summary. The data itself (sources, checks, Ray Datasets, each rank's reader) is
`raytrain_ddp.data`'s. Must not touch: the per-rank loop's internals (`raytrain_ddp.worker`),
gradient synchronisation.
"""
