"""`raytrain-ddp cluster validate` for KubeRay manifests (RayCluster, RayJob): images,
GPU limits, the head's ports, auth and what the job runs.

Owns: the KubeRay half of the rules; `ops/cluster.py` owns the file walk, Ray's own schema
for cluster-launcher YAMLs and the rules both kinds share (`image_problem`, `Problem`).
Must not touch: the product (ops sits above it).
"""

from __future__ import annotations

import re
from typing import Any, Optional

import yaml

import raytrain_ddp

from raytrain_ddp.ops.cluster_common import Problem, image_problem, ray_version

STORAGE_VAR = "RAYTRAIN_DDP_STORAGE_PATH"  # where a cluster node tells the driver to write runs


def validate_kube(name: str, doc: dict[str, Any]) -> list[Problem]:
    kind = doc.get("kind")
    if kind == "Secret":
        data = {**(doc.get("data") or {}), **(doc.get("stringData") or {})}
        if data:
            return [Problem(name, "Secret.data", "a Secret with its value committed to the repository",
                            "create it with `kubectl create secret` (or let KubeRay's authOptions generate it)")]
        return []
    if not str(doc.get("apiVersion", "")).startswith("ray.io/"):
        return []
    if kind == "RayCluster":
        return _raycluster_rules(name, doc.get("spec") or {}, "spec")
    if kind == "RayJob":
        return _rayjob_rules(name, doc.get("spec") or {})
    return []


def _containers(pod_template: dict[str, Any]) -> list[dict[str, Any]]:
    return ((pod_template or {}).get("spec") or {}).get("containers") or []


def _gpu_limit(container: dict[str, Any]) -> Any:
    return ((container.get("resources") or {}).get("limits") or {}).get("nvidia.com/gpu")


def _raycluster_rules(name: str, spec: dict[str, Any], base: str) -> list[Problem]:
    problems = []
    version = ray_version()
    if str(spec.get("rayVersion")) != version:
        problems.append(Problem(name, f"{base}.rayVersion", f"is {spec.get('rayVersion')!r}, but this project runs Ray {version}",
                                f"set {base}.rayVersion: '{version}' (KubeRay adapts to it)"))
    if spec.get("enableInTreeAutoscaling") is not True:
        problems.append(Problem(name, f"{base}.enableInTreeAutoscaling", "autoscaling is off: GPU groups cannot scale from zero",
                                f"set {base}.enableInTreeAutoscaling: true"))
    if (spec.get("authOptions") or {}).get("mode") != "token":
        problems.append(Problem(name, f"{base}.authOptions.mode", "token authentication is not on",
                                f"set {base}.authOptions: {{mode: token}} (KubeRay >= 1.5.1 creates the Secret and "
                                "sets RAY_AUTH_TOKEN on every Ray container)"))
    head = spec.get("headGroupSpec") or {}
    hbase = f"{base}.headGroupSpec"
    if str((head.get("rayStartParams") or {}).get("num-gpus")) != "0":
        problems.append(Problem(name, f"{hbase}.rayStartParams.num-gpus", "the head may advertise GPUs",
                                f"set {hbase}.rayStartParams.num-gpus: '0' so no training worker lands on the head"))
    if head.get("serviceType", "ClusterIP") != "ClusterIP":
        problems.append(Problem(name, f"{hbase}.serviceType", f"is {head['serviceType']}: exposes 6379/8265/10001 "
                                "outside the cluster", "remove it (ClusterIP) and use `kubectl port-forward`"))
    if head.get("enableIngress"):
        problems.append(Problem(name, f"{hbase}.enableIngress", "publishes the dashboard / jobs API through an Ingress",
                                "remove it and use `kubectl port-forward svc/<cluster>-head-svc 8265:8265`"))
    for i, c in enumerate(_containers(head.get("template"))):
        ckey = f"{hbase}.template.spec.containers[{i}]"
        problems += _container_rules(name, ckey, c, needs_cuda=False)
        if _gpu_limit(c):
            problems.append(Problem(name, f"{ckey}.resources.limits.nvidia.com/gpu", "the head requests GPUs",
                                    "remove the GPU limit from the head; GPUs belong to worker groups"))
    groups = spec.get("workerGroupSpecs") or []
    gpu_groups = 0
    for g_i, group in enumerate(groups):
        gbase = f"{base}.workerGroupSpecs[{g_i}]"
        containers = _containers(group.get("template"))
        gpus = [_gpu_limit(c) for c in containers if _gpu_limit(c) is not None]
        for c_i, c in enumerate(containers):
            problems += _container_rules(name, f"{gbase}.template.spec.containers[{c_i}]", c, needs_cuda=bool(gpus))
        if not gpus:
            continue
        gpu_groups += 1
        for c_i, c in enumerate(containers):
            lim = _gpu_limit(c)
            if lim is not None and not re.fullmatch(r"[1-9]\d*", str(lim)):
                problems.append(Problem(name, f"{gbase}.template.spec.containers[{c_i}].resources.limits.nvidia.com/gpu",
                                        f"is {lim!r}: GPUs are whole numbers", "use an integer >= 1"))
        for key in ("minReplicas", "replicas"):
            if group.get(key, 0) != 0:
                problems.append(Problem(name, f"{gbase}.{key}", f"is {group[key]}: GPU pods stay up (and billed) "
                                        "with nothing to train", f"set {gbase}.{key}: 0; the autoscaler adds pods on demand"))
        if not isinstance(group.get("maxReplicas"), int) or group["maxReplicas"] < 1:
            problems.append(Problem(name, f"{gbase}.maxReplicas", "GPU group states no maxReplicas >= 1",
                                    f"set {gbase}.maxReplicas to the most GPU pods you want"))
    if not gpu_groups:
        problems.append(Problem(name, f"{base}.workerGroupSpecs", "no worker group requests nvidia.com/gpu",
                                "add a worker group whose container has resources.limits['nvidia.com/gpu']"))
    return problems


