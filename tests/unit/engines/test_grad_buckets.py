"""Bucketed data-parallel gradient averaging: gradients are views of the buckets, buckets are
reduced while backward runs and strictly in order, and two ranks (one with no backward at all)
end with the average of their gradients."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rayhf.engines.grad_buckets import GradBuckets


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(*(torch.nn.Linear(16, 16) for _ in range(4)))


def _loss(model: torch.nn.Module, seed: int) -> torch.Tensor:
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(seed))
    return model(x).square().mean()


def test_buckets_are_the_gradients_and_fill_during_backward(world_of_one):
    model, ref = _model(), _model()
    params = list(model.parameters())
    # 16x16 fp32 weight = 1 KiB: two layers' weights and biases a bucket
    buckets = GradBuckets(params, world_of_one, bucket_bytes=2 * (16 * 16 + 16) * 4)
    assert len(buckets.buckets) == 2
    assert buckets.buckets[0].params[0] is params[-1]  # the last layer first: backward's order
    flat_bytes = sum(b.flat.numel() for b in buckets.buckets)
    assert flat_bytes == sum(p.numel() for p in params)  # no second copy of the gradients
    for step in range(2):  # the second step: zeroed in place, still the same views
        for p in params:
            p.grad.zero_()
        buckets.arm()
        _loss(model, step).backward()
        assert buckets.in_backward == 2  # both launched before backward returned
        buckets.finish()
        ref.zero_grad()
        _loss(ref, step).backward()
        for p, q in zip(params, ref.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)
        assert buckets.holds(params)


def test_a_bucket_that_fills_early_waits_for_the_ones_before_it(world_of_one, monkeypatch):
    model = _model()
    params = list(model.parameters())
    buckets = GradBuckets(params, world_of_one, bucket_bytes=(16 * 16 + 16) * 4)
    launched: list[int] = []
    real = buckets._launch_next
    monkeypatch.setattr(
        buckets, "_launch_next", lambda: (launched.append(buckets.launched), real())
    )
    buckets.arm()
    second = buckets.buckets[1].params
    for p in second:
        buckets._done(p)
    assert launched == []  # bucket 1 is full, bucket 0 is not: nothing goes out of order
    for p in buckets.buckets[0].params:
        buckets._done(p)
    assert launched == [0, 1]
    buckets.finish()  # launches 2 and 3, which backward never finished (unused parameters)
    assert launched == [0, 1, 2, 3]


def test_unarmed_backward_launches_nothing_and_replaced_params_are_noticed(world_of_one):
    model = _model()
    params = list(model.parameters())
    buckets = GradBuckets(params, world_of_one)
    _loss(model, 0).backward()  # an earlier micro-batch: gradients accumulate, nothing reduces
    assert buckets.launched == 0 and all(b.work is None for b in buckets.buckets)
    params[0].grad = None
    assert not buckets.holds(params)
    buckets.close()
    assert not buckets.hooks


def _two_ranks(rank: int, path: str, out: dict) -> None:
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=2)
    try:
        model = _model()
        params = list(model.parameters())
        buckets = GradBuckets(params, dist.group.WORLD, bucket_bytes=4096)
        buckets.arm()
        if rank == 0:  # rank 1's minibatch is empty: it runs no backward, only finish
            _loss(model, 7).backward()
        buckets.finish()
        out[rank] = [p.grad.clone() for p in params]
    finally:
        dist.destroy_process_group()


def test_two_ranks_average_even_when_one_runs_no_backward(tmp_path):
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_two_ranks, args=(str(tmp_path / "store"), out), nprocs=2)
        grads = dict(out)
    ref = _model()
    _loss(ref, 7).backward()
    for rank in (0, 1):
        for g, p in zip(grads[rank], ref.parameters(), strict=True):
            torch.testing.assert_close(g, p.grad / 2, rtol=0, atol=0)
