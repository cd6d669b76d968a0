"""Bit-exactness check of reallocation over random layout pairs, with real processes.

``python -m rayhf.checks.reallocation OUT.json [--pairs 24] [--seed 0]`` starts 8 gloo processes:
ranks 0-3 hold a source layout, ranks 4-7 a destination layout (separate processes, as role
groups are). For each family and each sampled (source, destination) pair of layouts over meshes
of 1-4 devices (equal, overlapping and disjoint meshes, every valid dp x tp x pp), the source
holds a randomly initialized model, the planned slices move over a transfer group, and rank 4
reports whether the gathered destination weights equal the originals bit for bit and how far
the destination's logits are from the source's.
``tests/integration/test_realloc_exec.py`` asserts on it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rayhf.checks.common import Tok, free_address, tiny_model
from rayhf.models.sharding import check_layout
from rayhf.parallel.layout import Layout

N_DEVICES, POOL = 4, 8
FAMILIES = {"llama": {"n_heads": 4, "n_kv_heads": 2}, "gpt2": {"n_heads": 4}}


def all_layouts(n_devices: int = N_DEVICES) -> list[Layout]:
    """Every layout over every subset of the devices (a mesh in increasing device order)."""
    out = []
    for size in range(1, n_devices + 1):
        for mesh in itertools.combinations(range(n_devices), size):
            for dp in range(1, size + 1):
                for tp in range(1, size // dp + 1):
                    if size % (dp * tp) == 0:
                        out.append(Layout(mesh, dp, tp, size // (dp * tp)))
    return out


def mesh_relation(a: Layout, b: Layout) -> str:
    shared = set(a.mesh) & set(b.mesh)
    if a.mesh == b.mesh:
        return "equal"
    return "overlapping" if shared else "disjoint"


def sample_pairs(spec, n: int, seed: int) -> list[tuple[Layout, Layout]]:
    """``n`` pairs, a third each with equal, overlapping and disjoint meshes."""
    valid = [lay for lay in all_layouts() if check_layout(spec, lay.tp, lay.pp) is None]
    rng = random.Random(seed)
    by_kind: dict[str, list[tuple[Layout, Layout]]] = {}
    for a, b in itertools.product(valid, valid):
        by_kind.setdefault(mesh_relation(a, b), []).append((a, b))
    pairs = []
    for i, kind in enumerate(("equal", "overlapping", "disjoint")):
        count = n // 3 + (1 if i < n % 3 else 0)
        pairs += rng.sample(by_kind[kind], min(count, len(by_kind[kind])))
    return pairs


def _model(family: str):
    return tiny_model(family, FAMILIES[family])


def _one_pair(family: str, src: Layout, dst: Layout, rank: int, group) -> dict[str, Any] | None:
    from rayhf.engines.rank_model import RankModel
    from rayhf.models.spec import model_spec
    from rayhf.parallel.groups import build_groups
    from rayhf.realloc.plan import plan_realloc
    from rayhf.realloc.transport import receive_into, send_from

    src_groups = build_groups(src.dp, src.tp, src.pp, rank, base=0)
    dst_groups = build_groups(dst.dp, dst.tp, dst.pp, rank, base=4)
    full = _model(family)
    spec = model_spec(full.config, value_head=False)
    plan = plan_realloc(spec, src, dst)
    ids = torch.randint(3, 37, (2, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    logits = gathered = None
    if rank < src.world_size:
        model = RankModel.from_hf(full, Tok(), False, groups=src_groups)
        by_peer: dict[int, list] = {}
        for t in plan.for_src(rank):
            by_peer.setdefault(4 + t.dst, []).append(t)
        send_from(group, model, by_peer)
        with torch.no_grad():
            logits = model.forward(ids, mask)
    elif 4 <= rank < 4 + dst.world_size:
        model = RankModel(full.config, None, Tok(), False, groups=dst_groups)
        by_peer = {}
        for t in plan.for_dst(rank - 4):
            by_peer.setdefault(t.src, []).append(t)
        receive_into(group, model, by_peer)
        gathered = model.full_state() if dst_groups.coords.dp_rank == 0 else None
        with torch.no_grad():
            logits = model.forward(ids, mask)
    results: list[Any] = [None] * POOL
    dist.all_gather_object(results, (logits, gathered if rank == 4 else None))
    if rank != 4:
        return None
    want = full.state_dict()
    got = results[4][1]
    exact = got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    src_logits, dst_logits = results[0][0], results[4][0]
    err = float((dst_logits - src_logits).abs().max() / src_logits.abs().max())
    return {
        "family": family,
        "src": [list(src.mesh), src.dp, src.tp, src.pp],
        "dst": [list(dst.mesh), dst.dp, dst.tp, dst.pp],
        "meshes": mesh_relation(src, dst),
        "bit_exact": exact,
        "logits": err,
        "bytes": plan.total_bytes,
        "max_sent": max(plan.sent.values()),
    }


def _worker(rank: int, address: str, store_address: str, pairs: list, out: str) -> None:
    from rayhf.models.hf import quiet_transformers
    from rayhf.realloc.transport import TransferGroup

    torch.set_num_threads(1)
    quiet_transformers()
    dist.init_process_group("gloo", init_method=address, rank=rank, world_size=POOL)
    group = TransferGroup(store_address, rank, POOL)
    rows = []
    for family, src, dst in pairs:
        row = _one_pair(family, src, dst, rank, group)
        if row is not None:
            rows.append(row)
    if rank == 4:
        with open(out, "w") as f:
            json.dump(rows, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    from rayhf.models.spec import model_spec

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--pairs", type=int, default=24, help="per family")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    jobs = []
    for family in FAMILIES:
        spec = model_spec(_model(family).config, value_head=False)
        jobs += [(family, a, b) for a, b in sample_pairs(spec, args.pairs, args.seed)]
    mp.spawn(_worker, args=(free_address(), free_address(), jobs, args.out), nprocs=POOL)


if __name__ == "__main__":
    main(sys.argv[1:])
