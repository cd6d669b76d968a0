"""Data-parallel gradient averaging in buckets that overlap backward (what torch's DDP reducer
does, for a model DDP cannot wrap: ``ShardedModel`` runs under a pipeline, with tp collectives and
micro-batches of its own).

Each parameter's gradient is a view into one flat bucket, so the gradients are the buckets and a
reduction copies nothing. Buckets hold parameters in reverse order, the order backward finishes
them. While armed (the last micro-batch of a minibatch, one backward pass), a parameter whose
gradient is complete marks itself done, and every bucket whose parameters are all done is
all-reduced asynchronously while backward carries on with earlier layers. Buckets are launched
strictly in their order on every rank, so the collectives line up across ranks even when one rank
(with an empty minibatch) runs no backward: ``finish`` launches what is left in the same order,
waits, and divides by the replicas.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

# Bytes of gradients a bucket holds: DDP's default. Smaller buckets start sooner and overlap more;
# each all-reduce costs a fixed latency, which 25 MiB amortises on NVLink and gloo alike.
BUCKET_BYTES = 25 * 2**20


@dataclass(eq=False)
class _Bucket:
    flat: torch.Tensor
    params: list[torch.nn.Parameter]
    waiting: int = 0  # parameters whose gradient this backward has not finished yet
    work: dist.Work | None = None  # its all-reduce, once launched


@dataclass(eq=False)
class GradBuckets:
    """The gradients of ``params`` as flat buckets, averaged over ``group`` (dp)."""

    params: list[torch.nn.Parameter]
    group: dist.ProcessGroup | None  # None: nothing to sum (one rank holds them), only divide
    bucket_bytes: int = BUCKET_BYTES
    # what the sums are divided by (None: the group's size); routed experts split over ep
    # ranks sum over the dp / ep ranks holding them and divide by dp
    divisor: int | None = None
    buckets: list[_Bucket] = field(default_factory=list)
    armed: bool = False
    launched: int = 0  # buckets 0..launched-1 are being reduced
    in_backward: int = 0  # buckets launched from backward, last minibatch (for tests, metrics)

    def __post_init__(self) -> None:
        self.of: dict[int, _Bucket] = {}
        size, members = 0, list[torch.nn.Parameter]()
        for p in reversed(self.params):
            nbytes = p.numel() * p.element_size()
            if members and (size + nbytes > self.bucket_bytes or p.dtype != members[0].dtype):
                self._add(members)
                size, members = 0, []
            members.append(p)
            size += nbytes
        if members:
            self._add(members)
        self.hooks = [p.register_post_accumulate_grad_hook(self._done) for p in self.params]

    def _add(self, params: list[torch.nn.Parameter]) -> None:
        first = params[0]
        flat = torch.zeros(sum(p.numel() for p in params), dtype=first.dtype, device=first.device)
        bucket = _Bucket(flat, params)
        offset = 0
        for p in params:
            p.grad = flat[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
            self.of[id(p)] = bucket
        self.buckets.append(bucket)

    def holds(self, params: list[torch.nn.Parameter]) -> bool:
        """Whether ``params`` are this object's and their gradients still its views (a replaced
        parameter or a dropped gradient breaks that: the trainer then builds new buckets)."""
        if [id(p) for p in params] != [id(p) for p in self.params]:
            return False
        return all(p.grad is not None and _within(p.grad, self.of[id(p)].flat) for p in params)

    def close(self) -> None:
        """Stop listening to backward (before the trainer builds new buckets)."""
        for h in self.hooks:
            h.remove()
        self.hooks.clear()

    def arm(self) -> None:
        """The next backward is the minibatch's last: reduce buckets as they fill."""
        self.armed, self.in_backward = True, 0
        for b in self.buckets:
            b.waiting = len(b.params)

    def _done(self, p: torch.Tensor) -> None:
        if not self.armed:
            return
        self.of[id(p)].waiting -= 1
        # launch in order: a later full bucket waits for the earlier ones
        while self.launched < len(self.buckets) and self.buckets[self.launched].waiting == 0:
            self._launch_next()
            self.in_backward += 1

    def _launch_next(self) -> None:
        b = self.buckets[self.launched]
        if self.group is not None:
            b.work = dist.all_reduce(b.flat, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        self.launched += 1

    def finish(self) -> None:
        """Launch the buckets backward did not (all of them on a rank that ran none), wait for
        every reduction and average."""
        self.armed = False
        divisor = self.divisor or dist.get_world_size(self.group)
        while self.launched < len(self.buckets):
            self._launch_next()
        for b in self.buckets:
            if b.work is not None:
                b.work.wait()
            b.flat.div_(divisor)
            b.work = None
        self.launched = 0


def _within(t: torch.Tensor, flat: torch.Tensor) -> bool:
    start = flat.data_ptr()
    return start <= t.data_ptr() < start + flat.numel() * flat.element_size()
