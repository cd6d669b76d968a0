"""Process groups of a layout, without torch.distributed: a lone process's groups, the rank sets
each axis groups together, and what a rank learns of its place; the stores groups meet through."""

from __future__ import annotations

import errno
import socket

import pytest
import torch.distributed as dist

from rayhf.parallel.groups import (
    ParallelGroups,
    _lines,
    build_groups,
    host_store,
    join_store,
    single,
)
from rayhf.parallel.layout import Coords


def test_a_lone_process_has_no_groups():
    g = single()
    assert (g.dp, g.pp, g.tp, g.coords) == (1, 1, 1, Coords(0, 0, 0))
    assert g.dp_group is g.pp_group is g.tp_group is None
    assert g.pp_ranks == (0,)
    assert g.is_first_stage and g.is_last_stage and g.is_head


def test_build_groups_of_one_rank_needs_no_torch_distributed():
    assert not dist.is_initialized()
    assert build_groups(1, 1, 1, rank=0) == single()
    with pytest.raises(AssertionError, match=r"needs torch\.distributed"):
        build_groups(2, 1, 1, rank=0)


def test_a_world_makes_each_group_once_and_another_world_its_own():
    """Layout after layout in one world (the checks build dozens) reuses the groups made for
    the same axis and ranks: each holds gloo's threads and connections while it lives."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        first, again = build_groups(2, 2, 1, rank=0), build_groups(2, 2, 1, rank=0)
        assert first.dp_group is not None and first.tp_group is not None
        assert (again.dp_group, again.tp_group) == (first.dp_group, first.tp_group)
        experts = build_groups(2, 2, 1, rank=0, ep=2)  # ep spans the dp ranks: its own group
        assert experts.dp_group is first.dp_group and experts.ep_group is not first.dp_group
        assert dist.get_process_group_ranks(experts.ep_group) == [0, 2]
    finally:
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        assert build_groups(2, 2, 1, rank=0).dp_group is not first.dp_group
    finally:
        dist.destroy_process_group()


def test_a_hosted_store_listens_before_its_address_is_handed_out():
    store, address = host_store()
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    assert address.startswith("tcp://127.0.0.1:") and int(port) == store.port
    with socket.socket() as s, pytest.raises(OSError) as taken:
        s.bind((host, int(port)))  # no one can take the port between handing it out and use
    assert taken.value.errno == errno.EADDRINUSE
    first, second = join_store(address), join_store(address)
    first.set("rank0", "here")
    assert second.get("rank0") == b"here" and store.get("rank0") == b"here"


def test_lines_group_ranks_that_differ_along_one_axis():
    dp, pp, tp = 2, 2, 2  # ranks (d * pp + p) * tp + t
    assert _lines(dp, pp, tp, "tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]  # neighbours
    assert _lines(dp, pp, tp, "pp") == [[0, 2], [1, 3], [4, 6], [5, 7]]  # stage order
    assert _lines(dp, pp, tp, "dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]


@pytest.mark.parametrize(("dp", "pp", "tp"), [(4, 1, 1), (1, 3, 2), (2, 2, 3)])
@pytest.mark.parametrize("axis", ["dp", "pp", "tp"])
def test_lines_partition_the_ranks(dp, pp, tp, axis):
    lines = _lines(dp, pp, tp, axis)
    size = {"dp": dp, "pp": pp, "tp": tp}[axis]
    assert all(len(line) == size for line in lines)
    assert sorted(r for line in lines for r in line) == list(range(dp * pp * tp))


@pytest.mark.parametrize(
    ("coords", "first", "last", "head"),
    [
        (Coords(1, 0, 0), True, False, True),
        (Coords(0, 0, 1), True, False, False),  # a tp peer of the head
        (Coords(0, 2, 0), False, True, False),
        (Coords(0, 1, 1), False, False, False),
    ],
)
def test_a_rank_s_place(coords, first, last, head):
    g = ParallelGroups(2, 3, 2, coords, None, None, None, (0, 2, 4))
    assert (g.is_first_stage, g.is_last_stage, g.is_head) == (first, last, head)
