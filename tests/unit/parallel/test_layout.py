"""Layouts and rank coordinates: the arithmetic a layout checks once, its stable name, and the
rank order with tp innermost."""

from __future__ import annotations

import itertools
import pickle

import pytest

from rayhf.parallel.layout import Coords, Layout, coords_of, layout_rank, stage_major


def test_a_layout_splits_its_mesh_exactly():
    lay = Layout((4, 5, 6, 7), dp=2, tp=2)
    assert (lay.pp, lay.n_microbatches, lay.world_size) == (1, 1, 4)
    with pytest.raises(AssertionError, match="bad layout"):
        Layout((0, 1, 2), dp=2)
    with pytest.raises(AssertionError, match="repeated device"):
        Layout((0, 0), dp=2)


def test_cp_is_carved_out_of_dp_and_shares_the_batch_between_its_ranks():
    lay = Layout((0, 1, 2, 3), dp=4, cp=2)
    assert (lay.batch_groups, lay.name) == (2, "d0-3.dp4tp1pp1cp2")
    assert Layout((0, 1, 2, 3), dp=4).batch_groups == 4
    with pytest.raises(AssertionError, match="cp=3 does not divide dp=4"):
        Layout((0, 1, 2, 3), dp=4, cp=3)
    with pytest.raises(AssertionError, match="ep=2 with cp=2"):
        Layout((0, 1, 2, 3), dp=4, ep=2, cp=2)


@pytest.mark.parametrize(
    ("layout", "name"),
    [
        (Layout((0, 1), dp=2), "d0-1.dp2tp1pp1"),
        (Layout((2, 3, 4, 5), dp=1, tp=2, pp=2), "d2-5.dp1tp2pp2"),
        (Layout((0, 2), dp=1, pp=2), "d0_2.dp1tp1pp2"),  # not contiguous: every device
        (Layout((3,), dp=1), "d3.dp1tp1pp1"),
        (Layout((1, 0), dp=2), "d1_0.dp2tp1pp1"),  # the mesh order is part of the name
    ],
)
def test_names_are_short_and_stable(layout, name):
    assert layout.name == name


def test_layouts_are_values():
    a, b = Layout((0, 1), dp=2), Layout((0, 1), dp=2)
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    plans = {a: "first"}  # a (memoized hash) and layouts built apart (not yet) find one key
    assert plans[Layout((0, 1), dp=2)] == "first"
    shipped = pickle.loads(pickle.dumps(a))  # as to another process: the memo travels along
    assert shipped == a and hash(shipped) == hash(b) and plans[shipped] == "first"
    others = [
        Layout((1, 0), dp=2),
        Layout((0, 1), dp=2, n_microbatches=2),
        Layout((0, 1), dp=1, tp=2),
        Layout((0, 1), dp=1, pp=2),
        Layout((0, 2), dp=2),
        Layout((0, 1), dp=2, cp=2),
    ]
    assert all(a != o and o not in plans for o in others)
    assert len({hash(x) for x in [a, *others]}) == 1 + len(others), "each field counts"


def test_rank_order_puts_tp_innermost_then_pp_then_dp():
    dp, pp, tp = 2, 3, 2
    order = [
        (d, p, t) for d in range(dp) for p in range(pp) for t in range(tp)
    ]  # nested loops, tp innermost
    assert [layout_rank(d, p, t, pp, tp) for d, p, t in order] == list(range(dp * pp * tp))
    assert coords_of(7, pp, tp) == Coords(dp_rank=1, pp_rank=0, tp_rank=1)


@pytest.mark.parametrize(("pp", "tp"), [(1, 1), (2, 1), (1, 4), (3, 2)])
def test_coords_of_inverts_layout_rank(pp, tp):
    for rank in range(2 * pp * tp):
        c = coords_of(rank, pp, tp)
        assert 0 <= c.pp_rank < pp and 0 <= c.tp_rank < tp
        assert layout_rank(c.dp_rank, c.pp_rank, c.tp_rank, pp, tp) == rank
    coords = {coords_of(r, pp, tp) for r in range(2 * pp * tp)}
    assert coords == {Coords(*c) for c in itertools.product(range(2), range(pp), range(tp))}


def test_stage_major_keeps_a_stage_s_data_parallel_ranks_on_neighbouring_devices():
    """Megatron's order: rank (d, p, t) on device (p * dp + d) * tp + t, so dp ranks (and an ep
    group of them) are tp devices apart rather than tp * pp; a permutation of the mesh."""
    dp, tp, pp = 4, 2, 2
    mesh = tuple(range(10, 10 + dp * tp * pp))
    order = stage_major(mesh, dp, tp, pp)
    assert sorted(order) == list(mesh) and order != mesh
    for d, p, t in itertools.product(range(dp), range(pp), range(tp)):
        assert order[layout_rank(d, p, t, pp, tp)] == 10 + (p * dp + d) * tp + t
    dp_line = order[:: tp * pp]  # stage 0, tp rank 0: every replica
    assert dp_line == (10, 12, 14, 16)
    assert stage_major(mesh, dp * pp, tp, 1) == mesh  # one stage: nothing to reorder
