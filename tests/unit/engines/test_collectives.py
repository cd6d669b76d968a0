"""Data-parallel reductions: the identity with one replica (no group), and the same results
through torch.distributed on a one-process gloo group."""

from __future__ import annotations

import torch

from rayhf.engines.collectives import DataParallel


def test_no_group_is_one_replica():
    dp = DataParallel(None)
    values = {"loss": 0.5, "kl": 2.0}
    out = dp.all_reduce_mean(values)
    assert out == values and out is not values
    t = torch.tensor([1.0, 2.0])
    assert dp.all_reduce_sum(t) is t
    obj = {"scores": [1, 2]}
    gathered = dp.all_gather_object(obj)
    assert gathered == [obj] and gathered[0] is obj


def test_a_group_of_one_gives_the_same_results(world_of_one):
    dp = DataParallel(world_of_one)
    assert dp.all_reduce_mean({"b": 3.0, "a": 0.25}) == {"a": 0.25, "b": 3.0}
    assert dp.all_reduce_mean({}) == {}
    t = torch.tensor([1.0, 2.0])
    summed = dp.all_reduce_sum(t)
    assert torch.equal(summed, t) and summed is not t  # reduced into a copy
    assert dp.all_gather_object(("ids", 7)) == [("ids", 7)]
