"""Bit-exactness check of reallocation over sampled layout pairs, with real processes.

``python -m rayhf.checks.reallocation OUT.json [--pairs 24] [--seed 0] [--device cpu]`` starts 8
gloo processes:
ranks 0-3 hold a source layout, ranks 4-7 a destination layout (separate processes, as role
groups are). For each family and each sampled (source, destination) pair over meshes of 1-4
devices, the source holds a randomly initialized model (as tp/pp shards, or as ZeRO-3's flat
slices), the planned streams move over a transfer group (relays included), and every rank of
every destination replica reports whether its shards equal the originals' bit for bit, and
whether the whole model it gathers back (``RankModel.full_state``) does; each replica's logits
are compared with the whole model's. The pairs are drawn class by class so
every class is covered: expand, shrink, equal, overlapping and disjoint meshes, tp <-> pp, and a
ZeRO-3 flat source. A family's pairs take turns over three transfer groups (the default 24 pairs,
``COVERING``, meet every class over every transport once: 8 classes and 3 transports are
coprime, so pair ``j``'s class ``j % 8`` and transport ``j % 3`` run through every
combination): one sends every message over
gloo, one through shared memory (``rayhf.realloc.shm``), one through GPU segments between ranks
on one GPU (``rayhf.realloc.cuda_ipc``) and shared memory between the others. On CPU the GPU
segments are files standing in for CUDA IPC (``_standin``), and the ranks are on two "GPUs" by
parity, so moves and relays mix both kinds. ``tests/integration/test_realloc_exec.py`` asserts
on it; with ``--device cuda`` the models live on the one GPU all processes share, the first two
groups stage GPU tensors through host memory and the third opens CUDA IPC handles
(``tests/integration/test_gpu.py``); logits are compared on CPU only (a pipeline's sends
between ranks on one GPU would need NCCL, which refuses them).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import random
import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rayhf.checks.common import Tok, tiny_model
from rayhf.models.sharding import check_layout, param_shards, take_shard
from rayhf.parallel.layout import Layout, stage_major

N_DEVICES, POOL, DST0 = 4, 8, 4  # destination ranks are DST0..POOL-1
# split q, k, v and gate, up (grouped-query heads); fused q|k|v in Conv1D blocks: each is built
# in its row's ``check_shape`` (``rayhf.models.families``)
FAMILIES = ("llama", "gpt2", "qwen3_moe")  # + Qwen3-MoE: experts split by tp and by ep
TRANSPORTS = ("gloo", "shm", "ipc")
CLASSES = ("expand", "shrink", "equal", "overlapping", "disjoint", "tp<->pp", "zero3 flat", "relay")
COVERING = len(CLASSES) * len(TRANSPORTS)  # pairs per family that meet each class on each transport


def classes_for(spec) -> tuple[str, ...]:
    """The classes a family's pairs are drawn from: a Mixture-of-Experts one moves its experts
    between ep shares where a dense one moves from ZeRO-3's flat slices (DeepSpeed runs no MoE
    model), so that there are as many classes."""
    if spec.moe is None:
        return CLASSES
    return tuple("ep change" if c == "zero3 flat" else c for c in CLASSES)


def all_layouts(n_devices: int = N_DEVICES, n_experts: int = 0) -> list[Layout]:
    """Every layout over every subset of the devices (a mesh in increasing device order, and
    in ``stage_major`` order where that differs); for a model with ``n_experts`` experts, every
    ep > 1 that divides dp and them too."""
    out = []
    for size in range(1, n_devices + 1):
        for mesh in itertools.combinations(range(n_devices), size):
            for dp in range(1, size + 1):
                for tp in range(1, size // dp + 1):
                    if size % (dp * tp):
                        continue
                    pp = size // (dp * tp)
                    orders = {mesh, stage_major(mesh, dp, tp, pp)}  # and Megatron's rank order
                    for ep in range(1, dp + 1):
                        if ep == 1 or (dp % ep == 0 and n_experts % ep == 0):
                            out += [Layout(m, dp, tp, pp, ep=ep) for m in sorted(orders)]
    return out


def mesh_relation(a: Layout, b: Layout) -> str:
    shared = set(a.mesh) & set(b.mesh)
    if a.mesh == b.mesh:
        return "equal"
    return "overlapping" if shared else "disjoint"


def pair_classes(spec, src: Layout, dst: Layout, flat: bool) -> set[str]:
    """What kind of move a pair is (a pair is of several kinds; ``relay``: replicas forward)."""
    from rayhf.realloc.plan import plan_realloc

    out = {mesh_relation(src, dst)}
    if plan_realloc(spec, src, dst, src_flat=flat).depth > 1:
        out.add("relay")
    if dst.world_size != src.world_size:
        out.add("expand" if dst.world_size > src.world_size else "shrink")
    if (src.tp > 1 and dst.pp > 1) or (src.pp > 1 and dst.tp > 1):
        out.add("tp<->pp")
    if flat:
        out.add("zero3 flat")
    if src.ep != dst.ep:
        out.add("ep change")
    return out


def sample_pairs(spec, n: int, seed: int) -> list[tuple[Layout, Layout, bool]]:
    """``n`` distinct (source, destination, flat source) pairs drawn class by class in turn."""
    n_experts = spec.moe.n_experts if spec.moe is not None else 0
    valid = [
        lay
        for lay in all_layouts(n_experts=n_experts)
        if check_layout(spec, lay.tp, lay.pp, lay.ep) is None
    ]
    # ZeRO-3 holds flat slices; DeepSpeed runs no MoE model
    flat_sources = [lay for lay in valid if lay.tp == lay.pp == 1 and spec.moe is None]
    candidates = [(a, b, False) for a, b in itertools.product(valid, valid)]
    candidates += [(a, b, True) for a, b in itertools.product(flat_sources, valid)]
    random.Random(seed).shuffle(candidates)
    kinds = {p: pair_classes(spec, *p) for p in candidates[: 40 * n]}
    pairs: list[tuple[Layout, Layout, bool]] = []
    for c in itertools.islice(itertools.cycle(classes_for(spec)), 100 * n):
        if len(pairs) == n:
            break
        pick = next((p for p, k in kinds.items() if c in k and p not in pairs), None)
        if pick is not None:
            pairs.append(pick)
    return pairs


@functools.cache
def _model(family: str):
    """The tiny model of ``family``, built once per process: only read (a source's shards, the
    reference logits)."""
    from rayhf.models.families import family_traits

    return tiny_model(family, dict(family_traits(family).check_shape))


class _FlatSource:
    """A ZeRO-3 rank's slices: elements ``[r * ceil(n/dp), (r+1) * ceil(n/dp))`` of every
    flattened parameter, the last padded."""

    def __init__(self, full: dict[str, torch.Tensor], dp: int, rank: int, device: str) -> None:
        self.shards = {}
        for name, t in full.items():
            part = -(-t.numel() // dp)
            padded = torch.cat([t.reshape(-1), t.new_zeros(part * dp - t.numel())])
            self.shards[name] = padded[rank * part : (rank + 1) * part].to(device, copy=True)

    def source_shards(self) -> dict[str, torch.Tensor]:
        return self.shards


def _one_pair(
    family: str, src: Layout, dst: Layout, flat: bool, rank: int, group, device: str
) -> dict[str, Any] | None:
    from rayhf.engines.rank_model import RankModel
    from rayhf.models.hf import model_files
    from rayhf.models.spec import model_spec
    from rayhf.parallel.groups import build_groups
    from rayhf.realloc.plan import plan_realloc
    from rayhf.realloc.transport import receive_into, send_from

    src_groups = build_groups(src.dp, src.tp, src.pp, rank, base=0, ep=src.ep)
    dst_groups = build_groups(dst.dp, dst.tp, dst.pp, rank, base=DST0, ep=dst.ep)
    whole = _model(family)
    spec = model_spec(whole.config, value_head=False)
    full = {k: v.detach() for k, v in whole.state_dict().items()}
    plan = plan_realloc(spec, src, dst, src_flat=flat)
    ids, mask = _ids()
    mine: dict[str, Any] = {}
    through_shm, through_ipc = group.shm_messages, group.ipc_messages
    if rank < src.world_size:
        source: Any = (
            _FlatSource(full, src.dp, rank, device)
            if flat
            else RankModel.from_hf(whole, Tok(), False, groups=src_groups, device=device)
        )
        send_from(group, source, plan.sent_by(rank, DST0))
    elif DST0 <= rank < DST0 + dst.world_size:
        r = rank - DST0
        empty = model_files(whole.config, False)
        model = RankModel(empty, None, Tok(), groups=dst_groups, device=device)
        receive_into(group, model, plan.received_by(r, 0, DST0), forward=plan.forwarded_by(r, DST0))
        mine["exact"] = _shards_exact(model, spec, full, dst, r)
        gathered = model.full_state()  # the whole model, gathered over the replica as tensors
        mine["whole"] = gathered.keys() == full.keys() and all(
            torch.equal(gathered[k].cpu(), full[k]) for k in full
        )
        mine["logits"] = None
        if device == "cpu":  # a GPU's pipeline sends need NCCL, which 8 ranks on one GPU lack
            with torch.no_grad():
                logits = model.forward(ids, mask)
            mine["logits"] = logits if dst_groups.is_head else None
    mine["shm_messages"] = group.shm_messages - through_shm
    mine["ipc_messages"] = group.ipc_messages - through_ipc
    results: list[Any] = [None] * POOL
    dist.all_gather_object(results, mine)
    if rank != DST0:
        return None
    want = _reference_logits(family)
    ranks = results[DST0 : DST0 + dst.world_size]
    heads = [x["logits"] for x in ranks if x["logits"] is not None]
    return {
        "family": family,
        "device": device,
        "src": [list(src.mesh), src.dp, src.tp, src.pp, src.ep],
        "dst": [list(dst.mesh), dst.dp, dst.tp, dst.pp, dst.ep],
        "flat": flat,
        "classes": sorted(pair_classes(spec, src, dst, flat)),
        "ranks_checked": len(ranks),
        "replicas_checked": len(heads),
        "bit_exact": all(x["exact"] for x in ranks),
        "gathered_exact": all(x["whole"] for x in ranks),
        "logits": max(
            (float((h - want).abs().max() / want.abs().max()) for h in heads), default=None
        ),
        "bytes": plan.total_bytes,
        "relayed": any(t.relay for t in plan.transfers),
        "max_sent": plan.max_sent,
        "max_received": plan.max_received,
        "shm_messages": sum(x["shm_messages"] for x in results),
        "ipc_messages": sum(x["ipc_messages"] for x in results),
    }


def _ids() -> tuple[torch.Tensor, torch.Tensor]:
    """The two rows every pair's destination replicas score, and their mask."""
    ids = torch.randint(3, 37, (2, 9), generator=torch.Generator().manual_seed(1))
    return ids, torch.ones_like(ids)


