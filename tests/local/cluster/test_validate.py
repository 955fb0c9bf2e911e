"""`raytrain-ddp cluster validate` on the shipped files and on broken copies of them.

Each mutation is a mistake that would hurt on a real cloud (an image that drifts, GPUs on
the head, GPU nodes billed while idle, a public dashboard, a fractional resource Ray's
schema rejects, auth off); the validator must reject it and name the key.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Callable

import pytest
import yaml

from raytrain_ddp.ops import cluster as cv
from raytrain_ddp.ops.cluster_storage import storage_warnings
from raytrain_ddp.cli import main as cli_main

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[3]
CLUSTER = REPO / "cluster"
SHIPPED = sorted(p.relative_to(REPO).as_posix() for p in CLUSTER.rglob("*.yaml"))


def test_shipped_files_are_the_expected_set():
    assert SHIPPED == ["cluster/aws.yaml", "cluster/azure.yaml", "cluster/gcp.yaml",
                       "cluster/kuberay/raycluster.yaml", "cluster/kuberay/rayjob.yaml", "cluster/onprem.yaml"]


def test_every_shipped_file_passes(capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    assert cli_main(["cluster", "validate"]) == 0  # default: everything under cluster/
    out = capsys.readouterr().out
    assert f"{len(SHIPPED)} file(s), 0 problem(s)" in out


def test_image_pin_follows_the_installed_ray():
    import ray

    for name in ("aws", "gcp", "azure", "onprem"):
        cfg = yaml.safe_load((CLUSTER / f"{name}.yaml").read_text())
        assert cfg["docker"]["image"].startswith(f"rayproject/ray:{ray.__version__}-py311-cu12")
    for name in ("raycluster", "rayjob"):
        doc = yaml.safe_load((CLUSTER / "kuberay" / f"{name}.yaml").read_text())
        spec = doc["spec"].get("rayClusterSpec", doc["spec"])
        assert spec["rayVersion"] == ray.__version__


def _set(*path: Any, value: Any) -> Callable[[dict], None]:
    def mutate(doc: dict) -> None:
        node = doc
        for part in path[:-1]:
            node = node[part]
        node[path[-1]] = value
    return mutate


def _open_8265(doc: dict) -> None:
    doc["provider"]["security_group"] = {"GroupName": "raytrain", "IpPermissions": [
        {"FromPort": 8265, "ToPort": 8265, "IpProtocol": "tcp", "IpRanges": [{"CidrIp": "0.0.0.0/0"}]}]}


def _head_cmd(doc: dict) -> None:
    doc["head_start_ray_commands"][1] = doc["head_start_ray_commands"][1].replace(
        "--dashboard-host=127.0.0.1", "--dashboard-host=0.0.0.0")


def _no_auth_on_workers(doc: dict) -> None:
    doc["worker_start_ray_commands"][1] = doc["worker_start_ray_commands"][1].replace("export RAY_AUTH_MODE=token; ", "")


def _publish(doc: dict) -> None:
    doc["docker"]["run_options"].append("-p 8265:8265")


def _no_token_mount(doc: dict) -> None:
    del doc["file_mounts"]["~/.ray/auth_token"]


def _rayjob_cluster(*path: Any, value: Any) -> Callable[[dict], None]:
    return _set("spec", "rayClusterSpec", *path, value=value)


GPU_GROUP = ("spec", "workerGroupSpecs", 0)
GPU_LIMIT = (*GPU_GROUP, "template", "spec", "containers", 0, "resources", "limits", "nvidia.com/gpu")

CASES = [
    # (file, mutation, key the message must name, words the message must contain)
    ("aws.yaml", _set("docker", "image", value="rayproject/ray:latest-gpu"), "docker.image", "not a pinned"),
    ("gcp.yaml", _set("docker", "image", value="rayproject/ray:2.59.0-py311-cu128"), "docker.image", "runs Ray 2.59.0"),
    ("azure.yaml", _set("docker", "image", value="rayproject/ray-ml:2.60.0-py311-gpu"), "docker.image", "deprecated"),
    ("aws.yaml", _set("available_node_types", "head", "resources", "GPU", value=1),
     "available_node_types.head.resources.GPU", "no GPUs"),
    ("gcp.yaml", _set("available_node_types", "gpu_spot", "min_workers", value=2),
     "available_node_types.gpu_spot.min_workers", "billed"),
    ("aws.yaml", _open_8265, "provider.security_group.IpPermissions[0]", "8265"),
    ("azure.yaml", _head_cmd, "head_start_ray_commands[1]", "loopback"),
    ("gcp.yaml", _publish, "docker.run_options[3]", "8265"),
    ("aws.yaml", _set("available_node_types", "gpu_ondemand", "resources", "GPU", value=1.5),
     "available_node_types.gpu_ondemand.resources.GPU", "not of type 'integer'"),
    ("aws.yaml", _no_auth_on_workers, "worker_start_ray_commands[1]", "RAY_AUTH_MODE=token"),
    ("gcp.yaml", _set("setup_commands", 0, value="export RAY_AUTH_MODE=disabled"), "setup_commands[0]", "off"),
    ("azure.yaml", _no_token_mount, "file_mounts", "token"),
    ("aws.yaml", _set("setup_commands", 2, value="pip install raytrain-ddp==0.0.1"), "setup_commands[2]", "0.0.1"),
    ("onprem.yaml", _set("min_workers", value=0), "min_workers", "never starts a GPU"),
    ("onprem.yaml", _set("head_start_ray_commands", 1, value="export RAY_AUTH_MODE=token; ray start --head "
                         "--dashboard-host=127.0.0.1"), "head_start_ray_commands", "--num-gpus=0"),
    ("aws.yaml", _set("available_node_types", "gpu_spot", "bogus", value=1),
     "available_node_types.gpu_spot", "Additional properties"),
    ("kuberay/raycluster.yaml", _set("spec", "rayVersion", value="2.59.0"), "spec.rayVersion", "2.59.0"),
    ("kuberay/raycluster.yaml", _set(*GPU_GROUP, "minReplicas", value=1), "spec.workerGroupSpecs[0].minReplicas", "billed"),
    ("kuberay/raycluster.yaml", _set("spec", "authOptions", value=None), "spec.authOptions.mode", "token"),
    ("kuberay/raycluster.yaml", _set("spec", "headGroupSpec", "serviceType", value="LoadBalancer"),
     "spec.headGroupSpec.serviceType", "8265"),
    ("kuberay/raycluster.yaml", _set(*GPU_LIMIT, value="1.5"),
     "spec.workerGroupSpecs[0].template.spec.containers[0].resources.limits.nvidia.com/gpu", "whole"),
    ("kuberay/raycluster.yaml", _set("spec", "headGroupSpec", "template", "spec", "containers", 0, "image",
                                     value="rayproject/ray:latest"), "spec.headGroupSpec.template.spec.containers[0].image",
     "not a pinned"),
    ("kuberay/rayjob.yaml", _set("spec", "shutdownAfterJobFinishes", value=False), "spec.shutdownAfterJobFinishes", "billing"),
    ("kuberay/rayjob.yaml", _set("spec", "activeDeadlineSeconds", value=None), "spec.activeDeadlineSeconds", "seconds"),
    ("kuberay/rayjob.yaml", _set("spec", "entrypoint", value="python train.py"), "spec.entrypoint", "trainer"),
    ("kuberay/rayjob.yaml", _rayjob_cluster("headGroupSpec", "rayStartParams", value={}),
     "spec.rayClusterSpec.headGroupSpec.rayStartParams.num-gpus", "GPUs"),
]


@pytest.mark.parametrize("rel, mutate, key, words", CASES, ids=[f"{c[0]}:{c[2]}" for c in CASES])
def test_mutation_is_rejected_naming_the_key(tmp_path, rel, mutate, key, words):
    doc = yaml.safe_load((CLUSTER / rel).read_text())
    broken = copy.deepcopy(doc)
    mutate(broken)
    path = tmp_path / Path(rel).name
    path.write_text(yaml.safe_dump(broken, sort_keys=False))
    problems = cv.validate_file(path)
    assert problems, f"{rel}: mutation to {key} was accepted"
    hits = [p for p in problems if p.key == key]
    assert hits, f"no problem names {key!r}; got {[p.key for p in problems]}"
    text = str(hits[0])
    assert words in text and str(path) in text and "fix:" in text


def test_cli_exit_code_and_report(tmp_path, capsys):
    doc = yaml.safe_load((CLUSTER / "aws.yaml").read_text())
    doc["available_node_types"]["head"]["resources"]["GPU"] = 4
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(doc))
    assert cli_main(["cluster", "validate", str(bad), str(CLUSTER / "gcp.yaml")]) == 1
    out = capsys.readouterr().out
    assert f"{bad}: available_node_types.head.resources.GPU: the head must advertise no GPUs, got GPU: 4" in out
    assert "2 file(s), 1 problem(s)" in out


def test_missing_and_foreign_files_are_problems(tmp_path, capsys):
    other = tmp_path / "values.yaml"
    other.write_text("replicaCount: 2\n")
    assert cv.main([str(tmp_path / "nope.yaml"), str(other)]) == 1
    out = capsys.readouterr().out
    assert "no such file or directory" in out and "neither a Ray cluster-launcher YAML" in out


def test_committed_secret_is_rejected(tmp_path):
    f = tmp_path / "secret.yaml"
    f.write_text("apiVersion: v1\nkind: Secret\nmetadata: {name: t}\nstringData: {auth_token: abc}\n")
    assert [p.key for p in cv.validate_file(f)] == ["Secret.data"]


def test_local_run_storage_on_a_multi_node_cluster_is_a_warning(tmp_path, capsys):
    """Shipped files point every node at a bucket; a local path or none is warned about (not a failure)."""
    assert all(not storage_warnings(CLUSTER / rel.removeprefix("cluster/")) for rel in SHIPPED)
    aws = (CLUSTER / "aws.yaml").read_text()
    assert "--env RAYTRAIN_DDP_STORAGE_PATH=s3://" in aws and "IamInstanceProfile" in aws
    local = tmp_path / "aws.yaml"
    local.write_text(aws.replace("s3://YOUR-BUCKET/raytrain-ddp", "/mnt/runs"))
    job = yaml.safe_load((CLUSTER / "kuberay" / "rayjob.yaml").read_text())
    job["spec"]["entrypoint"] += " run.storage_path=/mnt/runs"
    kube = tmp_path / "rayjob.yaml"
    kube.write_text(yaml.safe_dump(job, sort_keys=False))
    unset = tmp_path / "raycluster.yaml"
    unset.write_text("\n".join(line for line in (CLUSTER / "kuberay" / "raycluster.yaml").read_text().splitlines()
                               if "RAYTRAIN_DDP_STORAGE_PATH" not in line))
    warned = {p.name: [w.key for w in storage_warnings(p)] for p in (local, kube, unset)}
    assert warned == {"aws.yaml": ["docker.run_options[2]"], "rayjob.yaml": ["spec.entrypoint"],
                      "raycluster.yaml": ["spec.headGroupSpec.template.spec.containers[0].env"]}
    assert cli_main(["cluster", "validate", str(local), str(kube), str(unset)]) == 0  # warnings do not fail
    out = capsys.readouterr().out
    assert "warning: " in out and "'/mnt/runs' is a local path on a multi-node cluster" in out
    assert "3 file(s), 0 problem(s), 3 warning(s)" in out


def test_without_jsonschema_one_line_names_the_extra(capsys, monkeypatch):
    """jsonschema is the `cluster` extra: without it, one line naming the install, exit 2."""
    import sys

    monkeypatch.setitem(sys.modules, "jsonschema", None)  # `import jsonschema` raises ImportError
    monkeypatch.chdir(REPO)
    assert cli_main(["cluster", "validate"]) == 2
    captured = capsys.readouterr()
    lines = (captured.out + captured.err).strip().splitlines()
    assert len(lines) == 1 and "pip install raytrain-ddp[cluster]" in lines[0], lines
