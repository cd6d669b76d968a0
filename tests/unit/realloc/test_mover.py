"""The driver side of reallocation (``rayhf.realloc.mover``) over fake actors: who joins which
transfer group at which rank, who sends and receives which slices, and what a move reports.
``ray.get`` is replaced by the identity, so no Ray is started."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest

import rayhf.realloc.mover as mover
from rayhf.config.driver import DriverConfig
from rayhf.models.hf import ModelInit, hf_config
from rayhf.models.spec import model_spec
from rayhf.parallel.layout import Layout
from rayhf.realloc.mover import ObjectStoreCopy, TransferGroupMover


def _spec():
    init = ModelInit(family="llama", n_layers=4, hidden_size=32, n_heads=4, n_kv_heads=2)
    return model_spec(hf_config(init, 37, 0, 2, 1), value_head=False)


class _Method:
    def __init__(self, fn) -> None:
        self.fn = fn

    def remote(self, *args: Any) -> Any:
        return self.fn(*args)


class FakeActor:
    """Runs each ``.remote`` call at once and logs it."""

    def __init__(self, name: str, log: list[tuple]) -> None:
        self.name = name
        self.rendezvous_address = _Method(lambda: f"tcp://{name}:1")
        self.join_transfer_group = _Method(lambda *args: log.append(("join", name, *args)))
        self.realloc_send = _Method(
            lambda group, by_peer, dtype: log.append(("send", name, by_peer, dtype))
        )
        self.realloc_recv = _Method(
            lambda group, by_peer, eta, forward: sum(
                t.nbytes for ts in by_peer.values() for t in ts
            )
        )
        self.get_weights = _Method(lambda: {"from": name})
        self.set_weights = _Method(lambda weights: log.append(("set", name, weights)) or 10)


@dataclass
class FakeGroup:
    key: str
    layout: Layout
    actors: list[Any]
    flat: bool = False
    dtype: str = "fp32"


@pytest.fixture
def log(monkeypatch) -> list[tuple]:
    monkeypatch.setattr(mover, "ray", SimpleNamespace(get=lambda refs: refs))
    return []


def _groups(log: list[tuple]) -> tuple[FakeGroup, FakeGroup]:
    src = FakeGroup("actor.b", Layout((0, 1), 2), [FakeActor(f"s{r}", log) for r in range(2)])
    dst = FakeGroup("actor.a", Layout((2, 3), 1, 2), [FakeActor(f"d{r}", log) for r in range(2)])
    return src, dst


def test_role_groups_sharing_a_device_are_told_so(log):
    """NCCL cannot hold two ranks on one GPU: colocated groups' transfer group stages on host."""
    src = FakeGroup("actor.b", Layout((0, 1), 2), [FakeActor(f"s{r}", log) for r in range(2)])
    dst = FakeGroup("ref.a", Layout((1,), 1), [FakeActor("d0", log)])
    TransferGroupMover().routes(src, dst, _spec())
    assert [e[6] for e in log if e[0] == "join"] == [True, True, True]
    assert [e[7:] for e in log if e[0] == "join"] == [(True, False)] * 3  # shm; not CUDA IPC


def test_moves_through_cuda_ipc_when_the_driver_says(log):
    src, dst = _groups(log)
    TransferGroupMover(ipc=True).routes(src, dst, _spec())
    assert {e[8] for e in log if e[0] == "join"} == {True}
    cfg = DriverConfig(same_host_transport="ipc")
    assert cfg.moves_through_shm and cfg.moves_through_ipc  # shm where a peer is on another GPU
    assert not DriverConfig().moves_through_ipc


