"""Render the KubeRay manifests of a rayhf run: decide them as plain dicts, then write them.

    parse_cluster("2x8xH100")  -> ClusterShape(n_nodes=2, gpus_per_node=8, gpu_type="H100")
    render(config, cluster)    -> [ConfigMap (the run config), RayJob (trains),
                                   RayCluster (interactive, autoscaled from zero workers),
                                   RayService (serves ``checkpoint``; only when one is given)]
    write_manifests(docs, dir) -> one YAML file per document, each written atomically

Every Ray pod runs the same ``image`` (Ray ``RAY_VERSION`` + rayhf, see k8s/README.md). The head
has no GPUs (``num-gpus: "0"``), so the planner's devices are exactly the workers' GPUs, and the
RayJob's entrypoint is ``rayhf run`` with ``cluster.n_devices`` = nodes x GPUs per node. Every pod
mounts a memory-backed ``/dev/shm``: NCCL and the object store need far more than the 64 MiB a
container gets by default.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from rayhf.errors import RayhfError
from rayhf.k8s.yamlio import dump_documents, write_atomic

DEFAULT_IMAGE = "rayhf/rayhf:0.1.0"
RAY_VERSION = "2.60.0"
SERVE_IMPORT_PATH = "rayhf.serve.app:build_app"
CONFIG_DIR = "/etc/rayhf"
STORAGE_DIR = "/mnt/rayhf"
_CLUSTER_RE = re.compile(r"^\s*(\d+)\s*x\s*(\d+)\s*(?:x\s*([A-Za-z0-9][-A-Za-z0-9_.]*))?\s*$")
_HEAD_PORTS = [
    {"name": "gcs-server", "containerPort": 6379},
    {"name": "dashboard", "containerPort": 8265},
    {"name": "client", "containerPort": 10001},
]
_SERVE_PORT = {"name": "serve", "containerPort": 8000}
# GPU node pools are commonly tainted so that only pods asking for GPUs land there.
_GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}


@dataclass(frozen=True)
class ClusterShape:
    """The GPU nodes a run gets: ``n_nodes`` workers with ``gpus_per_node`` GPUs each."""

    n_nodes: int
    gpus_per_node: int
    gpu_type: str | None = None  # e.g. "H100"; names the worker group, selects no nodes

    @property
    def n_devices(self) -> int:
        """GPUs in the whole cluster: what ``cluster.n_devices`` of the run config must be."""
        return self.n_nodes * self.gpus_per_node


def parse_cluster(spec: str) -> ClusterShape:
    """``"2x8xH100"`` or ``"2x8"`` (nodes x GPUs per node [x GPU type]) as a ClusterShape."""
    m = _CLUSTER_RE.match(spec)
    if m is None or int(m[1]) < 1 or int(m[2]) < 1:
        raise RayhfError(
            f"--cluster {spec!r}: write NODESxGPUS or NODESxGPUSxTYPE with at least one of "
            "each, e.g. 2x8xH100"
        )
    return ClusterShape(int(m[1]), int(m[2]), m[3])


class RenderConfig(BaseModel):
    """Everything about the manifests that is neither the run config nor the cluster shape."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    image: str = DEFAULT_IMAGE  # every Ray container: Ray RAY_VERSION with rayhf installed
    ray_version: str = RAY_VERSION
    name: str | None = None  # base name of the objects; None = the run config's ``name``
    namespace: str | None = None  # None = the namespace kubectl applies to
    checkpoint: str | None = None  # actor checkpoint as the serving pods see it; adds RayService
    storage_claim: str | None = None  # PVC mounted at STORAGE_DIR on every pod, holds run_dir
    head_cpu: str = "4"
    head_memory: str = "16Gi"
    cpus_per_gpu: int = Field(8, gt=0)  # worker CPU request/limit = this x GPUs per node
    memory_gib_per_gpu: int = Field(64, gt=0)  # worker memory = this x GPUs per node, in GiB
    serve_gpus: int = Field(0, ge=0)  # per serving worker; the native engine runs on CPUs
    serve_cpu: str = "4"
    serve_memory: str = "16Gi"
    ttl_seconds_after_finished: int = Field(600, ge=0)  # keep the finished cluster for logs
    # RayJob backoffLimit: a failed job runs again on a new cluster; with storage_claim the run
    # directory survives and the retry resumes from its last checkpoint (resume=auto).
    # None: 2 with storage_claim, else 0 (a retry would start the run over)
    job_retries: int | None = Field(None, ge=0)


@dataclass(frozen=True)
class _Run:
    """What the builders share: names, config file, options."""

    name: str
    config_file: str  # file name inside CONFIG_DIR
    shape: ClusterShape
    cfg: RenderConfig


def dns_name(raw: str, max_len: int = 40) -> str:
    """``raw`` as a DNS-1035 label with room for KubeRay's suffixes (ppo_tiny -> ppo-tiny)."""
    name = re.sub(r"[^a-z0-9-]+", "-", raw.lower()).strip("-")
    if not name or not name[0].isalpha():
        name = f"rayhf-{name}".strip("-")
    return name[:max_len].rstrip("-")


