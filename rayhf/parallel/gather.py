"""Gathering a replica's whole model from its tp and pp ranks, as tensors.

    each rank's shards --tp: every shard of a parameter, broadcast by its rank-->  the stage's
    whole parameters --pp: every parameter, broadcast by the stage that holds it--> the model

Tensors travel as tensors (no pickling), on the device the group reduces on (a GPU for NCCL),
and every rank of the replica ends up with the whole model, as ``all_gather`` would. A rank
learns what the other stages hold (names and dtypes) from one small object gather; shapes come
from the shard rules.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist

from rayhf.models.sharding import ParamShard, join_shards, shard_shape
from rayhf.parallel.groups import ParallelGroups


def gather_whole(
    local: dict[str, torch.Tensor], shards: Mapping[str, ParamShard], groups: ParallelGroups
) -> dict[str, torch.Tensor]:
    """The whole parameters of ``local`` (this rank's shards, by Hugging Face name) from every
    rank of the replica (a collective over its tp and pp groups, and with ep > 1 over the ranks
    that hold the other experts; ``shards``: how each of the model's parameters splits)."""
    stage = local
    if groups.ep_group is not None:  # every expert, from the ranks that split them
        stage = {n: _join_ep(t, groups) if shards[n].expert else t for n, t in stage.items()}
    if groups.tp_group is not None:
        stage = {name: _join_tp(t, shards[name], groups) for name, t in stage.items()}
    if groups.pp_group is None:
        return stage
    held: list = [None] * groups.pp
    mine = {name: str(t.dtype).removeprefix("torch.") for name, t in stage.items()}
    dist.all_gather_object(held, mine, group=groups.pp_group)
    whole: dict[str, torch.Tensor] = {}
    device = next(iter(stage.values())).device
    for s, names in enumerate(held):
        for name, dtype in names.items():
            if name in whole:  # a tied embedding's copy on the last stage
                continue
            t = stage[name] if s == groups.coords.pp_rank else None
            if t is None:
                t = torch.empty(shards[name].shape, dtype=getattr(torch, dtype), device=device)
            dist.broadcast(t, src=groups.pp_ranks[s], group=groups.pp_group)
            whole[name] = t
    return whole


def _join_ep(t: torch.Tensor, groups: ParallelGroups) -> torch.Tensor:
    """A routed expert weight with every expert (dim 0) from the ranks of the ep group, each
    holding an even share of them (tp shards still)."""
    parts = [torch.empty_like(t) for _ in range(groups.ep)]
    dist.all_gather(parts, t.contiguous(), group=groups.ep_group)
    return torch.cat(parts)


def _join_tp(t: torch.Tensor, p: ParamShard, groups: ParallelGroups) -> torch.Tensor:
    """A parameter whole from its tp shards (a replicated one is whole already)."""
    if p.tp_dim is None:
        return t
    ranks = dist.get_process_group_ranks(groups.tp_group)
    parts = []
    for r, src in enumerate(ranks):
        if r == groups.coords.tp_rank:
            part = t.contiguous()
        else:
            part = torch.empty(shard_shape(p, groups.tp, r), dtype=t.dtype, device=t.device)
        dist.broadcast(part, src=src, group=groups.tp_group)
        parts.append(part)
    return join_shards(parts, p)
