"""The Ray cluster and its devices: an embedded local cluster or an existing one by address.

On CPU every device is emulated: a custom resource ``rayhf_device`` plus a share of the CPUs.
One placement group holds one bundle per device; role-group actors on the same device share its
bundle in equal fractions.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group

from rayhf.errors import RayhfError, RunFailed
from rayhf.planner import ClusterConfig

DEVICE_RESOURCE = "rayhf_device"


@dataclass
class DeviceCluster:
    """The placement group over the devices and what each device bundle holds."""

    pg: PlacementGroup
    n_devices: int
    cpus_per_device: float
    gpu: bool
    started_ray: bool

    def close(self) -> None:
        remove_placement_group(self.pg)
        if self.started_ray:
            ray.shutdown()


def connect(cluster: ClusterConfig) -> bool:
    """Make sure Ray is up; returns True if this call started it (and so must stop it)."""
    if ray.is_initialized():
        return False
    if cluster.address is not None:
        ray.init(address=cluster.address, log_to_driver=True)
        return False
    resources = {} if cluster.device == "cuda" else {DEVICE_RESOURCE: float(cluster.n_devices)}
    ray.init(
        address="local",  # a new embedded cluster, never one a `ray start` left running
        num_cpus=cluster.num_cpus or os.cpu_count() or 1,
        resources=resources,
        include_dashboard=cluster.dashboard,
        configure_logging=False,
        log_to_driver=True,
    )
    return True


def reserve_devices(
    cluster: ClusterConfig, started_ray: bool, wait_s: float | None = None, timeout_s: float = 60
) -> DeviceCluster:
    """One placement group with a bundle per device; a clear error if Ray cannot provide it.
    ``wait_s``: how long the cluster may take to have the devices (a recovery waits for a
    replaced node; its failures are ``RunFailed``, not user errors); None: it must have them
    now. ``timeout_s``: the least time Ray has to reserve the bundles."""
    gpu = cluster.device == "cuda"
    have, bundle = _devices(cluster)
    deadline = time.monotonic() + (wait_s or 0)
    while have < cluster.n_devices and time.monotonic() < deadline:
        time.sleep(1.0)
        have, bundle = _devices(cluster)
    if have < cluster.n_devices:
        raise _too_few(cluster, have, started_ray, wait_s)
    timeout_s = max(deadline - time.monotonic(), timeout_s)
    pg = placement_group([dict(bundle) for _ in range(cluster.n_devices)], strategy="PACK")
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(pg)
        message = (
            f"cluster.n_devices={cluster.n_devices}: Ray could not reserve {bundle} per device "
            f"within {timeout_s:g}s (is another run holding them?)"
        )
        if wait_s:
            raise RunFailed(message, recoverable=False)
        raise RayhfError(message)
    return DeviceCluster(pg, cluster.n_devices, bundle["CPU"], gpu, started_ray)


def _too_few(
    cluster: ClusterConfig, have: float, started_ray: bool, wait_s: float | None
) -> Exception:
    """The one-line error for a cluster short of devices: a recovery's ``RunFailed`` (it waited
    ``wait_s``), else a user error naming the ``ray start`` flag where it applies."""
    gpu = cluster.device == "cuda"
    kind = "GPUs" if gpu else f"'{DEVICE_RESOURCE}' resources"
    message = f"cluster.n_devices={cluster.n_devices} but the Ray cluster has {have:g} {kind}"
    if wait_s:
        waited = f" after waiting {wait_s:g} s (fault_tolerance.resources_timeout_s)"
        return RunFailed(message + waited, recoverable=False)
    how = "" if gpu or started_ray else (
        f" (start each node of an existing cluster with `ray start ... --resources="
        f"'{{\"{DEVICE_RESOURCE}\": N}}'`, N its emulated devices)"
    )  # fmt: skip
    return RayhfError(message + how)


def _devices(cluster: ClusterConfig) -> tuple[float, dict[str, float]]:
    """(devices the cluster's live nodes have, the bundle one device takes)."""
    total = ray.cluster_resources()
    if cluster.device == "cuda":
        have = total.get("GPU", 0)
        cpus = max(1.0, (total.get("CPU", 1) // max(have, 1)))
        return have, {"GPU": 1.0, "CPU": min(cpus, 4.0)}
    have = total.get(DEVICE_RESOURCE, 0)
    return have, {DEVICE_RESOURCE: 1.0, "CPU": total.get("CPU", 1) / cluster.n_devices}
