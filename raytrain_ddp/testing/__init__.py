"""Test-only machinery: fault plans, simulated preemption, the rank launcher for tests.

Product modules never import this package. Workers reach it only through the hooks
interface (`raytrain_ddp.worker.hooks`): a test names a hooks factory here in
`RAYTRAIN_DDP_HOOKS` and the worker imports it by that path.
"""
