"""The sharding rules and stage partition as pure functions (no processes)."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from rayhf.errors import RayhfError
from rayhf.models.families import FAMILIES
from rayhf.models.hf import ModelInit, hf_config
from rayhf.models.sharding import (
    ParamShard,
    balanced_cuts,
    check_layout,
    join_shards,
    param_shards,
    shard_numel,
    stage_layers,
    take_shard,
)
from rayhf.models.spec import model_spec
from rayhf.parallel.layout import coords_of, layout_rank


def _spec(family="llama", n_layers=4, **kw):
    init = ModelInit(family=family, hidden_size=32, n_layers=n_layers, n_heads=4, **kw)
    return model_spec(hf_config(init, 37, 0, 2, 1), value_head=False)


@pytest.mark.parametrize("tp", [1, 2, 3, 4])
def test_shards_cover_the_parameter_exactly(tp):
    fused = ParamShard("c_attn.weight", (5, 12), 1, 1, (4, 4, 4))
    odd = ParamShard("embed.weight", (37, 8), 0, 0)
    for p in (fused, odd):
        full = torch.arange(p.numel, dtype=torch.float32).reshape(p.shape)
        shards = [take_shard(full, p, tp, r) for r in range(tp)]
        assert torch.equal(join_shards(shards, p), full)
        assert sum(s.numel() for s in shards) == full.numel()
    # A fused q|k|v shard holds the same columns of each block.
    full = torch.arange(60, dtype=torch.float32).reshape(5, 12)
    if tp == 2:
        assert take_shard(full, fused, 2, 1)[0].tolist() == [2, 3, 6, 7, 10, 11]


def test_every_family_lists_every_hugging_face_parameter():
    from rayhf.models.hf import build_model

    for family in FAMILIES:
        for value_head in (False, True)[: 2 if FAMILIES[family].value_head_class else 1]:
            init = ModelInit(family=family, hidden_size=32, n_layers=2, n_heads=4)
            config = hf_config(init, 37, 0, 2, 1)
            model = build_model(config, value_head)
            spec = model_spec(model.config, value_head)
            listed = {p.name: p.shape for p in param_shards(spec)}
            actual = {k: tuple(v.shape) for k, v in model.state_dict().items()}
            assert listed == actual, family


def test_stages_are_contiguous_balanced_and_cover_all_layers():
    spec = _spec(n_layers=6)
    for pp in range(1, 7):
        stages = stage_layers(spec, pp)
        assert [i for s in stages for i in s] == list(range(6))
        assert all(len(s) >= 1 for s in stages)
    # The embedding sits on stage 0 and the head on the last, so with a large vocabulary those
    # stages take fewer layers than the middle ones.
    big_vocab = model_spec(hf_config(ModelInit(hidden_size=32, n_layers=6), 5000, 0, 2, 1), False)
    sizes = [len(s) for s in stage_layers(big_vocab, 3)]
    assert sizes[1] > sizes[0] and sizes[1] > sizes[2]


def _largest_stage(first: int, layers: list[int], last: int, bounds: list[int]) -> int:
    sizes = [sum(layers[a:b]) for a, b in itertools.pairwise(bounds)]
    sizes[0] += first
    sizes[-1] += last
    return max(sizes)


def test_balanced_cuts_reach_the_smallest_largest_stage():
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(1, 9)
        pp = rng.randint(1, n)
        layers = [rng.choice([5, 5, 7]) if rng.random() < 0.5 else rng.randint(1, 40)
                  for _ in range(n)]  # fmt: skip
        first, last = rng.randint(0, 60), rng.randint(0, 60)
        bounds = balanced_cuts(first, layers, last, pp)
        assert bounds[0] == 0 and bounds[-1] == n and len(bounds) == pp + 1
        assert all(a < b for a, b in itertools.pairwise(bounds)), "every stage holds a layer"
        every = [[0, *cuts, n] for cuts in itertools.combinations(range(1, n), pp - 1)]
        optimum = min(_largest_stage(first, layers, last, b) for b in every)
        assert _largest_stage(first, layers, last, bounds) == optimum


def test_shard_sizes_add_up_to_the_model():
    spec = _spec()
    total = sum(p.numel for p in param_shards(spec))
    replicated = sum(p.numel for p in param_shards(spec) if p.tp_dim is None)
    for tp, pp in [(1, 1), (2, 1), (1, 2), (2, 2), (4, 1)]:
        held = sum(shard_numel(spec, tp, pp, t, s) for t in range(tp) for s in range(pp))
        assert held == total + (tp - 1) * replicated


def test_impossible_layouts_say_why():
    spec = _spec()
    assert "larger than the model's 4 attention heads" in (check_layout(spec, 8, 1) or "")
    assert "does not divide" in (check_layout(_spec(n_kv_heads=2), 4, 1) or "")
    assert "more pipeline stages than the model's 4 layers" in (check_layout(spec, 1, 5) or "")
    assert check_layout(spec, 4, 4) is None
    heads = {"linear_num_key_heads": 2, "linear_num_value_heads": 4}
    hybrid = _spec("qwen3_5_text", n_kv_heads=4, config=heads)  # attention takes tp 4
    assert "the model's 2 DeltaNet key heads" in (check_layout(hybrid, 4, 1) or "")
    assert check_layout(hybrid, 2, 1) is None
    # a sequence split: over each tp rank's heads, never across a linear-attention state
    assert check_layout(spec, 2, 1, cp=2) is None
    assert "cp=4 does not divide the 2 attention heads of a tp rank" in (
        check_layout(spec, 2, 1, cp=4) or ""
    )
    assert "qwen3_5_text model's linear-attention layers carry a state" in (
        check_layout(hybrid, 1, 1, cp=2) or ""
    )
    with pytest.raises(RayhfError, match=r"^linear_num_value_heads=3 is not a multiple of"):
        _spec("qwen3_5_text", config={**heads, "linear_num_value_heads": 3})
    with pytest.raises(RayhfError, match="pp=5"):
        stage_layers(spec, 5)


def test_rank_order_puts_tp_innermost():
    seen = set()
    for d in range(2):
        for p in range(2):
            for t in range(2):
                r = layout_rank(d, p, t, pp=2, tp=2)
                c = coords_of(r, pp=2, tp=2)
                assert (c.dp_rank, c.pp_rank, c.tp_rank) == (d, p, t)
                seen.add(r)
    assert seen == set(range(8))
    assert layout_rank(0, 0, 1, pp=2, tp=2) == 1
