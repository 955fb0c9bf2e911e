"""Regenerate docs/configuration.md from the config schema.

    .venv/bin/python tests/local/docs/gen_configuration.py

The table is exactly what `raytrain-ddp config --reference` prints; this script adds the
page's heading. `test_configuration_reference_is_current` fails when the page is stale.
"""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
PAGE = ROOT / "docs" / "configuration.md"

HEADER = """\
# Configuration reference

<!-- Generated from the config schema; do not edit by hand. Regenerate with:
     .venv/bin/python tests/local/docs/gen_configuration.py -->

Every key of a run's YAML config, with its default. The table is what
`raytrain-ddp config --reference` prints. Set a key in the YAML file, or on the command
line as `key.sub=value` (`raytrain-ddp train CONFIG train.lr=0.01`);
`raytrain-ddp config CONFIG [key.sub=value ...]` validates a config and prints the keys
that apply to it, resolved, without starting Ray (`--all`: every key, as a run's
config.yaml holds them). How these keys behave when a run is resumed with a changed config:
[the resume rules](usage.md#resuming-a-run).

"""


def reference_table() -> str:
    out = subprocess.run([sys.executable, "-m", "raytrain_ddp", "config", "--reference"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    if out.returncode != 0:
        raise RuntimeError(f"raytrain-ddp config --reference failed (exit {out.returncode}):\n{out.stderr[-2000:]}")
    return out.stdout.strip() + "\n"


def render() -> str:
    return HEADER + reference_table()


if __name__ == "__main__":
    PAGE.write_text(render())
    print(f"wrote {PAGE.relative_to(ROOT)}")
