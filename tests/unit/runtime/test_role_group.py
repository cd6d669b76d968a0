"""A role group's actors (``rayhf.runtime.role_group``): the options each actor is started with
and how ranks form replicas, with Ray's actor creation replaced by a recorder (no Ray)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

import rayhf.runtime.role_group as role_group
from rayhf.parallel.layout import Layout
from rayhf.runtime.cluster import DeviceCluster
from rayhf.runtime.role_group import RoleGroup


class _Remote:
    """Stands in for ``ray.remote(RoleWorker)``: records each actor's options and spec."""

    def __init__(self) -> None:
        self.started: list[tuple[dict[str, Any], str]] = []
        self.setups: list[tuple[str, str]] = []

    def options(self, **options: Any) -> SimpleNamespace:
        def remote(spec: str) -> SimpleNamespace:
            self.started.append((options, spec))
            address = f"tcp://{len(self.started)}"
            return SimpleNamespace(
                name=options["name"],
                rendezvous_address=SimpleNamespace(remote=lambda: address),
                setup=SimpleNamespace(
                    remote=lambda init: self.setups.append((options["name"], init))
                ),
            )

        return SimpleNamespace(remote=remote)


@pytest.fixture
def remote(monkeypatch) -> _Remote:
    fake = _Remote()
    monkeypatch.setattr(role_group, "RemoteWorker", fake)
    return fake


def _devices(gpu: bool) -> DeviceCluster:
    return DeviceCluster(pg="the-pg", n_devices=4, cpus_per_device=2.0, gpu=gpu, started_ray=False)  # type: ignore[arg-type]


def test_one_named_actor_per_mesh_device_on_its_bundle(remote: _Remote):
    group = RoleGroup("critic", Layout((3, 1), 1, 2), lambda r: f"spec{r}", _devices(False), 0.5,
                      "rayhf-ppo")  # fmt: skip
    assert group.key == "critic.d3_1.dp1tp2pp1"
    assert [spec for _, spec in remote.started] == ["spec0", "spec1"]
    options = [o for o, _ in remote.started]
    assert [o["name"] for o in options] == [group.actor_name(0), group.actor_name(1)]
    assert group.actor_name(1) == "critic.d3_1.dp1tp2pp1[1]"
    first = options[0]
    assert first["namespace"] == "rayhf-ppo" and first["max_concurrency"] == 1
    assert (first["num_cpus"], first["num_gpus"], first["resources"]) == (
        1.0, 0, {"rayhf_device": 0.5},
    )  # fmt: skip
    bundles = [o["scheduling_strategy"].placement_group_bundle_index for o in options]
    assert bundles == [3, 1], "each rank on its device's bundle"
    assert options[0]["scheduling_strategy"].placement_group == "the-pg"


def test_on_gpus_a_share_of_a_gpu_replaces_the_emulated_device(remote: _Remote):
    RoleGroup("actor", Layout((0,), 1), str, _devices(True), 0.25, "ns")
    ((options, _),) = remote.started
    assert (options["num_cpus"], options["num_gpus"], options["resources"]) == (0.5, 0.25, {})


def test_replicas_are_consecutive_ranks(remote: _Remote):
    group = RoleGroup("actor", Layout((0, 1, 2, 3), 2, 2), str, _devices(False), 1.0, "ns")
    assert group.ranks_per_replica == 2
    assert [a.name for a in group.replica(1)] == [group.actor_name(2), group.actor_name(3)]


def test_setup_shares_rank_0_s_address_and_kill_stops_every_actor(remote, monkeypatch):
    killed: list[str] = []
    fake_ray = SimpleNamespace(
        get=lambda refs: refs, kill=lambda a, no_restart: killed.append(a.name)
    )
    monkeypatch.setattr(role_group, "ray", fake_ray)
    waited: list[str] = []  # what each wait through the one failure path was doing

    def gather(calls, timeout_s):
        waited.extend(c.doing for c in calls)
        return [c.ref for c in calls]

    monkeypatch.setattr(role_group, "gather", gather)
    monkeypatch.setattr(
        role_group,
        "pending",
        lambda ref, handle, role, name, doing: SimpleNamespace(ref=ref, doing=doing),
    )
    group = RoleGroup("ref", Layout((0, 1), 2), str, _devices(False), 1.0, "ns")
    group.setup()
    assert waited == ["start-up"] * 3, "rank 0's address, then every rank's setup"
    assert remote.setups == [(group.actor_name(0), "tcp://1"), (group.actor_name(1), "tcp://1")]
    group.kill()
    assert killed == [group.actor_name(0), group.actor_name(1)]


def test_a_lone_actor_sets_up_without_a_rendezvous(remote, monkeypatch):
    asked: list[str] = []
    monkeypatch.setattr(role_group, "gather", lambda calls, timeout_s: [c.ref for c in calls])
    monkeypatch.setattr(
        role_group,
        "pending",
        lambda ref, handle, role, name, doing: asked.append(doing) or SimpleNamespace(ref=ref),
    )
    group = RoleGroup("reward", Layout((0,), 1), str, _devices(False), 1.0, "ns")
    group.setup()
    assert asked == ["start-up"], "setup only: no store opened that no group would join"
    assert remote.setups == [(group.actor_name(0), "")]
