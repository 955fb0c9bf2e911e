"""`raytrain-ddp cluster validate`: check cluster files before they meet a cloud.

Owns: validating Ray cluster-launcher YAMLs (against Ray's own JSON schema, read from the
installed `ray` package after Ray's own default-filling, plus our rules) and KubeRay
`RayCluster` / `RayJob` manifests (the fields this project relies on). Every problem names
the file, the key path and the fix; the exit code is 1 when any problem is found.
Must not touch: Ray runtime (nothing here starts or contacts a cluster), the training path.
Needs `jsonschema`, the `cluster` extra (`pip install raytrain-ddp[cluster]`): without
it, the command stops with one line saying so; training never needs it.

Our rules, and why:
* image: `rayproject/ray:<installed Ray>-py3XX-cuXXX`. A different Ray on the nodes than
  in the driver fails at connect time; `latest` drifts; `ray-ml` images are deprecated.
* head advertises `GPU: 0`: a training worker on the head competes with the GCS and
  dashboard, and the head is usually a CPU machine anyway.
* GPU worker types autoscale from `min_workers: 0` to a stated `max_workers`: idle GPUs
  are the dominant cost. (On-prem `local` provider: all listed hosts, see onprem.yaml.)
* no public 6379 / 8265 / 10001 (GCS, dashboard + jobs API, client): each runs code on
  the cluster; the dashboard is reached with `ray dashboard` (SSH port-forward).
* token authentication on (`RAY_AUTH_MODE=token` for every `ray start`, the token file
  mounted, never a token in the file); setup installs this project at this version.

Warnings (printed, not failures): a cluster with worker nodes whose runs would land on a
local path -- `RAYTRAIN_DDP_STORAGE_PATH` (run.storage_path's default on the nodes: the
launcher YAMLs set it in `docker.run_options`, the KubeRay manifests in the containers'
env, a RayJob may pass `run.storage_path=` in its entrypoint) missing or not an object
store URI. Each node would keep its own checkpoints; a bucket (or NFS every node mounts)
is what a restart on another node can read. The KubeRay rules are in `ops/kuberay.py`, the
storage warnings in `ops/cluster_storage.py`.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import io
import ipaddress
import json
import logging
import re
import shlex
from importlib import resources
from pathlib import Path
from typing import Any, Iterable, Optional

import yaml

import raytrain_ddp
from raytrain_ddp.errors import UserError
from raytrain_ddp.ops.cluster_common import IMAGE_RE, Problem, all_commands, image_problem, ray_version
from raytrain_ddp.ops.cluster_storage import storage_warnings
from raytrain_ddp.ops.kuberay import validate_kube

GUARDED_PORTS = {6379: "GCS", 8265: "dashboard / jobs API", 10001: "Ray Client server"}


@functools.lru_cache(maxsize=None)
def ray_schema() -> dict[str, Any]:
    """Ray's own launcher schema, from the installed package (never a copy)."""
    return json.loads((resources.files("ray.autoscaler") / "ray-schema.json").read_text())


def key_path(parts: Iterable[Any]) -> str:
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


# --------------------------------------------------------------------------- entry point

JSONSCHEMA_MISSING = ("raytrain-ddp cluster validate needs the jsonschema package (Ray's schema "
                      "check): pip install raytrain-ddp[cluster]")


def main(files: list[str]) -> int:
    _require_jsonschema()
    paths, problems = _expand(files or ["cluster"])
    warnings: list[Problem] = []
    for path in paths:
        problems.extend(validate_file(path))
        warnings.extend(storage_warnings(path))
    for problem in problems:
        print(problem)
    for warning in warnings:
        print(f"warning: {warning}")
    print(f"raytrain-ddp cluster validate: {len(paths)} file(s), {len(problems)} problem(s)"
          + (f", {len(warnings)} warning(s)" if warnings else "") + ("" if problems else " -- all good"))
    return 1 if problems else 0


def _require_jsonschema() -> None:
    try:
        import jsonschema  # noqa: F401
    except ImportError:
        raise UserError(JSONSCHEMA_MISSING) from None


