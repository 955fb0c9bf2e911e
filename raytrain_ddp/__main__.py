"""`python -m raytrain_ddp ...` — what `ray job submit -- python -m raytrain_ddp train ...` runs."""

from raytrain_ddp.cli import console

console()