def test_one_transfer_group_per_pair_numbers_both_sides(log):
    src, dst = _groups(log)
    m = TransferGroupMover()
    spec = _spec()
    routes = m.routes(src, dst, spec)
    # members are ordered by group key: the destination "actor.a" takes ranks 0-1
    assert routes.group == "actor.a+actor.b"
    joins = [e for e in log if e[0] == "join"]
    assert [(e[1], e[4], e[5]) for e in joins] == [("d0", 0, 4), ("d1", 1, 4), ("s0", 2, 4),
                                                   ("s1", 3, 4)]  # fmt: skip
    assert {e[2] for e in joins} == {routes.group} and {e[3] for e in joins} == {"tcp://d0:1"}
    assert {e[6] for e in joins} == {False}, "disjoint meshes: NCCL may join them on GPUs"
    plan = m.plan(spec, src.layout, dst.layout)
    for r, by_peer in routes.sends.items():
        assert by_peer == {p: [t for t in plan.for_src(r) if t.dst == p] for p in by_peer}

    def peer(t):  # a relay comes from a destination rank (0-1), a slice from a source (2-3)
        return t.src if t.relay else t.src + 2

    for r, by_peer in routes.recvs.items():
        assert by_peer == {p: [t for t in plan.for_dst(r) if peer(t) == p] for p in by_peer}
    moved = [t for by_peer in routes.recvs.values() for ts in by_peer.values() for t in ts]
    assert len(moved) == len(plan.transfers)
    relayed = [t for by_peer in routes.forwards.values() for ts in by_peer.values() for t in ts]
    assert relayed and relayed == [t for t in plan.transfers if t.relay]
    for r, by_peer in routes.forwards.items():
        assert all(t.src == r and t.dst == p for p, ts in by_peer.items() for t in ts)
    back = m.routes(dst, src, spec)  # the other direction reuses the group
    assert back.group == routes.group and len([e for e in log if e[0] == "join"]) == 4
    assert m.plan(spec, src.layout, dst.layout) is plan, "plans are cached per layout pair"
    with pytest.raises(AssertionError, match="ZeRO-3"):
        m.routes(dst, FakeGroup("actor.z", src.layout, src.actors, flat=True), spec)


def test_a_move_reports_the_bytes_that_arrived(log):
    src, dst = _groups(log)
    m = TransferGroupMover()
    stats = m.move(src, dst, _spec())
    assert stats.bytes == m.plan(_spec(), src.layout, dst.layout).total_bytes
    assert stats.seconds >= 0
    assert {e[1] for e in log if e[0] == "send"} == {"s0", "s1"}, "both replicas send"
    assert {e[3] for e in log if e[0] == "send"} == {"fp32"}


def test_a_lora_move_may_carry_the_adapters_alone(log):
    from rayhf.models.lora import LoraConfig, with_lora
    from rayhf.models.sharding import param_shards

    src, dst = _groups(log)
    spec = with_lora(_spec(), LoraConfig(rank=2), "models.actor.lora")
    m = TransferGroupMover()
    sent = {}
    for skip in (False, True):
        log.clear()
        stats = m.move(src, dst, spec, skip_frozen=skip)
        assert stats.bytes == m.plan(spec, src.layout, dst.layout, skip_frozen=skip).total_bytes
        names = {t.name for e in log if e[0] == "send" for ts in e[2].values() for t in ts}
        sent[skip] = (stats.bytes, names)
    adapters = {p.name: p.numel for p in param_shards(spec) if ".lora_" in p.name}
    assert sent[True][1] == set(adapters) < sent[False][1]
    assert 0 < sent[True][0] <= 2 * 4 * sum(adapters.values()) < sent[False][0] / 3


def test_slices_travel_in_the_destination_s_dtype(log):
    """fp32 master weights moving to a bf16 copy: sent as bf16, half the bytes."""
    src, dst = _groups(log)
    low = FakeGroup("actor.l", dst.layout, dst.actors, dtype="bf16")
    m = TransferGroupMover()
    full = m.move(src, dst, _spec()).bytes
    half = m.move(src, low, _spec()).bytes
    assert half * 2 == full
    assert m.routes(src, low, _spec()).dtype == "bf16"
    assert [e[3] for e in log if e[0] == "send"][-2:] == ["bf16", "bf16"]


def test_the_object_store_path_hands_the_head_s_weights_to_every_destination(log):
    src, dst = _groups(log)
    head_layout = FakeGroup("actor.c", Layout((0, 1), 1, 2), src.actors)
    stats = ObjectStoreCopy().move(head_layout, dst, _spec())
    assert [e for e in log if e[0] == "set"] == [("set", "d0", {"from": "s0"}),
                                                 ("set", "d1", {"from": "s0"})]  # fmt: skip
    assert stats.bytes == 20
    with pytest.raises(AssertionError, match="only copies"):
        ObjectStoreCopy().move(src, dst, _spec(), eta=0.5)
    with pytest.raises(AssertionError, match="ZeRO-3"):
        ObjectStoreCopy().move(FakeGroup("z", src.layout, src.actors, flat=True), dst, _spec())
