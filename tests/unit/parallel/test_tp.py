"""Tensor-parallel collectives on one process: the identity without a group, and the autograd
functions through a real one-process gloo group (values and gradients unchanged, results in
tensors of their own). Several tp ranks are exercised by the parity check
(tests/integration/test_parallel_parity.py)."""

from __future__ import annotations

import pytest
import torch

from rayhf.parallel.tp import copy_to_tp, gather_from_tp, reduce_from_tp


def _leaf() -> torch.Tensor:
    return torch.arange(6.0).view(2, 3).requires_grad_(True)


@pytest.mark.parametrize("fn", [copy_to_tp, reduce_from_tp, lambda x, g: gather_from_tp(x, g, 3)])
def test_without_a_group_each_is_the_identity(fn):
    x = _leaf()
    assert fn(x, None) is x


def test_through_a_group_of_one_values_and_gradients_pass_unchanged(world_of_one):
    weights = torch.tensor([[1.0, -2.0, 3.0], [0.5, 0.0, -1.0]])
    for fn in (copy_to_tp, reduce_from_tp, lambda x, g: gather_from_tp(x, g, 3)):
        x = _leaf()
        y = fn(x, world_of_one)
        assert torch.equal(y, x)
        (y * weights).sum().backward()
        assert torch.equal(x.grad, weights)
    x = _leaf()
    y = reduce_from_tp(x, world_of_one)
    with torch.no_grad():
        y.add_(1.0)  # the all-reduce wrote into a copy
    assert torch.equal(x, _leaf())
