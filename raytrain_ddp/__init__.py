"""raytrain_ddp: data-parallel PyTorch training on Ray clusters.

The package is layered so data flows one way: cli -> config -> launcher -> loop ->
{parallel, data, checkpoint, metrics}. `raytrain_ddp.parallel` depends on torch only.
"""

__version__ = "0.1.0"
