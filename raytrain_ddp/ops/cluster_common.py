"""What every `raytrain-ddp cluster validate` rule shares: a `Problem`, the installed Ray's
version, the image rule, and every shell command a cluster-launcher YAML runs.

Must not touch: the product (ops sits above it).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Any, Optional

IMAGE_RE = re.compile(r"^rayproject/ray:(?P<ver>\d+\.\d+\.\d+)-py(?P<py>3\d{1,2})-(?P<acc>cu\d{3}|cpu)$")


@dataclass(frozen=True)
class Problem:
    file: str
    key: str
    message: str
    fix: str

    def __str__(self) -> str:
        return f"{self.file}: {self.key or '<top>'}: {self.message}\n    fix: {self.fix}"


@functools.lru_cache(maxsize=None)
def ray_version() -> str:
    import ray

    return ray.__version__


def image_problem(name: str, key: str, image: Any, needs_cuda: bool) -> Optional[Problem]:
    version = ray_version()
    want = f"rayproject/ray:{version}-py311-cu128"
    image = str(image)
    if image.startswith("rayproject/ray-ml"):
        return Problem(name, key, f"{image!r} is a deprecated ray-ml image",
                       f"use {want} (this project installs its own ML dependencies)")
    m = IMAGE_RE.match(image)
    if not m:
        return Problem(name, key, f"{image!r} is not a pinned rayproject/ray image (<version>-py3XX-cuXXX); "
                       "'latest', bare or custom tags drift away from the Ray the project pins", f"use {want}")
    if m["ver"] != version:
        return Problem(name, key, f"{image!r} runs Ray {m['ver']}, but this project runs Ray {version}",
                       f"use {want}: driver and nodes must run the same Ray")
    if int(m["py"][1:]) < 10:
        return Problem(name, key, f"{image!r} has Python 3.{m['py'][1:]}; raytrain-ddp needs >= 3.10", f"use {want}")
    if needs_cuda and m["acc"] == "cpu":
        return Problem(name, key, f"{image!r} has no CUDA, but GPU workers run it", f"use {want}")
    return None


def all_commands(cfg: dict[str, Any]) -> list[tuple[str, str]]:
    out = []
    for key in ("initialization_commands", "setup_commands", "head_setup_commands", "worker_setup_commands",
                "head_start_ray_commands", "worker_start_ray_commands"):
        out += [(f"{key}[{i}]", str(c)) for i, c in enumerate(cfg.get(key) or [])]
    for tname, t in (cfg.get("available_node_types") or {}).items():
        for key in ("initialization_commands", "worker_setup_commands"):
            out += [(f"available_node_types.{tname}.{key}[{i}]", str(c)) for i, c in enumerate(t.get(key) or [])]
    docker = cfg.get("docker") or {}
    for key in ("run_options", "head_run_options", "worker_run_options"):
        out += [(f"docker.{key}[{i}]", str(c)) for i, c in enumerate(docker.get(key) or [])]
    return out
