"""Weight moves between processes that share one GPU: through a segment on the GPU opened by
CUDA IPC handle, through a shared-memory segment, and through pinned host buffers over gloo's
sockets.

Role groups colocated on a GPU cannot join an NCCL group (NCCL refuses two ranks on one
device), so their transfer group stages GPU tensors through host memory. Two ways are built:
with ``same_host`` (the default) a bucket of 1 MiB or more is copied from the GPU shards into the
sender's ``/dev/shm`` segment and from there into the receiver's GPU shards; without it, the
sender copies each message to the host and gloo carries it over a socket into a pinned buffer,
which is copied to the GPU; with ``ipc`` the sender's segment is a buffer on the GPU that its
peers open by CUDA IPC handle, so a message is two device copies (``rayhf.realloc.cuda_ipc``).
This times the three on real moves of a Qwen2-0.5B-shaped model in bf16:
1 process -> 1 other, and tp2 -> dp2 on other processes (a relayed move), all processes on the
one GPU; every destination's shards are checked against the source bit for bit.

    python benchmarks/gpu_colocated_move.py [--reps 3] [--commit HASH]   # on a GPU machine
    python benchmarks/gpu_colocated_move.py --device cpu --layers 2       # a smoke run anywhere
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _common import git_commit, write_results

from rayhf.models.hf import ModelInit, hf_config
from rayhf.models.sharding import param_shards, shard_shape, take_shard
from rayhf.models.spec import model_spec
from rayhf.parallel.groups import host_store, join_store
from rayhf.parallel.layout import Layout
from rayhf.realloc.plan import plan_realloc
from rayhf.realloc.transport import TransferGroup, recv_all, send_all

WORLD = 4
DTYPE = torch.bfloat16
QWEN2_05B = {"family": "qwen2", "hidden_size": 896, "n_heads": 14, "n_kv_heads": 2,
             "intermediate_size": 4864, "tied": True, "max_positions": 1024}  # fmt: skip
MOVES = [  # (name, source layout, destination layout); destination ranks follow the source's
    ("1 process -> 1 other", Layout((0,), 1), Layout((1,), 1)),
    ("tp2 -> dp2 on others (relayed)", Layout((0, 1), 1, 2), Layout((2, 3), 2)),
]
TRANSPORTS = ("ipc", "segment", "pinned")


def _spec(layers: int) -> Any:
    init = ModelInit(**QWEN2_05B, n_layers=layers, config={"vocab_size": 151936})
    return model_spec(hf_config(init, 151936, 0, 1, 2), value_head=False)


def _full(spec: Any, device: str) -> dict[str, torch.Tensor]:
    """The same random bf16 weights in every process (seeded per parameter)."""
    out = {}
    for i, p in enumerate(param_shards(spec)):
        g = torch.Generator(device).manual_seed(i)
        out[p.name] = torch.randn(p.shape, generator=g, device=device).to(DTYPE)
    return out


def _worker(rank: int, address: str, stores: list[str], args: Any, queue: Any) -> None:
    if args.device == "cuda":
        torch.cuda.set_device(0)
    torch.set_num_threads(1)  # one copy thread each: 4 processes share the cores
    dist.init_process_group("gloo", store=join_store(address), rank=rank, world_size=WORLD)
    groups = {
        t: TransferGroup(
            join_store(s), rank, WORLD, args.device, True, same_host=t != "pinned", ipc=t == "ipc"
        )
        for t, s in zip(TRANSPORTS, stores, strict=True)
    }
    spec = _spec(args.layers)
    full = _full(spec, args.device)
    shards = {p.name: p for p in param_shards(spec)}
    rows = []
    for name, src, dst in MOVES:
        plan = plan_realloc(spec, src, dst, itemsize=2)
        dst0 = src.world_size  # destination ranks come after the source's
        mine: dict[str, torch.Tensor] = {}
        if rank < src.world_size:
            mine = {n: take_shard(t, shards[n], src.tp, rank % src.tp) for n, t in full.items()}
        elif rank < dst0 + dst.world_size:
            tp_rank = (rank - dst0) % dst.tp
            mine = {
                n: torch.zeros(shard_shape(p, dst.tp, tp_rank), dtype=DTYPE,
                               device=args.device)
                for n, p in shards.items()
            }  # fmt: skip
        for i in range(args.reps + 1):  # one warm-up, then transports in turn
            for transport in TRANSPORTS[i % 3 :] + TRANSPORTS[: i % 3]:
                seconds = _one_move(groups[transport], plan, rank, dst0, mine)
                if i and rank == 0:
                    rows.append({"move": name, "transport": transport, "seconds": seconds})
        if dst0 <= rank < dst0 + dst.world_size:
            tp_rank = (rank - dst0) % dst.tp
            exact = all(torch.equal(mine[n], take_shard(full[n], shards[n], dst.tp, tp_rank))
                        for n in full)  # fmt: skip
            assert exact, f"{name}: rank {rank} holds other weights than the source's"
        if rank == 0:
            rows.append({"move": name, "bytes_per_destination_rank": plan.max_received})
    for g in groups.values():
        g.close()
    if rank == 0:
        queue.put(rows)
    dist.barrier()
    dist.destroy_process_group()


def _one_move(group, plan, rank: int, dst0: int, mine) -> float:
    """One move over ``group``; the slowest rank's seconds (every rank returns it)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    dist.barrier()
    start = time.perf_counter()
    if rank < dst0:
        send_all(group, mine, plan.sent_by(rank, dst0))
    elif mine:
        r = rank - dst0
        recv_all(group, mine, plan.received_by(r, 0, dst0), forward=plan.forwarded_by(r, dst0))
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    took = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    return float(took)