def _expand(items: list[str]) -> tuple[list[Path], list[Problem]]:
    paths: list[Path] = []
    problems: list[Problem] = []
    for item in items:
        p = Path(item)
        if p.is_dir():
            found = sorted(x for x in p.rglob("*") if x.suffix in (".yaml", ".yml") and x.is_file())
            if not found:
                problems.append(Problem(item, "", "directory holds no .yaml/.yml files",
                                        "pass cluster files or the cluster/ directory"))
            paths.extend(found)
        elif p.is_file():
            paths.append(p)
        else:
            problems.append(Problem(item, "", "no such file or directory",
                                    "run from the repository root or pass the path to a cluster YAML"))
    return paths, problems


def validate_file(path: Path) -> list[Problem]:
    name = str(path)
    try:
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    except yaml.YAMLError as exc:
        return [Problem(name, "", f"not valid YAML: {exc}", "fix the YAML syntax at the position shown")]
    if not docs:
        return [Problem(name, "", "file is empty", "remove it or add a cluster definition")]
    problems: list[Problem] = []
    for doc in docs:
        if not isinstance(doc, dict):
            problems.append(Problem(name, "", f"top level is a {type(doc).__name__}, not a mapping",
                                    "a cluster file is a mapping of keys"))
        elif "apiVersion" in doc and "kind" in doc:
            problems.extend(validate_kube(name, doc))
        elif "provider" in doc or "cluster_name" in doc:
            problems.extend(validate_launcher(name, doc))
        else:
            problems.append(Problem(name, "", "neither a Ray cluster-launcher YAML (cluster_name, provider) "
                                    "nor a Kubernetes manifest (apiVersion, kind)",
                                    "move it out of cluster/ or add the missing keys"))
    return problems


# --------------------------------------------------------------------------- launcher YAMLs

def validate_launcher(name: str, cfg: dict[str, Any]) -> list[Problem]:
    problems = ray_schema_problems(name, cfg)
    if problems:  # our rules assume the shapes the schema guarantees
        return problems
    rules = [_image_rules, _port_rules, _auth_rules, _install_rules]
    rules.append(_local_rules if cfg["provider"].get("type") == "local" else _node_type_rules)
    for rule in rules:
        problems.extend(rule(name, cfg))
    return problems


def ray_schema_problems(name: str, cfg: dict[str, Any]) -> list[Problem]:
    """What `ray up` itself would reject: Ray fills in its provider defaults, then checks
    the result against ray-schema.json and its own cross-field rules."""
    import jsonschema

    from raytrain_ddp.ray_compat import autoscaler_config_checks

    prepare_config, validate_config = autoscaler_config_checks()

    quiet = [logging.getLogger(n) for n in ("ray", "ray.autoscaler")]
    levels = [lg.level for lg in quiet]
    for lg in quiet:
        lg.setLevel(logging.ERROR)
    try:
        try:
            # Ray's cli_logger prints advice (e.g. on file mounts) while preparing; keep our
            # report to our own findings.
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                prepared = prepare_config(copy.deepcopy(cfg))
        except (Exception, SystemExit) as exc:  # cli_logger.abort raises SystemExit-like errors
            return [Problem(name, "", f"Ray cannot prepare this config: {exc}",
                            "compare with Ray's example YAMLs for this provider")]
        validator = jsonschema.Draft7Validator(ray_schema())  # cached: read once per process
        errors = sorted(validator.iter_errors(prepared), key=lambda e: list(e.absolute_path))
        if errors:
            return [_schema_problem(name, e) for e in errors]
        try:
            validate_config(prepared)
        except Exception as exc:  # noqa: BLE001 - Ray's cross-field checks raise ValueError/RuntimeError
            return [Problem(name, "", f"Ray rejects it: {exc}", "see the message; it is Ray's own check")]
    finally:
        for lg, level in zip(quiet, levels):
            lg.setLevel(level)
    return []


def _schema_problem(name: str, err: Any) -> Problem:
    key = key_path(err.absolute_path)
    if err.validator == "type" and "resources" in list(err.absolute_path):
        fix = "Ray resources in cluster YAMLs are whole numbers: use an integer (e.g. GPU: 1)"
    elif err.validator == "additionalProperties":
        fix = "remove or rename the unknown key (see ray/autoscaler/ray-schema.json in the installed ray)"
    elif err.validator == "required":
        fix = "add the missing key"
    else:
        fix = f"make it match Ray's schema ({err.validator}: {err.validator_value!r})"
    return Problem(name, key, f"{err.message} (Ray's schema)", fix)


