"""What the reallocation tests share: a tiny model of either family and its shards per layout."""

from __future__ import annotations

import torch

from rayhf.models.families import FAMILIES
from rayhf.models.hf import ModelInit, hf_config
from rayhf.models.sharding import embedding_name, param_shards, stage_units, take_shard
from rayhf.models.spec import model_spec
from rayhf.parallel.layout import Layout, coords_of


def _spec(family: str, **kw):
    shape = {"n_heads": 4, "n_kv_heads": 2} if family == "llama" else {"n_heads": 4}
    if FAMILIES[family].moe is not None:  # its row's experts
        shape = dict(FAMILIES[family].check_shape)
    init = ModelInit(family=family, **{"n_layers": 4, "hidden_size": 32, **shape, **kw})
    return model_spec(hf_config(init, 37, 0, 2, 1), value_head=False)


def _shards(spec, full, lay: Layout) -> dict[int, dict[str, torch.Tensor]]:
    out = {}
    for r in range(lay.world_size):
        c = coords_of(r, lay.pp, lay.tp)
        units = stage_units(spec, lay.pp, c.pp_rank)
        # a tied head's last stage (apart from the first) holds a copy of the embedding
        copy = spec.tied and 0 < c.pp_rank == lay.pp - 1
        out[r] = {
            p.name: take_shard(full[p.name], p, lay.tp, c.tp_rank, lay.ep, c.dp_rank % lay.ep)
            for p in param_shards(spec)
            if p.unit in units or (copy and p.name == embedding_name(spec))
        }
    return out
