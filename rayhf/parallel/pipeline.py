"""Pipeline-parallel execution of a ``ShardedModel`` stage: forward, backward, one decode step.

Forward (GPipe over micro-batches): the rows of a batch are cut into ``n_microbatches``
micro-batches of consecutive rows, near equal in tokens (``split_tokens``); stage 0 embeds each
and sends its hidden states on (asynchronously, so it starts the next micro-batch while stage 1
works), middle stages receive, compute and send, the last stage computes logits or values. The
last stage then broadcasts the whole output to its pipeline, so every rank returns the same
tensor and the algorithm code above runs unchanged on every rank.

Backward: when training with pp > 1, the broadcast output is a fresh leaf on every rank; the loss
(computed identically everywhere) fills its gradient, and ``backward_pending`` walks the
micro-batches in reverse: the last stage back-propagates its slice of that gradient, sends the
gradient of its input to the stage before, which back-propagates it, and so on to stage 0.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from rayhf.parallel.attention import KVCache, TokenLayout
from rayhf.parallel.context import gather_tokens, local_slice, padding
from rayhf.parallel.groups import ParallelGroups
from rayhf.parallel.model import ShardedModel
from rayhf.parallel.moe import Routes


@dataclass
class _Pending:
    """One training forward whose backward still has to cross the stages."""

    inputs: list[torch.Tensor]  # per micro-batch: what the stage received (leaf) or ids
    outputs: list[torch.Tensor]  # per micro-batch: what the stage produced
    bounds: list[tuple[int, int]]  # per micro-batch: its token range in the broadcast output
    output: torch.Tensor  # the broadcast output leaf the loss was computed from


def split_rows(n_rows: int, n_microbatches: int, exact: bool = False) -> list[range]:
    """Contiguous row ranges of (at most) ``n_microbatches`` non-empty micro-batches; with
    ``exact``, ``n_microbatches`` of them, empty ones too (an ep group's ranks run as many)."""
    n = n_microbatches if exact else max(1, min(n_microbatches, n_rows))
    base, extra = divmod(n_rows, n)
    out, start = [], 0
    for i in range(n):
        size = base + (1 if i < extra else 0)
        out.append(range(start, start + size))
        start += size
    return out


def split_tokens(lengths: list[int], n_microbatches: int, exact: bool = False) -> list[range]:
    """Contiguous row ranges of (at most) ``n_microbatches`` non-empty micro-batches of rows of
    ``lengths`` tokens, near equal in tokens: micro-batch ``i`` ends at the row boundary whose
    running total of tokens is closest to ``i / n`` of them; with ``exact``,
    ``n_microbatches`` of them, empty ones too (as ``split_rows``)."""
    n_rows = len(lengths)
    n = n_microbatches if exact else max(1, min(n_microbatches, n_rows))
    before = [0, *itertools.accumulate(lengths)]  # tokens before each row boundary
    cuts = [0]
    for i in range(1, n):
        target = before[-1] * i / n
        lo = cuts[-1] + (0 if exact else 1)  # after the last cut, leaving a row for each to come
        hi = n_rows if exact else n_rows - (n - i)
        cuts.append(min(range(lo, hi + 1), key=lambda c: (abs(before[c] - target), c)))
    cuts.append(n_rows)
    return [range(a, b) for a, b in itertools.pairwise(cuts)]


class Pipeline:
    def __init__(
        self, model: ShardedModel, groups: ParallelGroups, n_microbatches: int = 1
    ) -> None:
        self.model, self.groups, self.n_microbatches = model, groups, n_microbatches
        self.pending: list[_Pending] = []
        self.record = False  # set by the engine while training: keep graphs for backward
        rank = groups.coords.pp_rank
        self.prev = groups.pp_ranks[rank - 1] if rank > 0 else None
        self.next = groups.pp_ranks[rank + 1] if rank + 1 < groups.pp else None
        self.last = groups.pp_ranks[-1]

    def out_shape(self, n_tokens: int, scored: bool = False) -> tuple[int, ...]:
        spec = self.model.spec
        if scored:
            return (n_tokens, 2)
        return (n_tokens,) if spec.value_head else (n_tokens, spec.vocab_size)

    def forward(
        self,
        ids: torch.Tensor,
        lengths: list[int],
        targets: torch.Tensor | None = None,
        temperature: float = 1.0,
        given_routes: torch.Tensor | None = None,
        replay: bool = False,
    ) -> torch.Tensor:
        """Packed ids of rows of ``lengths`` tokens -> packed logits ``[n, V]``/values ``[n]``,
        or with ``targets`` (packed ``[n]``, -1 where none) ``ShardedModel.score``'s ``[n, 2]``
        log-probs and entropies. ``given_routes`` (packed ``[n, L, k]``): a generator's expert
        choices, compared with the router's (``replay``: and followed)."""

        def routes(lo: int, hi: int) -> Routes | None:
            if given_routes is None:
                return None
            return Routes(given=given_routes[lo:hi], replay=replay)

        if self.groups.pp == 1:
            return self._run(ids, lengths, targets, temperature, routes(0, len(ids)))[0]
        offsets = [0]
        for n in lengths:
            offsets.append(offsets[-1] + n)
        inputs, outputs, bounds, sends = [], [], [], []
        keep = self.record and torch.is_grad_enabled()
        exact = self.groups.ep > 1  # every rank of the ep group: as many micro-batches
        for tag, rows in enumerate(split_tokens(lengths, self.n_microbatches, exact)):
            lo, hi = offsets[rows.start], offsets[rows.stop]
            part = None if targets is None else targets[lo:hi]
            y, x = self._run(
                ids[lo:hi], lengths[rows.start : rows.stop], part, temperature, routes(lo, hi),
                tag, keep,
            )  # fmt: skip
            if self.next is not None:
                sends.append(self._isend(y.detach(), self.next, tag))
            inputs.append(x)
            outputs.append(y)
            bounds.append((lo, hi))
        for s in sends:
            s.wait()
        out = (
            torch.cat(outputs)
            if self.next is None
            else torch.empty(self.out_shape(len(ids), targets is not None), device=ids.device)
        )
        out = self.broadcast(out.detach() if keep else out)
        if keep:
            out.requires_grad_(True)
            self.pending.append(_Pending(inputs, outputs, bounds, out))
        return out

    def _run(
        self,
        ids: torch.Tensor,
        lengths: list[int],
        targets: torch.Tensor | None,
        temperature: float,
        routes: Routes | None,
        tag: int | None = None,
        keep: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One micro-batch through this stage (``tag``: its number in a pipeline, whose first
        stage reads ``ids`` and the others receive hidden states; None: the only stage).
        With context parallelism this rank runs its slice of the tokens (``rayhf.parallel.
        context``) and the last stage gathers the group's outputs. Returns the output and the
        stage's input."""
        cp, group = self.groups.cp, self.groups.cp_group
        where = TokenLayout.packed(lengths)
        if group is not None and len(ids):
            pad = padding(len(ids), cp)
            local = local_slice(len(ids) + pad, cp, self.groups.cp_rank)
            where = TokenLayout.packed([*lengths, pad] if pad else lengths, local=local)
            ids = F.pad(ids, (0, pad))[local]
            if targets is not None:
                targets = F.pad(targets, (0, pad), value=-1)[local]
            if routes is not None and routes.given is not None:
                given = F.pad(routes.given, (0, 0, 0, 0, 0, pad), value=-1)[local]
                routes = routes._replace(given=given)
        if tag is None or self.prev is None:
            x = ids
        else:
            x = self._recv((len(ids), self._hidden), self.prev, tag, self._hidden_dtype)
            if keep:
                x.requires_grad_(True)
        y = self.model(x, where, targets=targets, temperature=temperature, routes=routes)
        if group is not None and where.local is not None and self.next is None:
            y = gather_tokens(y, cp, self.groups.cp_rank, group)[: sum(lengths)]
        return y, x

    def backward_pending(self) -> None:
        """Carry the loss gradient of every recorded forward back through the stages."""
        for pend in reversed(self.pending):
            if pend.output.grad is None:  # the loss did not use this forward (same on every rank)
                continue
            sends = []
            for tag in reversed(range(len(pend.outputs))):
                y = pend.outputs[tag]
                if self.next is None:
                    lo, hi = pend.bounds[tag]
                    grad = pend.output.grad[lo:hi]
                else:
                    grad = self._recv(tuple(y.shape), self.next, tag, y.dtype)
                torch.autograd.backward(y, grad)
                if self.prev is not None:
                    x = pend.inputs[tag]
                    assert x.grad is not None
                    sends.append(self._isend(x.grad, self.prev, tag))
            for s in sends:
                s.wait()
        self.pending.clear()

    def step(
        self,
        x: torch.Tensor,
        where: TokenLayout,
        cache: KVCache,
        select: torch.Tensor,
        routes: Routes | None = None,
    ) -> torch.Tensor | None:
        """One cached forward (prefill or decode); the last stage returns logits at ``select``
        (``routes``: its tokens' expert choices to record)."""
        if self.prev is not None:
            x = self._recv((len(where.rows), self._hidden), self.prev, 0, self._hidden_dtype)
        y = self.model(x, where, cache, select=select, routes=routes)
        if self.next is not None:
            self._isend(y, self.next, 0).wait()
            return None
        return y

    def recv_hidden(self, n_tokens: int) -> torch.Tensor:
        """A decode step's hidden states from the stage before."""
        assert self.prev is not None
        return self._recv((n_tokens, self._hidden), self.prev, 0, self._hidden_dtype)

    def send_hidden(self, hidden: torch.Tensor) -> None:
        """A decode step's hidden states to the stage after."""
        assert self.next is not None
        self._isend(hidden, self.next, 0).wait()

    def sum_stages(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` summed over the pipeline's stages (each filled its own part, 0 elsewhere)."""
        if self.groups.pp > 1:
            dist.all_reduce(t, group=self.groups.pp_group)
        return t

    def broadcast(self, t: torch.Tensor) -> torch.Tensor:
        """The last stage's ``t`` on every stage (elsewhere ``t`` is a buffer of its shape)."""
        if self.groups.pp > 1:
            t = t.contiguous()
            dist.broadcast(t, src=self.last, group=self.groups.pp_group)
        return t

    @property
    def _hidden(self) -> int:
        return self.model.spec.hidden_size

    @property
    def _hidden_dtype(self) -> torch.dtype:
        """What stages pass each other: hidden states in the weights' dtype (with fp32 master
        weights under autocast the residual stream stays fp32)."""
        return self.model.numerics.storage

    def _recv(self, shape: tuple[int, ...], src: int, tag: int, dtype: torch.dtype) -> torch.Tensor:
        buf = torch.empty(shape, device=self.model.device, dtype=dtype)
        dist.recv(buf, src=src, group=self.groups.pp_group, tag=tag)
        return buf

    def _isend(self, t: torch.Tensor, dst: int, tag: int) -> dist.Work:
        work = dist.isend(t.contiguous(), dst=dst, group=self.groups.pp_group, tag=tag)
        assert work is not None
        return work
