"""`python -m raytrain_ddp ...` — what `ray job submit -- python -m raytrain_ddp train ...` runs."""

import sys

from raytrain_ddp.cli import main

sys.exit(main())