def _table(rows: list[dict[str, Any]]) -> tuple[str, list[dict[str, Any]]]:
    lines = [
        "| move | GB per destination rank | CUDA IPC s | /dev/shm segment s | pinned buffers s "
        "| IPC / segment | IPC GB/s | segment GB/s |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    summary = []
    for name, _, _ in MOVES:
        size = next(r["bytes_per_destination_rank"] for r in rows if r.get("move") == name
                    and "bytes_per_destination_rank" in r)  # fmt: skip
        med = {t: statistics.median(r["seconds"] for r in rows if r.get("move") == name
                                    and r.get("transport") == t) for t in TRANSPORTS}  # fmt: skip
        summary.append({"move": name, "bytes": size, **{f"{t}_s": med[t] for t in TRANSPORTS}})
        gb = size / 1e9
        lines.append(
            f"| {name} | {gb:.3f} | {med['ipc']:.3f} | {med['segment']:.3f} | "
            f"{med['pinned']:.3f} | {med['ipc'] / med['segment']:.2f}x | "
            f"{gb / med['ipc']:.2f} | {gb / med['segment']:.2f} |"
        )
    return "\n".join(lines), summary


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--commit", default=None, help="the commit measured (no .git there)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("gpu_colocated_move: no CUDA device here; pass --device cpu for a smoke run")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    hosted = [host_store() for _ in range(len(TRANSPORTS) + 1)]  # open while the ranks meet
    address, *stores = (a for _, a in hosted)
    procs = [ctx.Process(target=_worker, args=(r, address, stores, args, queue))
             for r in range(WORLD)]  # fmt: skip
    for p in procs:
        p.start()
    rows = queue.get(timeout=1200)
    for p in procs:
        p.join(120)
    if any(p.exitcode for p in procs):
        sys.exit(f"gpu_colocated_move: a worker failed (exit codes {[p.exitcode for p in procs]})")
    table, summary = _table(rows)
    where = torch.cuda.get_device_name(0) if args.device == "cuda" else f"{os.cpu_count()} CPUs"
    text = (
        f"# Weight moves between processes sharing one GPU ({where})\n\n"
        f"`python benchmarks/gpu_colocated_move.py --reps {args.reps} --layers {args.layers}` "
        f"({args.device}, torch {torch.__version__}): a Qwen2-0.5B-shaped model ({args.layers} "
        "layers) in bf16, 4 processes on the one device in a gloo transfer group; median of "
        f"{args.reps} moves each, the slowest rank's time, transports in turn. Every "
        "destination rank's shards equal the source's bit for bit.\n\n"
        f"{table}\n\n"
        "- **CUDA IPC:** the sender copies its shards into a buffer on the GPU, the receiver "
        "opens it by handle and copies out of it on the device (`driver.same_host_transport: "
        "ipc`).\n"
        "- **Through the segment:** the sender copies its GPU shards into its `/dev/shm` "
        "segment, the receiver from it into its GPU shards (`TransferGroup` with `same_host`, "
        "the default).\n"
        "- **Through pinned buffers:** each message goes to the host, over gloo's socket into a "
        "pinned buffer, then to the GPU (`same_host=False`).\n"
    )
    print(text)
    if args.device == "cuda":
        write_results("gpu_colocated_move", text, {"rows": rows, "summary": summary},
                      commit=args.commit or git_commit())  # fmt: skip


if __name__ == "__main__":
    main()
