"""`raytrain-ddp cluster validate`'s warnings about run storage: a multi-node cluster whose
runs would write checkpoints to a node's local disk.

Owns: finding `RAYTRAIN_DDP_STORAGE_PATH` (or a RayJob's `run.storage_path=`) in a
cluster-launcher YAML or a KubeRay manifest and judging it. Must not touch: the product.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Optional

import yaml

from raytrain_ddp.ops.cluster_common import Problem, all_commands
from raytrain_ddp.ops.kuberay import STORAGE_VAR, kube_storage

_STORAGE_RE = re.compile(rf"{STORAGE_VAR}=(\S+)")


def storage_warnings(path: Path) -> list[Problem]:
    """Clusters with worker nodes whose runs would be written to a local path (see the module docstring)."""
    from raytrain_ddp.rundir import is_object_store

    try:
        docs = [d for d in yaml.safe_load_all(path.read_text()) if isinstance(d, dict)]
    except (OSError, yaml.YAMLError):
        return []  # validate_file reports it
    out = []
    for doc in docs:
        found = _launcher_storage(doc) if ("provider" in doc or "cluster_name" in doc) else kube_storage(doc)
        if found is None:
            continue
        key, value = found
        if value is None:
            out.append(Problem(str(path), key, f"a multi-node cluster without {STORAGE_VAR}: runs default to ./runs on "
                               "the node that runs the driver, and checkpoints scatter over the nodes",
                               f"set {STORAGE_VAR}=s3://BUCKET/PREFIX (or gs://, abfs://) on every node"))
        elif not is_object_store(value):
            out.append(Problem(str(path), key, f"run storage {value!r} is a local path on a multi-node cluster: "
                               "unless every node mounts it at that path (NFS), restarts cannot find checkpoints",
                               "use object storage: s3://BUCKET/PREFIX, gs://BUCKET/PREFIX or abfs://..."))
    return out


def _launcher_storage(cfg: dict[str, Any]) -> Optional[tuple[str, Optional[str]]]:
    provider = cfg.get("provider") or {}
    workers = len(provider.get("worker_ips") or []) if provider.get("type") == "local" else cfg.get("max_workers", 2)
    if not workers:
        return None
    for i, opt in enumerate((cfg.get("docker") or {}).get("run_options") or []):
        if m := _STORAGE_RE.search(str(opt)):
            return f"docker.run_options[{i}]", m.group(1)
    for key, cmd in all_commands(cfg):
        if m := _STORAGE_RE.search(cmd):
            return key, m.group(1)
    return "docker.run_options", None
