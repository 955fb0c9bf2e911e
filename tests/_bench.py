"""What the bench's tests share: the variants its strategy section times, and a figure check."""

from __future__ import annotations

import math

VARIANTS = ("single", "naive", "bucketed_1mb", "bucketed_25mb", "bucketed_100mb", "bucketed_25mb_gloo",
            "bucketed_auto", "native", "torch_ddp")
TIMED = ("naive", "bucketed_1mb", "bucketed_25mb", "bucketed_100mb", "bucketed_25mb_gloo", "bucketed_auto",
         "native")  # comm_stats timing


def positive(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0