@functools.cache
def _reference_logits(family: str) -> torch.Tensor:
    """One process's logits of ``_ids`` from ``family``'s model: what every pair's destination
    replicas are held to."""
    from rayhf.engines.rank_model import RankModel

    with torch.no_grad():
        return RankModel.from_hf(_model(family), Tok(), False).forward(*_ids())


def _shards_exact(model, spec, full: dict[str, torch.Tensor], dst: Layout, r: int) -> bool:
    """Whether every shard this destination rank holds equals the original's, bit for bit."""
    from rayhf.parallel.layout import coords_of

    c = coords_of(r, dst.pp, dst.tp)
    shards = {p.name: p for p in param_shards(spec)}
    held = model.receive_buffers()
    ep_rank = c.dp_rank % dst.ep
    return bool(held) and all(
        torch.equal(
            t.cpu(), take_shard(full[name], shards[name], dst.tp, c.tp_rank, dst.ep, ep_rank)
        )
        for name, t in held.items()
    )


def _standin(rank: int):
    """CUDA IPC's stand-in on CPU: a segment is a file in /dev/shm, its handle the file's name
    (removed with the segment, or by ``shm.sweep`` once this process is gone); ranks are on two
    "GPUs", even and odd."""
    import weakref

    from rayhf.realloc import shm
    from rayhf.realloc.cuda_ipc import Sharing

    made = itertools.count()

    def new(n: int) -> torch.Tensor:
        path = shm.SHM_DIR / f"{shm.PREFIX}standin-p{os.getpid()}-{next(made)}"
        t = torch.from_file(str(path), shared=True, size=n, dtype=torch.uint8)
        weakref.finalize(t, path.unlink, missing_ok=True)
        t.path = str(path)  # type: ignore[attr-defined]
        return t

    def open_(blob: bytes) -> torch.Tensor:
        path = blob.decode()
        return torch.from_file(path, shared=True, size=os.path.getsize(path), dtype=torch.uint8)

    return Sharing(
        gpu=f"standin{rank % 2}",
        new=new,
        export=lambda t: t.path.encode(),  # type: ignore[attr-defined]
        open=open_,
        sync=lambda: None,
    )