def _images(cfg: dict[str, Any]) -> list[tuple[str, str, bool]]:
    """(key path, image, must have CUDA) for every container image the file names."""
    docker = cfg.get("docker") or {}
    types = cfg.get("available_node_types") or {}
    gpu_types = {n for n, t in types.items() if n != cfg.get("head_node_type") and _gpus(t) > 0}
    out = []
    if "image" in docker:
        out.append(("docker.image", docker["image"], bool(gpu_types) or cfg["provider"].get("type") == "local"))
    if "head_image" in docker:
        out.append(("docker.head_image", docker["head_image"], False))
    if "worker_image" in docker:
        out.append(("docker.worker_image", docker["worker_image"], True))
    for tname, t in types.items():
        img = (t.get("docker") or {}).get("worker_image")
        if img:
            out.append((f"available_node_types.{tname}.docker.worker_image", img, tname in gpu_types))
    return out


def _image_rules(name: str, cfg: dict[str, Any]) -> list[Problem]:
    if not (cfg.get("docker") or {}).get("image"):
        return [Problem(name, "docker.image", "no container image: nodes would run whatever Ray the machine image has",
                        f"set docker.image: rayproject/ray:{ray_version()}-py311-cu128")]
    problems = []
    pys = set()
    for key, image, needs_cuda in _images(cfg):
        problem = image_problem(name, key, image, needs_cuda)
        if problem:
            problems.append(problem)
        m = IMAGE_RE.match(str(image))
        if m:
            pys.add(m["py"])
    if len(pys) > 1:
        problems.append(Problem(name, "docker", f"images use different Pythons ({', '.join(sorted(pys))})",
                                "use one Python tag for every node: Ray needs the same Python everywhere"))
    return problems


def _gpus(node_type: dict[str, Any]) -> int:
    return int((node_type.get("resources") or {}).get("GPU", 0) or 0)


def _node_type_rules(name: str, cfg: dict[str, Any]) -> list[Problem]:
    problems = []
    types = cfg.get("available_node_types") or {}
    head = cfg.get("head_node_type")
    if "max_workers" not in cfg:
        problems.append(Problem(name, "max_workers", "no global max_workers: Ray's default (2) silently caps the cluster",
                                "state max_workers: the most worker nodes you are willing to pay for"))
    head_type = types.get(head, {})
    head_res = head_type.get("resources") or {}
    if head_res.get("GPU") != 0:
        got = f"GPU: {head_res['GPU']}" if "GPU" in head_res else "no GPU key (Ray would auto-detect the instance's GPUs)"
        problems.append(Problem(name, f"available_node_types.{head}.resources.GPU",
                                f"the head must advertise no GPUs, got {got}",
                                f"set available_node_types.{head}.resources.GPU: 0 so no training worker lands on the head"))
    gpu_types = []
    for tname, t in types.items():
        if tname == head:
            continue
        base = f"available_node_types.{tname}"
        if "GPU" not in (t.get("resources") or {}):
            problems.append(Problem(name, f"{base}.resources.GPU", "worker type does not advertise its GPU count",
                                    f"set {base}.resources.GPU to the GPUs per node (0 for a CPU-only type)"))
            continue
        if _gpus(t) == 0:
            continue
        gpu_types.append(tname)
        if t.get("min_workers", 0) != 0:
            problems.append(Problem(name, f"{base}.min_workers",
                                    f"is {t['min_workers']}: that many GPU nodes stay up (and billed) with nothing to train",
                                    f"set {base}.min_workers: 0; the autoscaler adds GPU nodes when a run asks for GPUs"))
        if "max_workers" not in t:
            problems.append(Problem(name, f"{base}.max_workers", "GPU type states no max_workers",
                                    f"set {base}.max_workers to the most nodes of this type you want"))
        elif t["max_workers"] < 1:
            problems.append(Problem(name, f"{base}.max_workers", f"is {t['max_workers']}: this type can never start",
                                    f"set {base}.max_workers >= 1 or remove the type"))
    if not gpu_types:
        problems.append(Problem(name, "available_node_types", "no worker type advertises GPUs",
                                "add a worker type with resources: {GPU: <n>} (min_workers: 0, max_workers: <cap>)"))
    return problems