def _container_rules(name: str, key: str, c: dict[str, Any], needs_cuda: bool) -> list[Problem]:
    problems = []
    image_p = image_problem(name, f"{key}.image", c.get("image", ""), needs_cuda)
    if image_p:
        problems.append(image_p)
    for e_i, env in enumerate(c.get("env") or []):
        if env.get("name") == "RAY_AUTH_MODE" and env.get("value") != "token":
            problems.append(Problem(name, f"{key}.env[{e_i}]", f"RAY_AUTH_MODE={env.get('value')!r} turns token "
                                    "authentication off", "remove it or set it to token"))
        if env.get("name") == "RAY_AUTH_TOKEN" and "value" in env:
            problems.append(Problem(name, f"{key}.env[{e_i}]", "a token committed in the manifest",
                                    "use authOptions (KubeRay generates the Secret) or valueFrom.secretKeyRef"))
    return problems


def _rayjob_rules(name: str, spec: dict[str, Any]) -> list[Problem]:
    problems = []
    entry = str(spec.get("entrypoint", ""))
    if not re.search(r"python3? -m raytrain_ddp train\b", entry):
        problems.append(Problem(name, "spec.entrypoint", f"does not run the trainer: {entry!r}",
                                "use `python -m raytrain_ddp train <config> [overrides]`"))
    if spec.get("shutdownAfterJobFinishes") is not True:
        problems.append(Problem(name, "spec.shutdownAfterJobFinishes", "the cluster outlives the job (GPUs keep billing)",
                                "set spec.shutdownAfterJobFinishes: true"))
    for key, what in (("ttlSecondsAfterFinished", "how long the finished cluster is kept for its logs"),
                      ("activeDeadlineSeconds", "the most a run may take before KubeRay stops it")):
        if not isinstance(spec.get(key), int) or spec[key] < (0 if key.startswith("ttl") else 1):
            problems.append(Problem(name, f"spec.{key}", "missing or not a positive whole number of seconds",
                                    f"set spec.{key}: {what}"))
    runtime = spec.get("runtimeEnvYAML")
    version = raytrain_ddp.__version__
    try:
        env = yaml.safe_load(runtime) if isinstance(runtime, str) else (runtime or {})
    except yaml.YAMLError as exc:
        env = None
        problems.append(Problem(name, "spec.runtimeEnvYAML", f"not valid YAML: {exc}", "fix the embedded YAML"))
    if env is not None:
        pip = (env or {}).get("pip") or []
        packages = pip.get("packages", []) if isinstance(pip, dict) else pip
        pinned = [p for p in packages if re.match(r"raytrain[-_]ddp==", str(p))]
        if not pinned or pinned[0].split("==", 1)[1] != version:
            problems.append(Problem(name, "spec.runtimeEnvYAML.pip", f"does not install raytrain-ddp=={version}",
                                    f"list raytrain-ddp=={version} under pip.packages"))
    if "rayClusterSpec" not in spec:
        problems.append(Problem(name, "spec.rayClusterSpec", "missing: the job needs its own cluster to shut down",
                                "add spec.rayClusterSpec (see cluster/kuberay/raycluster.yaml)"))
    else:
        problems += _raycluster_rules(name, spec["rayClusterSpec"] or {}, "spec.rayClusterSpec")
    return problems


def kube_storage(doc: dict[str, Any]) -> Optional[tuple[str, Optional[str]]]:
    """(key, value) of the run storage a RayCluster / RayJob with workers sets, None without workers."""
    if not str(doc.get("apiVersion", "")).startswith("ray.io/") or doc.get("kind") not in ("RayCluster", "RayJob"):
        return None
    spec = doc.get("spec") or {}
    base = "spec.rayClusterSpec" if doc["kind"] == "RayJob" else "spec"
    cluster = (spec.get("rayClusterSpec") if doc["kind"] == "RayJob" else spec) or {}
    if not any((g or {}).get("maxReplicas", 0) for g in cluster.get("workerGroupSpecs") or []):
        return None
    if doc["kind"] == "RayJob" and (m := re.search(r"run\.storage_path=(\S+)", str(spec.get("entrypoint", "")))):
        return "spec.entrypoint", m.group(1)
    head = (cluster.get("headGroupSpec") or {}).get("template")  # the driver runs on the head
    for c_i, c in enumerate(_containers(head)):
        for e_i, env in enumerate(c.get("env") or []):
            if env.get("name") == STORAGE_VAR:
                return f"{base}.headGroupSpec.template.spec.containers[{c_i}].env[{e_i}]", env.get("value")
    return f"{base}.headGroupSpec.template.spec.containers[0].env", None
