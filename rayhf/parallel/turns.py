"""The ranks of an ep group in step: every forward and backward pass of a Mixture-of-Experts
model with its experts split over ep ranks exchanges tokens with the others at each MoE layer,
so each rank must run as many passes, in the same order, as the rest of its group. Data-parallel
ranks do not: one rank's batch may cut into more micro-batches than another's, and an empty
minibatch runs none.

Before each of its own passes a rank says which kind it runs (``take``: a small all-reduce over
the group, MAX); a rank with no pass left says 0 and serves the others (``drain``): for each
forward they announce it runs a forward of no tokens, for each backward a backward through those,
until every rank says 0. A pass of no tokens still takes part in every layer's exchange (it
sends nothing and computes the rows it is sent), so the exchanges line up.

    rank 0:  F  B  F  B  F  B  0
    rank 1:  F  B  0 (F) (B) (F) (B) 0        (...): what ``drain`` runs on rank 1's behalf
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from rayhf.errors import RayhfError

DONE, FORWARD, BACKWARD = 0, 1, 2


class Turns:
    """One rank's turns in its ep group (``group`` None: a rank alone; every call a no-op)."""

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        device: torch.device,
        idle_forward: Callable[[], torch.Tensor],
        idle_backward: Callable[[list[torch.Tensor]], None],
    ) -> None:
        self.group, self.device = group, device
        self.idle_forward, self.idle_backward = idle_forward, idle_backward

    def _say(self, kind: int) -> int:
        assert self.group is not None
        t = torch.tensor([kind], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return int(t.item())

    def take(self, kind: int) -> None:
        """This rank runs a pass of ``kind`` (``FORWARD`` or ``BACKWARD``) next."""
        if self.group is None:
            return
        said = self._say(kind)
        if said != kind:  # a backward where another rank runs a forward: the orders differ
            raise RayhfError(
                "the ranks of an ep group ran their model in different orders of forwards and "
                "backwards; set the call's ep to 1 in plan"
            )

    def drain(self) -> None:
        """This rank has no pass left: run empty ones beside the others' until none has."""
        if self.group is None:
            return
        held: list[torch.Tensor] = []
        while (kind := self._say(DONE)) != DONE:
            if kind == FORWARD:
                held.append(self.idle_forward())
            else:
                self.idle_backward(held)
                held = []