def _labels(run: _Run, component: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "rayhf",
        "app.kubernetes.io/instance": run.name,
        "app.kubernetes.io/component": component,
    }


def _metadata(run: _Run, name: str, component: str) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "labels": _labels(run, component)}
    if run.cfg.namespace:
        meta["namespace"] = run.cfg.namespace
    return meta


def _volumes(run: _Run, with_config: bool) -> tuple[list[dict], list[dict]]:
    """(volumes, volumeMounts): /dev/shm always, storage when given, the run config (the driver
    runs on the head, so only the head needs it) when asked."""
    volumes: list[dict[str, Any]] = [{"name": "shm", "emptyDir": {"medium": "Memory"}}]
    mounts: list[dict[str, Any]] = [{"name": "shm", "mountPath": "/dev/shm"}]
    if with_config:
        volumes.append({"name": "run-config", "configMap": {"name": f"{run.name}-config"}})
        mounts.append({"name": "run-config", "mountPath": CONFIG_DIR, "readOnly": True})
    if run.cfg.storage_claim:
        claim = {"claimName": run.cfg.storage_claim}
        volumes.append({"name": "storage", "persistentVolumeClaim": claim})
        mounts.append({"name": "storage", "mountPath": STORAGE_DIR})
    return volumes, mounts


def _pod_template(run: _Run, component: str, container: dict, with_config: bool) -> dict:
    volumes, mounts = _volumes(run, with_config)
    spec: dict[str, Any] = {"containers": [{**container, "volumeMounts": mounts}]}
    spec["volumes"] = volumes
    return {"metadata": {"labels": _labels(run, component)}, "spec": spec}


def _resources(cpu: str, memory: str, gpus: int = 0) -> dict[str, dict[str, str]]:
    amounts = {"cpu": cpu, "memory": memory}
    if gpus:
        amounts["nvidia.com/gpu"] = str(gpus)
    return {"requests": dict(amounts), "limits": dict(amounts)}


def _container(run: _Run, name: str, resources: dict, ports: list[dict]) -> dict[str, Any]:
    container: dict[str, Any] = {"name": name, "image": run.cfg.image, "resources": resources}
    if ports:
        container["ports"] = [dict(p) for p in ports]
    return container


def head_group(run: _Run, component: str, serve: bool = False) -> dict[str, Any]:
    """The head: GCS, dashboard and the job driver; no GPUs, so no training actor lands here."""
    ports = _HEAD_PORTS + ([_SERVE_PORT] if serve else [])
    resources = _resources(run.cfg.head_cpu, run.cfg.head_memory)
    container = _container(run, "ray-head", resources, ports)
    return {
        "rayStartParams": {"num-gpus": "0", "dashboard-host": "0.0.0.0"},
        "template": _pod_template(run, component, container, with_config=not serve),
    }


def gpu_worker_group(run: _Run, component: str, replicas: int, low: int, high: int) -> dict:
    """``shape.gpus_per_node`` GPUs per pod, one pod per node, tolerating GPU node taints."""
    g = run.shape.gpus_per_node
    memory = f"{run.cfg.memory_gib_per_gpu * g}Gi"
    resources = _resources(str(run.cfg.cpus_per_gpu * g), memory, gpus=g)
    container = _container(run, "ray-worker", resources, [])
    template = _pod_template(run, component, container, with_config=False)
    template["spec"]["tolerations"] = [dict(_GPU_TOLERATION)]
    gpu_type = dns_name(run.shape.gpu_type, 20) if run.shape.gpu_type else ""
    return {
        "groupName": f"gpu-{gpu_type}" if gpu_type else "gpu",
        "replicas": replicas,
        "minReplicas": low,
        "maxReplicas": high,
        "rayStartParams": {},
        "template": template,
    }


def entrypoint(run: _Run) -> str:
    """``rayhf run`` on the mounted config, pointed at this Ray cluster and its GPUs."""
    words = ["rayhf", "run", f"{CONFIG_DIR}/{run.config_file}", "cluster.address=auto"]
    words += ["cluster.device=cuda", f"cluster.n_devices={run.shape.n_devices}"]
    if run.cfg.storage_claim:
        words += [f"run_dir={STORAGE_DIR}/runs/{run.name}", "resume=auto"]
    return shlex.join(words)


def job_retries(cfg: RenderConfig) -> int:
    """The RayJob's backoffLimit (``RenderConfig.job_retries``)."""
    if cfg.job_retries is not None:
        return cfg.job_retries
    return 2 if cfg.storage_claim else 0


