"""The data room: where rows come from, how they are checked, and how each rank reads them.

The lowest layer of the product (data <- worker <- driver): it imports `config`, `job`,
`errors`, `rundir`, `batch` and `parallel.collectives`, never `worker`, `driver` or `ops`
(`tests/local/unit/test_data_room.py` checks it). Its modules, from the bottom:

- `columns`: split names, which columns a batch is built from, as what arrays.
- `steps`: optimizer steps per epoch and in the run, one formula for driver and workers.
- `sources`: parquet scan and checks, digits, synthetic, row counts (no Ray needed).
- `store`: the chunk store of `data.sharding: sharded`.
- `ray_datasets`: the Ray Datasets built on the driver (and the chunk stores written).
- `worker_data`: `WorkerData`, each rank's windows of micro-batches, one reader per mode.

Nothing is imported here, so `import raytrain_ddp.data.columns` stays cheap.
"""