def _local_rules(name: str, cfg: dict[str, Any]) -> list[Problem]:
    """The `local` provider has no node types: GPUs are declared on the `ray start` lines."""
    problems = []
    n = len(cfg["provider"].get("worker_ips") or [])
    for key in ("min_workers", "max_workers"):
        if cfg.get(key) != n:
            problems.append(Problem(name, key, f"is {cfg.get(key)!r} but provider.worker_ips lists {n} host(s); the local "
                                    "provider learns node resources from the head (no GPUs), so it never starts a GPU "
                                    "host on demand", f"set {key}: {n} (all listed hosts start with `ray up`)"))
    head_starts = _ray_starts(cfg, "head_start_ray_commands")
    if not any(_flag(cmd, "--num-gpus") == "0" for _, cmd in head_starts):
        problems.append(Problem(name, "head_start_ray_commands", "the head's `ray start` does not pass --num-gpus=0",
                                "add --num-gpus=0 so no training worker lands on the head"))
    for key, cmd in _ray_starts(cfg, "worker_start_ray_commands"):
        gpus = _flag(cmd, "--num-gpus")
        if gpus is None or not gpus.isdigit() or int(gpus) < 1:
            problems.append(Problem(name, key, f"worker `ray start` advertises no GPUs (--num-gpus={gpus})",
                                    "add --num-gpus=<GPUs per host> (a whole number >= 1)"))
    return problems


def _ray_starts(cfg: dict[str, Any], key: str) -> list[tuple[str, str]]:
    return [(f"{key}[{i}]", c) for i, c in enumerate(cfg.get(key) or []) if re.search(r"\bray start\b", c)]


def _flag(cmd: str, flag: str) -> Optional[str]:
    try:
        words = shlex.split(cmd.replace(";", " ; "))
    except ValueError:
        words = cmd.split()
    for i, w in enumerate(words):
        if w.startswith(flag + "="):
            return w.split("=", 1)[1]
        if w == flag and i + 1 < len(words):
            return words[i + 1]
    return None


def _port_rules(name: str, cfg: dict[str, Any]) -> list[Problem]:
    problems = []
    perms = ((cfg["provider"].get("security_group") or {}).get("IpPermissions")) or []
    for i, rule in enumerate(perms):
        key = f"provider.security_group.IpPermissions[{i}]"
        lo, hi = rule.get("FromPort", -1), rule.get("ToPort", -1)
        all_ports = str(rule.get("IpProtocol")) == "-1" or lo == -1
        hit = [p for p in GUARDED_PORTS if all_ports or lo <= p <= hi]
        cidrs = [r.get("CidrIp") for r in rule.get("IpRanges") or []] + \
                [r.get("CidrIpv6") for r in rule.get("Ipv6Ranges") or []]
        public = [c for c in cidrs if c and not _private_cidr(c)]
        if hit and public:
            ports = ", ".join(f"{p} ({GUARDED_PORTS[p]})" for p in hit)
            problems.append(Problem(name, key, f"opens {ports} to {', '.join(public)}",
                                    "remove the rule: use `ray dashboard <file>` (SSH port-forward) for the "
                                    "dashboard and jobs API; nodes reach each other inside the security group"))
    for key, cmd in _ray_starts(cfg, "head_start_ray_commands"):
        host = _flag(cmd, "--dashboard-host")
        if host not in ("127.0.0.1", "localhost"):
            problems.append(Problem(name, key, f"dashboard host is {host or 'not set'}: the dashboard and jobs API "
                                    "must listen on loopback only", "pass --dashboard-host=127.0.0.1 and use "
                                    "`ray dashboard <file>` to reach it"))
    docker = cfg.get("docker") or {}
    for opt_key in ("run_options", "head_run_options", "worker_run_options"):
        for i, opt in enumerate(docker.get(opt_key) or []):
            published = _published_ports(str(opt))
            if published:
                problems.append(Problem(name, f"docker.{opt_key}[{i}]",
                                        f"publishes port(s) {', '.join(map(str, published))} of the container",
                                        "remove it: Ray runs the container with host networking; reach the "
                                        "dashboard with `ray dashboard <file>`"))
    return problems


def _private_cidr(cidr: str) -> bool:
    try:
        net = ipaddress.ip_network(cidr, strict=False)
    except ValueError:
        return False
    return net.is_private or net.is_loopback


