"""A Mixture-of-Experts feed-forward layer on one rank: route each token to its experts, run
every expert's tokens as one grouped matrix product, weight and sum.

    h [n, H] --router--> (weights [n, k], experts [n, k])
    (token, choice) pairs sorted by expert --> rows [n*k, H], offsets per expert
    rows x gate|up [E, H, 2I] (grouped) --> act(gate) * up --> x down [E, I, H] (grouped)
    --> times each pair's weight --> summed per token [n, H]

No Python loop runs per expert and nothing is read back to the host, so a decode step with MoE
layers stays capturable. Under tp each rank holds every expert's slice of the intermediate
units (``rayhf.models.sharding``) and the caller sums the outputs over tp, as for a dense MLP.
The routing mirrors Hugging Face's per family (``MoETraits.router``), dtype by dtype, so
log-probs match its models to rounding.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from rayhf.models.families import MoETraits
from rayhf.models.spec import MoESpec

# torch's grouped GEMM wants each operand's strides and start on 16-byte boundaries
ALIGN_BYTES = 16


class Routes(NamedTuple):
    """The experts each token of a forward goes to, per MoE layer of the model in order:
    ``[n, L, k]`` tensors (``L = len(spec.moe_layers)``; a stage of a pipeline reads and
    writes its own layers' columns only)."""

    record: torch.Tensor | None = None  # written: the experts each token went to
    given: torch.Tensor | None = None  # a generator's choice (-1 where it made none)
    replay: bool = False  # send each token to ``given``'s experts, not the router's own


def route_differs(ids: torch.Tensor, given: torch.Tensor) -> torch.Tensor:
    """``[2]``: the tokens whose expert set in ``ids [n, k]`` is not ``given``'s, and the
    tokens ``given`` names experts for (-1: none)."""
    valid = given[:, 0] >= 0
    same = (ids.sort(dim=1).values == given.to(ids.dtype).sort(dim=1).values).all(dim=1)
    return torch.stack([(valid & ~same).sum(), valid.sum()])


def route(
    logits: torch.Tensor,
    spec: MoESpec,
    traits: MoETraits,
    bias: torch.Tensor | None = None,
    replay: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """From the router's ``logits [n, E]``: each token's ``top_k`` experts ``[n, k]`` (int64)
    and their weights ``[n, k]``, in the logits' dtype (fp32 where the family keeps them so;
    ``bias``: the score correction of a ``sigmoid_grouped`` router), and the experts the
    router chose itself. With ``replay [n, k]`` a token whose row holds experts (not -1) goes
    to those, in that order, weighted by the router's scores of them as its own choice would
    be (routing replay: the weights keep their gradient to the router)."""
    if traits.router == "topk_softmax":  # a softmax over the k chosen logits, in their dtype
        own = torch.topk(logits, spec.top_k, dim=-1).indices
        ids = _replayed(own, replay)
        return torch.softmax(logits.gather(1, ids), dim=-1, dtype=logits.dtype), ids, own
    if traits.router == "sigmoid_grouped":
        assert bias is not None
        scores = logits.sigmoid()
        own = _grouped(scores, spec, bias)
    else:
        scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
        own = torch.topk(scores, spec.top_k, dim=-1).indices
    ids = _replayed(own, replay)
    top = scores.gather(1, ids)
    if spec.renormalize:
        # (DeepSeek-V3's guard against an all-zero sum: sigmoid scores are never quite 0)
        eps = 1e-20 if traits.router == "sigmoid_grouped" else 0.0
        top = top / (top.sum(dim=-1, keepdim=True) + eps)
    if traits.router == "sigmoid_grouped":
        return top * spec.scaling, ids, own
    return (top if traits.weights_fp32 else top.to(logits.dtype)), ids, own


def _replayed(own: torch.Tensor, replay: torch.Tensor | None) -> torch.Tensor:
    """The experts tokens go to: ``replay``'s where it names them, else the router's own."""
    return own if replay is None else torch.where(replay < 0, own, replay.to(own.dtype))


def _grouped(scores: torch.Tensor, spec: MoESpec, bias: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V3's choice (GLM-4.5's) from sigmoid ``scores``: a group of experts scored by
    the sum of its two best corrected scores, the best ``topk_group`` groups kept; the top k
    of their experts by corrected score (``route`` weighs them by the plain score,
    renormalized, times the scale)."""
    corrected = scores + bias.float()
    n, groups = len(scores), spec.n_group
    grouped = corrected.view(n, groups, spec.n_experts // groups)
    best = grouped.topk(2, dim=-1).values.sum(dim=-1).topk(spec.topk_group, dim=-1).indices
    keep = torch.zeros(n, groups, dtype=torch.bool, device=scores.device)
    keep = keep.scatter(1, best, True).unsqueeze(-1).expand_as(grouped).reshape(scores.shape)
    kept = corrected.masked_fill(~keep, float("-inf"))
    return kept.topk(spec.top_k, dim=-1, sorted=False).indices


def _grouped_ok(x: torch.Tensor, wt: torch.Tensor) -> bool:
    """torch's grouped GEMM takes these operands: any float dtype on CPUs (bf16 in a compiled
    step), bf16 on CUDA from compute capability 8.0, each 16-byte aligned."""
    if x.device.type == "cuda" and (
        x.dtype != torch.bfloat16 or torch.cuda.get_device_capability(x.device) < (8, 0)
    ):
        return False
    if torch.compiler.is_compiling() and x.dtype != torch.bfloat16:
        return False  # its compiled form takes bf16 only, on every device
    return _aligned(x) and _aligned(wt)


def _aligned(t: torch.Tensor) -> bool:
    size = t.element_size()
    # a compiled step cannot read a pointer; what it multiplies is freshly allocated (aligned)
    start = torch.compiler.is_compiling() or t.data_ptr() % ALIGN_BYTES == 0
    return start and all(
        (s * size) % ALIGN_BYTES == 0
        for s, n in zip(t.stride(), t.shape, strict=True)
        if n > 1 and s != 1
    )


def grouped_linear(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Rows ``x [S, in]`` sorted by expert times their expert's ``w [E, out, in]`` (a linear
    layer per expert): ``[S, out]``. ``offsets [E]`` (int32) ends each expert's rows. torch's
    grouped GEMM where the operands allow it; else one batched product over every row's expert,
    the same numbers by another kernel."""
    wt = w.transpose(1, 2)  # [E, in, out]
    if _grouped_ok(x, wt):
        return F.grouped_mm(x, wt, offs=offsets)
    expert = torch.bucketize(torch.arange(len(x), device=x.device), offsets, right=True)
    return torch.bmm(x.unsqueeze(1), wt[expert]).squeeze(1)


Gated = Callable[[torch.Tensor], torch.Tensor]
"""An expert's activation: its gate|up product's rows ``[S, 2I]`` -> ``[S, I]``."""


def glu(act: Callable[[torch.Tensor], torch.Tensor]) -> Gated:
    """``act(gate) * up``, gate the first half of the columns, up the second."""

    def gated(x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return act(gate) * up

    return gated


def clamped_swiglu(limit: float, alpha: float) -> Gated:
    """gpt-oss's: gate and up interleaved column by column, each clamped (gate from above, up
    both ways) at ``limit``; ``(up + 1) * gate * sigmoid(alpha * gate)``."""

    def gated(x: torch.Tensor) -> torch.Tensor:
        gate, up = x[..., ::2].clamp(max=limit), x[..., 1::2].clamp(-limit, limit)
        return (up + 1) * (gate * torch.sigmoid(gate * alpha))

    return gated


def experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    act: Gated,
    ep_group: dist.ProcessGroup | None = None,
    counts: torch.Tensor | None = None,
    gate_up_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x [n, H]`` through its experts: ``ids``/``weights [n, k]`` from ``route``, this rank's
    ``gate_up [E_local, 2I, H]`` and ``down [E_local, H, I]`` (``[out, in]``; views of weights
    held ``[in, out]`` do too), ``act`` between them (``glu``, ``clamped_swiglu``) after
    ``gate_up_bias [E_local, 2I]`` where given: every expert, or with ``ep_group`` this rank's
    ``1/ep`` of them (the rows of other ranks' experts travel there and back). ``counts``:
    ``expert_counts`` of ``ids`` over every expert, where the caller has them. Each (token,
    choice) output is weighted in the weights' dtype, cast to ``x``'s, and the k summed in
    choice order."""
    n, k = ids.shape
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)
    rows = x[order // k]  # sorted by expert: by the rank that holds it, too
    ep = 1 if ep_group is None else dist.get_world_size(ep_group)
    if counts is None:
        counts = expert_counts(flat, ep * gate_up.shape[0])
    ffn = functools.partial(_ffn, gate_up=gate_up, down=down, act=act, bias=gate_up_bias)
    out = ffn(rows, counts) if ep_group is None else _exchanged(rows, counts, ffn, ep_group)
    out = (out * weights.flatten()[order, None]).to(x.dtype)
    per_choice = torch.empty_like(out).index_copy(0, order, out)
    return per_choice.view(n, k, down.shape[1]).sum(dim=1)


def expert_counts(ids: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Rows per expert (int64), on the device, of a fixed shape."""
    counts = torch.zeros(n_experts, dtype=torch.int64, device=ids.device)
    return counts.scatter_add_(0, ids, torch.ones_like(ids))


def _ffn(
    rows: torch.Tensor,
    counts: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    act: Gated,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rows sorted by expert (``counts`` each) through their expert's gated MLP; under
    autocast the products run in its dtype (grouped GEMM does not cast)."""
    offsets = counts.cumsum(0).to(torch.int32)
    if torch.is_autocast_enabled(rows.device.type):
        low = torch.get_autocast_dtype(rows.device.type)
        rows, gate_up, down = rows.to(low), gate_up.to(low), down.to(low)
    hidden = grouped_linear(rows, gate_up, offsets)
    if bias is not None:  # each row's expert's
        expert = torch.bucketize(torch.arange(len(rows), device=rows.device), offsets, right=True)
        hidden = hidden + bias[expert.clamp(max=len(bias) - 1)]
    return grouped_linear(act(hidden).to(down.dtype), down, offsets)  # (a bias promotes it)


def _exchanged(
    rows: torch.Tensor,
    sent: torch.Tensor,
    ffn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    group: dist.ProcessGroup,
) -> torch.Tensor:
    """``_ffn`` of rows sorted by (global) expert, ``sent`` of them per expert, whose experts
    are spread over ``group`` (rank j of it holds experts ``[j * E_local, (j + 1) *
    E_local)``): each peer's rows go to it and come back computed, in the order they left. The
    row counts are read to the host once a layer (the exchange's sizes)."""
    ep, local = dist.get_world_size(group), len(sent) // dist.get_world_size(group)
    got = torch.empty_like(sent)
    dist.all_to_all_single(got, sent, group=group)  # [source rank, my expert]
    sizes = torch.stack([sent.view(ep, local).sum(1), got.view(ep, local).sum(1)])
    send_sizes, recv_sizes = sizes.tolist()  # one read of both
    arrived = _Exchange.apply(rows, send_sizes, recv_sizes, group)
    # each source's rows come sorted by expert: sort all of them by expert, stably
    expert = torch.arange(local, device=rows.device).repeat(ep)
    order = torch.argsort(torch.repeat_interleave(expert, got), stable=True)
    done = ffn(arrived[order], got.view(ep, local).sum(0))
    done = torch.empty_like(done).index_copy(0, order, done)
    return _Exchange.apply(done, recv_sizes, send_sizes, group)


class _Exchange(torch.autograd.Function):
    """Rows to and from every rank of a group (``all_to_all_single``): ``send[j]`` rows to rank
    j, ``recv[j]`` rows from it; backward sends the gradients back the way they came."""

    @staticmethod
    def forward(ctx, x, send: list[int], recv: list[int], group):  # type: ignore[override]
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return _all_to_all(x, send, recv, group)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return _all_to_all(grad, ctx.recv, ctx.send, ctx.group), None, None, None


def _all_to_all(
    x: torch.Tensor, send: list[int], recv: list[int], group: dist.ProcessGroup
) -> torch.Tensor:
    out = x.new_empty((sum(recv), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
    return out