def _worker(
    rank: int, address: str, store_addresses: tuple[str, str], pairs: list, out: str, device: str
) -> None:
    from rayhf.models.files import quiet_transformers
    from rayhf.parallel.groups import join_store, leave_spawned
    from rayhf.realloc.transport import TransferGroup

    torch.set_num_threads(1)
    quiet_transformers()
    dist.init_process_group("gloo", store=join_store(address), rank=rank, world_size=POOL)
    gloo, shm, ipc = (join_store(a) for a in store_addresses)
    sharing = None if device.startswith("cuda") else _standin(rank)
    groups = {  # pairs take turns: every message over gloo, through shared memory, or GPU ones
        "gloo": TransferGroup(gloo, rank, POOL, device, True, same_host=False),
        "shm": TransferGroup(shm, rank, POOL, device, True, shm_min_bytes=0),
        "ipc": TransferGroup(
            ipc, rank, POOL, device, True, shm_min_bytes=0, ipc=True, sharing=sharing
        ),
    }
    rows = []
    for family, src, dst, flat, transport in pairs:
        row = _one_pair(family, src, dst, flat, rank, groups[transport], device)
        if row is not None:
            rows.append(row | {"transport": transport})
    if rank == DST0:
        with open(out, "w") as f:
            json.dump(rows, f, indent=1)
    dist.barrier()
    for group in groups.values():
        group.close()
    leave_spawned()


def main(argv: list[str] | None = None) -> None:
    from rayhf.models.spec import model_spec
    from rayhf.parallel.groups import host_store

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--pairs", type=int, default=COVERING, help="per family")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", help="cpu, or cuda: every process on GPU 0")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    jobs = []
    for family in FAMILIES:
        spec = model_spec(_model(family).config, value_head=False)
        pairs = sample_pairs(spec, args.pairs, args.seed)
        jobs += [(family, *p, TRANSPORTS[j % len(TRANSPORTS)]) for j, p in enumerate(pairs)]
    # open here while the ranks meet through them
    stores = [host_store() for _ in range(1 + len(TRANSPORTS))]
    address, *transfer = (a for _, a in stores)
    mp.spawn(_worker, args=(address, tuple(transfer), jobs, args.out, args.device), nprocs=POOL)


if __name__ == "__main__":
    main(sys.argv[1:])
