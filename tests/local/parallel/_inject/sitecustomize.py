"""Test-only: break one from-scratch wrapper in every Python process started with this
directory first on PYTHONPATH (Python imports `sitecustomize` at start-up, so the ranks
that `raytrain-ddp verify` starts from its forkserver, a fresh interpreter, are broken too).
Nothing in the product knows about it.

    RAYTRAIN_DDP_TEST_BREAK="bucketed:head.4.weight"

After every sync, that strategy leaves that parameter's gradient summed over the ranks
instead of averaged (a forgotten division): the kind of bug `verify` exists to catch, and
one AdamW alone would hide (it is invariant to a constant gradient scale).
"""

import os

_SPEC = os.environ.get("RAYTRAIN_DDP_TEST_BREAK")
if _SPEC:
    from raytrain_ddp.parallel.bucketed import BucketedDDP
    from raytrain_ddp.parallel.naive import NaiveDDP

    _strategy, _, _target = _SPEC.partition(":")
    _cls, _method = {"bucketed": (BucketedDDP, "_finish"), "naive": (NaiveDDP, "_sync")}[_strategy]
    _sync = getattr(_cls, _method)

    def _forgets_to_average(self):
        _sync(self)
        for name, param in self._tracked:
            if name == _target and param.grad is not None:
                param.grad.mul_(self.world_size)

    setattr(_cls, _method, _forgets_to_average)