def config_map(run: _Run, config_text: str) -> dict[str, Any]:
    """The run config, mounted read-only at CONFIG_DIR on the head and the workers."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(run, f"{run.name}-config", "config"),
        "data": {run.config_file: config_text},
    }


def rayjob(run: _Run) -> dict[str, Any]:
    """Training: a RayJob whose cluster exists for the run and goes away after it."""
    n = run.shape.n_nodes
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayJob",
        "metadata": _metadata(run, run.name, "train"),
        "spec": {
            "entrypoint": entrypoint(run),
            "shutdownAfterJobFinishes": True,
            "ttlSecondsAfterFinished": run.cfg.ttl_seconds_after_finished,
            "backoffLimit": job_retries(run.cfg),
            "rayClusterSpec": {
                "rayVersion": run.cfg.ray_version,
                "headGroupSpec": head_group(run, "train"),
                "workerGroupSpecs": [gpu_worker_group(run, "train", n, n, n)],
            },
        },
    }


def raycluster(run: _Run) -> dict[str, Any]:
    """Interactive use: the same cluster, its GPU workers autoscaled between 0 and the shape."""
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayCluster",
        "metadata": _metadata(run, f"{run.name}-dev", "dev"),
        "spec": {
            "rayVersion": run.cfg.ray_version,
            "enableInTreeAutoscaling": True,
            "autoscalerOptions": {"idleTimeoutSeconds": 600},
            "headGroupSpec": head_group(run, "dev"),
            "workerGroupSpecs": [gpu_worker_group(run, "dev", 0, 0, run.shape.n_nodes)],
        },
    }


def serve_config(checkpoint: str) -> dict[str, Any]:
    """Ray Serve's config: one application, rayhf's serving app on ``checkpoint``."""
    app = {"name": "policy", "route_prefix": "/", "import_path": SERVE_IMPORT_PATH}
    return {"applications": [{**app, "args": {"checkpoint": checkpoint}}]}


def rayservice(run: _Run, checkpoint: str) -> dict[str, Any]:
    """Serving: a RayService running ``rayhf.serve.app:build_app`` on ``checkpoint``."""
    gpus = run.cfg.serve_gpus
    resources = _resources(run.cfg.serve_cpu, run.cfg.serve_memory, gpus=gpus)
    container = _container(run, "ray-worker", resources, [_SERVE_PORT])
    template = _pod_template(run, "serve", container, with_config=False)
    if gpus:
        template["spec"]["tolerations"] = [dict(_GPU_TOLERATION)]
    worker = {
        "groupName": "serve",
        "replicas": 1,
        "minReplicas": 1,
        "maxReplicas": 1,
        "rayStartParams": {},
        "template": template,
    }
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayService",
        "metadata": _metadata(run, f"{run.name}-serve", "serve"),
        "spec": {
            "serveConfigV2": yaml.safe_dump(serve_config(checkpoint), sort_keys=False),
            "rayClusterConfig": {
                "rayVersion": run.cfg.ray_version,
                "headGroupSpec": head_group(run, "serve", serve=True),
                "workerGroupSpecs": [worker],
            },
        },
    }


def _read_run_config(config_path: str | Path, shape: ClusterShape) -> tuple[str, str]:
    """(text, name) of the run config, after checking it loads with the cluster overrides."""
    from rayhf.config import load_config

    overrides = [
        "cluster.address=auto",
        "cluster.device=cuda",
        f"cluster.n_devices={shape.n_devices}",
    ]
    cfg = load_config(config_path, overrides)  # a RayhfError names the bad field
    return Path(config_path).read_text(), cfg.name


def render(
    config_path: str | Path, cluster: str | ClusterShape, image: str = DEFAULT_IMAGE, **options: Any
) -> list[dict[str, Any]]:
    """The manifests for running ``config_path`` on ``cluster``; ``options``: RenderConfig."""
    shape = parse_cluster(cluster) if isinstance(cluster, str) else cluster
    try:
        cfg = RenderConfig(image=image, **options)
    except ValidationError as e:
        first = e.errors()[0]
        raise RayhfError(
            f"render option {'.'.join(map(str, first['loc']))}: {first['msg']}"
        ) from None
    text, config_name = _read_run_config(config_path, shape)
    config_file = re.sub(r"[^-._a-zA-Z0-9]", "_", Path(config_path).name)
    run = _Run(dns_name(cfg.name or config_name), config_file, shape, cfg)
    docs = [config_map(run, text), rayjob(run), raycluster(run)]
    if cfg.checkpoint:
        docs.append(rayservice(run, cfg.checkpoint))
    return docs


def manifest_filename(doc: dict[str, Any]) -> str:
    """``rayjob-ppo-tiny.yaml``: kind and name, so the files of several runs can share a dir."""
    return f"{str(doc['kind']).lower()}-{doc['metadata']['name']}.yaml"


def write_manifests(docs: list[dict[str, Any]], out_dir: str | Path) -> list[Path]:
    """Write each document to ``out_dir/<kind>-<name>.yaml`` atomically; the paths written."""
    out = Path(out_dir)
    names = [manifest_filename(doc) for doc in docs]
    if len(set(names)) != len(names):
        raise RayhfError(f"two manifests would share a file name in {out}: {sorted(names)}")
    paths = []
    for name, doc in zip(names, docs, strict=True):
        write_atomic(out / name, dump_documents([doc]))
        paths.append(out / name)
    return paths
