"""`raytrain-ddp goodput RUN_DIR`'s picture: one timeline bar per fit, coloured by bucket.

Owns: drawing a report of `goodput.py` (the arithmetic is there). Must not touch:
Ray, torch, reading the run directory. Written beside `raytrain-ddp plot`'s curves
(`RUN_DIR/goodput.png`; for a run in object storage, `<name>-goodput.png` here).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

from raytrain_ddp.rundir import Location

COLOURS = {"productive": "tab:green", "startup": "tab:blue", "data_wait": "tab:olive", "exposed_comm": "tab:cyan",
           "checkpoint_stall": "tab:purple", "validation": "tab:pink", "redone": "tab:red", "recovery": "tab:orange",
           "shutdown": "tab:gray", "idle": "lightgray", "other": "black"}


def plot_goodput(rep: dict[str, Any], run_dir: Location, out: Optional[os.PathLike | str] = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    out = Path(out) if out else (run_dir.local_path / "goodput.png" if run_dir.is_local
                                 else Path(f"{run_dir.name}-goodput.png"))
    fits = rep["fits"]
    origin = fits[0]["start"] if fits else 0.0
    fig, ax = plt.subplots(figsize=(12, max(2.8, 1.2 + 0.5 * len(fits))))
    for row, fit in enumerate(fits):
        for name, start, end in fit["segments"]:
            if end > start:
                ax.barh(row, end - start, left=start - origin, color=COLOURS[name], height=0.6)
        if row + 1 < len(fits) and fits[row + 1]["start"] > fit["end"]:  # idle until the next fit
            ax.barh(row, fits[row + 1]["start"] - fit["end"], left=fit["end"] - origin, color=COLOURS["idle"],
                    height=0.2)
    ax.set_yticks(range(len(fits)), [f"fit {i + 1} ({f['status']})" for i, f in enumerate(fits)])
    ax.invert_yaxis()
    ax.set_xlabel("seconds since the run's first fit started")
    used = [name for name in COLOURS if rep["buckets"].get(name, 0) >= 0.005]
    ax.legend(handles=[Patch(color=COLOURS[n], label=n) for n in used], loc="center left",
              bbox_to_anchor=(1.01, 0.5), fontsize=8, frameon=False)
    ax.set_title(f"{run_dir.name}: goodput {100 * rep['goodput']:.1f}% of {rep['wall_s']:.1f} s")
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return out