def _published_ports(opt: str) -> list[int]:
    if re.search(r"(^|\s)(-P|--publish-all)(\s|$)", opt):
        return sorted(GUARDED_PORTS)
    found = []
    for m in re.finditer(r"(?:^|\s)(?:-p|--publish)[\s=]+(\S+)", opt):
        spec = m.group(1).split("/")[0]
        container = spec.rsplit(":", 1)[-1]
        lo, _, hi = container.partition("-")
        if lo.isdigit():
            found += [p for p in GUARDED_PORTS if int(lo) <= p <= int(hi or lo)]
    return sorted(set(found))


def _auth_rules(name: str, cfg: dict[str, Any]) -> list[Problem]:
    problems = []
    for key, cmd in all_commands(cfg):
        if re.search(r"RAY_AUTH_MODE=(?!token\b)", cmd):
            problems.append(Problem(name, key, "turns token authentication off",
                                    "remove it: RAY_AUTH_MODE must be token everywhere"))
        if re.search(r"RAY_AUTH_TOKEN=\S", cmd):
            problems.append(Problem(name, key, "holds a token in the file (it would end up in git and logs)",
                                    "mount the token file instead: file_mounts {'~/.ray/auth_token': '~/.ray/auth_token'}"))
    for list_key in ("head_start_ray_commands", "worker_start_ray_commands"):
        starts = _ray_starts(cfg, list_key)
        if not starts:
            problems.append(Problem(name, list_key, "has no `ray start` command",
                                    "state the start commands so token authentication is explicit"))
        for key, cmd in starts:
            if not re.search(r"\bRAY_AUTH_MODE=token\b", cmd):
                problems.append(Problem(name, key, "`ray start` runs without RAY_AUTH_MODE=token",
                                        "prefix it with `export RAY_AUTH_MODE=token;` (every node, head and workers)"))
    mounts = cfg.get("file_mounts") or {}
    token_paths = {"~/.ray/auth_token"}
    for _, cmd in all_commands(cfg):
        token_paths.update(re.findall(r"RAY_AUTH_TOKEN_PATH=(\S+)", cmd))
    if not any(k.rstrip("/") in token_paths or k.endswith("/.ray/auth_token") for k in mounts):
        problems.append(Problem(name, "file_mounts", "the auth token is not mounted on the nodes",
                                "add file_mounts: {'~/.ray/auth_token': '~/.ray/auth_token'} "
                                "(create it with `ray get-auth-token --generate`)"))
    return problems


def _install_rules(name: str, cfg: dict[str, Any]) -> list[Problem]:
    """Setup must install raytrain-ddp at this version: `raytrain-ddp==X` or this checkout, mounted."""
    version = raytrain_ddp.__version__
    mounts = {k.rstrip("/"): str(v) for k, v in (cfg.get("file_mounts") or {}).items()}
    setup = [(k, c) for k, c in all_commands(cfg) if "setup_commands" in k]
    for key, cmd in setup:
        if "pip install" not in cmd:
            continue
        pinned = re.search(r"raytrain[-_]ddp==([\w.]+)", cmd)
        if pinned:
            if pinned.group(1) != version:
                return [Problem(name, key, f"installs raytrain-ddp {pinned.group(1)}, but this checkout is {version}",
                                f"install raytrain-ddp=={version}")]
            return []
        for word in cmd.split():
            target = word.rstrip("/")
            if f"{target}/pyproject.toml" in mounts and f"{target}/raytrain_ddp" in mounts:
                if Path(mounts[f"{target}/raytrain_ddp"]).name != "raytrain_ddp":
                    return [Problem(name, f"file_mounts.{target}/raytrain_ddp",
                                    f"mounts {mounts[f'{target}/raytrain_ddp']}, not this project's package",
                                    "mount ./raytrain_ddp")]
                return []
    return [Problem(name, "setup_commands", f"nothing installs raytrain-ddp {version} on the nodes, so "
                    "`python -m raytrain_ddp` fails there", "mount this checkout (~/raytrain-ddp/{pyproject.toml,"
                    "README.md,raytrain_ddp}) and add `pip install ~/raytrain-ddp`, or "
                    f"`pip install raytrain-ddp=={version}`")]
