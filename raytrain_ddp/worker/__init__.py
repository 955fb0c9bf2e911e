"""The per-rank side: what every Ray Train worker runs, from first step to last checkpoint.

`loop.train_loop_per_worker` is the entry point handed to `TorchTrainer`; it composes
components that own their state and cadence (`state`, `checkpointer`, `meter`, `shard`,
`preemption`) and the one step (`step`). Must not touch: Ray's cluster APIs (only
`ray.train` context, dataset shards, report and checkpoints), the driver.
"""
