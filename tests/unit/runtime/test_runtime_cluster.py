"""The Ray cluster and its devices (``rayhf.runtime.cluster``) against a recording stand-in for
Ray: how Ray is started, what each device bundle holds, and the errors that say why not."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

import rayhf.runtime.cluster as cluster
from rayhf.errors import RayhfError, RunFailed
from rayhf.planner.cluster import ClusterConfig
from rayhf.runtime.cluster import DeviceCluster, connect, reserve_devices


class FakeRay:
    def __init__(self, resources: dict[str, float], initialized: bool = False) -> None:
        self.resources, self.initialized = resources, initialized
        self.inits: list[dict[str, Any]] = []
        self.ready, self.stopped = True, False

    def is_initialized(self) -> bool:
        return self.initialized

    def init(self, **options: Any) -> None:
        self.inits.append(options)

    def cluster_resources(self) -> dict[str, float]:
        return self.resources

    def wait(self, refs: list, timeout: float) -> tuple[list, list]:
        return (refs, []) if self.ready else ([], refs)

    def shutdown(self) -> None:
        self.stopped = True


@pytest.fixture
def fake(monkeypatch) -> tuple[FakeRay, list]:
    ray = FakeRay({"CPU": 8.0, "rayhf_device": 4.0})
    removed: list = []
    monkeypatch.setattr(cluster, "ray", ray)
    monkeypatch.setattr(
        cluster, "placement_group",
        lambda bundles, strategy: SimpleNamespace(bundles=bundles, strategy=strategy,
                                                  ready=lambda: "ready"),
    )  # fmt: skip
    monkeypatch.setattr(cluster, "remove_placement_group", removed.append)
    return ray, removed


def test_connect_starts_an_embedded_cluster_only_when_it_must(fake):
    ray, _ = fake
    assert connect(ClusterConfig(n_devices=3, num_cpus=6)) is True
    assert ray.inits[-1]["address"] == "local" and ray.inits[-1]["num_cpus"] == 6
    assert ray.inits[-1]["resources"] == {"rayhf_device": 3.0}
    assert not ray.inits[-1]["include_dashboard"]
    assert connect(ClusterConfig(device="cuda", dashboard=True)) is True
    assert ray.inits[-1]["resources"] == {} and ray.inits[-1]["include_dashboard"]
    assert connect(ClusterConfig(address="auto")) is False, "someone else's cluster"
    assert ray.inits[-1] == {"address": "auto", "log_to_driver": True}
    ray.initialized = True
    assert connect(ClusterConfig()) is False and len(ray.inits) == 3


def test_one_bundle_per_emulated_device_with_its_cpu_share(fake):
    devices = reserve_devices(ClusterConfig(n_devices=4), started_ray=True)
    assert devices.pg.bundles == [{"rayhf_device": 1.0, "CPU": 2.0}] * 4
    assert devices.pg.strategy == "PACK"
    assert (devices.n_devices, devices.cpus_per_device, devices.gpu) == (4, 2.0, False)


def test_one_gpu_and_at_most_four_cpus_per_gpu_bundle(fake):
    ray, _ = fake
    ray.resources = {"CPU": 64.0, "GPU": 8.0}
    devices = reserve_devices(ClusterConfig(n_devices=8, device="cuda"), started_ray=False)
    assert devices.pg.bundles == [{"GPU": 1.0, "CPU": 4.0}] * 8 and devices.gpu


@pytest.mark.parametrize(
    "config,resources,message",
    [
        (ClusterConfig(n_devices=6), {"CPU": 8.0, "rayhf_device": 4.0},
         "cluster.n_devices=6 but the Ray cluster has 4 'rayhf_device' resources"),
        (ClusterConfig(n_devices=4, device="cuda"), {"CPU": 8.0, "GPU": 2.0},
         "cluster.n_devices=4 but the Ray cluster has 2 GPUs"),
    ],
)  # fmt: skip
def test_too_few_devices_is_a_clear_error(fake, config, resources, message):
    fake[0].resources = resources
    with pytest.raises(RayhfError, match=message):
        reserve_devices(config, started_ray=False)


def test_an_existing_cluster_short_of_emulated_devices_is_told_the_ray_start_flag(fake):
    fake[0].resources = {"CPU": 8.0}
    with pytest.raises(RayhfError) as err:
        reserve_devices(ClusterConfig(n_devices=2, address="auto"), started_ray=False)
    assert """`ray start ... --resources='{"rayhf_device": N}'`""" in str(err.value)
    fake[0].resources = {"CPU": 8.0, "rayhf_device": 1.0}  # a cluster this run started
    with pytest.raises(RayhfError) as err:
        reserve_devices(ClusterConfig(n_devices=2), started_ray=True)
    assert "ray start" not in str(err.value)


def test_devices_ray_cannot_reserve_in_time_are_given_back(fake):
    ray, removed = fake
    ray.ready = False
    with pytest.raises(RayhfError, match=r"could not reserve .* within 5s \(is another run"):
        reserve_devices(ClusterConfig(n_devices=2), started_ray=False, timeout_s=5)
    assert len(removed) == 1


def test_closing_frees_the_devices_and_stops_only_a_cluster_it_started(fake):
    ray, removed = fake
    DeviceCluster("pg", 2, 1.0, False, started_ray=False).close()  # type: ignore[arg-type]
    assert removed == ["pg"] and not ray.stopped
    DeviceCluster("pg2", 2, 1.0, False, started_ray=True).close()  # type: ignore[arg-type]
    assert removed == ["pg", "pg2"] and ray.stopped


def test_a_recovery_waits_for_a_replaced_node_and_fails_in_one_line_without_it(fake, monkeypatch):
    ray, _ = fake
    monkeypatch.setattr(cluster.time, "sleep", lambda s: None)
    polls = iter([{"CPU": 4.0, "rayhf_device": 2.0}] * 3 + [{"CPU": 8.0, "rayhf_device": 4.0}])
    monkeypatch.setattr(ray, "cluster_resources", lambda: next(polls))
    devices = reserve_devices(ClusterConfig(n_devices=4), started_ray=False, wait_s=30)
    assert devices.n_devices == 4 and devices.cpus_per_device == 2.0
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 4.0, "rayhf_device": 2.0})
    with pytest.raises(RunFailed) as failed:
        reserve_devices(ClusterConfig(n_devices=4), started_ray=False, wait_s=0.01)
    assert (
        "has 2 'rayhf_device' resources after waiting 0.01 s (fault_tolerance.resources_timeout_s)"
        in str(failed.value)
    )
    assert not failed.value.recoverable
