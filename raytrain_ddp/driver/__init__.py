"""The driver side: the command line, the launch on Ray, and what the user sees.

`cli` parses and dispatches; `launcher` connects to Ray, builds the `TorchTrainer` and
writes the summary; `resume` decides where a run starts; `datasets` checks and builds the
Ray Datasets; `console` prints the plan, progress and summary. Must not touch: the
per-rank loop's internals (`raytrain_ddp.worker`), gradient synchronisation.
"""
