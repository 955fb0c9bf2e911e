"""Wheels of distributions already installed here, for tests that need a wheel folder offline.

`repack(name, dest)` zips an installed distribution's files (its RECORD, `.pyc` and scripts
left out) back into `<name>-<version>-<tag>.whl`: what `pip download` would have fetched, for
`benchmarks/gpu.sh --dry-run`'s test (its carried wheels must match this machine's Python, and
a test may not reach an index). Test-only.
"""

from __future__ import annotations

import importlib.metadata as md
import zipfile
from pathlib import Path


def repack(name: str, dest: Path) -> Path:
    dist = md.distribution(name)
    wheel = next(f for f in dist.files or [] if f.name == "WHEEL" and f.parent.name.endswith(".dist-info"))
    wheel_meta = Path(dist.locate_file(wheel)).read_text()
    tag = next(line.split(":", 1)[1].strip() for line in wheel_meta.splitlines() if line.startswith("Tag:"))
    stem = f"{dist.metadata['Name'].replace('-', '_')}-{dist.version}-{tag}"
    root = Path(dist.locate_file(""))
    out = Path(dest) / f"{stem}.whl"
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as zf:
        for f in dist.files or []:
            rel = str(f)
            if rel.startswith("..") or "__pycache__" in rel or rel.endswith(".pyc"):
                continue
            path = root / rel
            if path.is_file():
                zf.write(path, rel)
    return out
