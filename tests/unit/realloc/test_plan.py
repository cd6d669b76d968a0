"""Reallocation planning as pure functions: every layout pair over 1-4 devices, two families."""

from __future__ import annotations

import itertools

import pytest
import torch
from realloc_support import _shards, _spec

from rayhf.checks.reallocation import all_layouts, mesh_relation
from rayhf.errors import RayhfError
from rayhf.models.sharding import check_layout, param_shards, shard_numel
from rayhf.parallel.layout import Layout, coords_of
from rayhf.realloc.plan import check_compatible, plan_realloc


@pytest.mark.parametrize("family", ["llama", "gpt2", "gpt2-tied"])
def test_every_layout_pair_rebuilds_the_destination_shards_exactly(family):
    spec = _spec(family.removesuffix("-tied"), tied=family.endswith("-tied"))
    assert spec.tied == family.endswith("-tied")
    full = {p.name: torch.randn(p.shape) for p in param_shards(spec)}
    layouts = [lay for lay in all_layouts() if check_layout(spec, lay.tp, lay.pp) is None]
    assert len(layouts) >= 30
    sources = {lay: _shards(spec, full, lay) for lay in layouts}
    kinds = set()
    for src, dst in itertools.product(layouts, layouts):
        kinds.add(mesh_relation(src, dst))
        plan = plan_realloc(spec, src, dst)
        want = sources[dst]
        got = {
            r: {k: torch.full_like(v, float("nan")) for k, v in d.items()} for r, d in want.items()
        }
        for t in plan.transfers:
            piece = sources[src][t.src][t.name].narrow(t.dim, t.src_offset, t.stop - t.start)
            got[t.dst][t.name].narrow(t.dim, t.dst_offset, t.stop - t.start).copy_(piece)
        for r in want:
            for k in want[r]:
                assert torch.equal(got[r][k], want[r][k]), (src, dst, r, k)
        # Each destination device receives exactly what it holds afterwards.
        for r in range(dst.world_size):
            c = coords_of(r, dst.pp, dst.tp)
            held = 4 * shard_numel(spec, dst.tp, dst.pp, c.tp_rank, c.pp_rank)
            assert sum(t.nbytes for t in plan.for_dst(r)) == held
    assert kinds == {"equal", "overlapping", "disjoint"}


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_sending_spreads_over_every_source_replica(family):
    spec = _spec(family)
    layouts = [lay for lay in all_layouts() if check_layout(spec, lay.tp, lay.pp) is None]
    checked = 0
    for src, dst in itertools.product(layouts, layouts):
        if src.dp == 1:
            continue
        plan = plan_realloc(spec, src, dst)
        busiest = max(plan.sent.values())
        assert busiest <= 1.5 * plan.total_bytes / src.dp, (src, dst, busiest, plan.total_bytes)
        assert len(plan.sent) == src.world_size, "every source device takes part"
        checked += 1
    assert checked > 100


def test_models_with_different_shapes_are_refused():
    check_compatible(_spec("llama"), _spec("llama"), "x")
    with pytest.raises(RayhfError, match=r"models\.ref\.init_from: the models differ"):
        check_compatible(_spec("llama"), _spec("gpt2"), "models.ref.init_from")
    kv_heads = r"k_proj.weight \(source \(16, 32\), destination \(32, 32\)\)"
    with pytest.raises(RayhfError, match=kv_heads):
        check_compatible(_spec("llama"), _spec("llama", n_kv_heads=4), "x")


def _flat_slices(full: dict[str, torch.Tensor], dp: int) -> dict[int, dict[str, torch.Tensor]]:
    """ZeRO-3's layout: rank r keeps elements [r*ceil(n/dp), (r+1)*ceil(n/dp)) of every flattened
    parameter, the last slice padded."""
    out: dict[int, dict[str, torch.Tensor]] = {r: {} for r in range(dp)}
    for name, t in full.items():
        part = -(-t.numel() // dp)
        padded = torch.cat([t.reshape(-1), torch.full((part * dp - t.numel(),), float("nan"))])
        for r in range(dp):
            out[r][name] = padded[r * part : (r + 1) * part].clone()
    return out


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("hidden", [32, 40])  # 40: slices end mid-row
def test_a_flat_zero3_source_rebuilds_every_destination_exactly(family, hidden):
    from rayhf.realloc.transport import dst_piece, src_piece

    spec = _spec(family, hidden_size=hidden)
    full = {p.name: torch.randn(p.shape) for p in param_shards(spec)}
    layouts = [lay for lay in all_layouts() if check_layout(spec, lay.tp, lay.pp) is None]
    for dp in (1, 2, 3, 4):
        src = Layout(tuple(range(dp)), dp)
        flat = _flat_slices(full, dp)
        for dst in layouts:
            plan = plan_realloc(spec, src, dst, src_flat=True)
            want = _shards(spec, full, dst)
            got = {r: {k: torch.full_like(v, float("nan")) for k, v in d.items()}
                   for r, d in want.items()}  # fmt: skip
            for t in plan.transfers:
                piece = src_piece(flat[t.src], t)
                assert piece.numel() * 4 == t.nbytes
                dst_piece(got[t.dst], t).copy_(piece)
            for r in want:
                for k in want[r]:
                    assert torch.equal(got[r][k], want[r][k]), (dp, dst, r, k)
            for r in range(dst.world_size):
                c = coords_of(r, dst.pp, dst.tp)
                held = 4 * shard_numel(spec, dst.tp, dst.pp, c.tp_rank, c.pp_rank)
                assert sum(t.nbytes for t in plan.for_dst(r)) == held
