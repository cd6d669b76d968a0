"""Reallocation throughput on a ~100M-parameter Llama: rayhf's streams vs the fair naive path.

    python benchmarks/realloc_throughput.py [--layers 12] [--reps 3]

For each (source layout -> destination layout) pair, two role groups of real rayhf actors on
emulated devices hold the model; the same bytes (the destination shards) are moved by
  rayhf:    the planned streams over a transfer group, replicas relaying what they receive
            (``TransferGroupMover``), large messages through shared memory (same host),
  sockets:  the same, every message over the group's gloo sockets (``shm=False``),
  p2p:      the same slices, every replica getting its own from a source rank (``relay=False``),
  naive:    what a user would write: the source replica gathers its shards as tensors into its
            head actor, which puts the whole state dict in the Ray object store once; every
            destination actor fetches it and keeps its shards (``ObjectStoreCopy``),
and compared with a single-process memory copy of the same number of bytes, measured in the
same run (this machine's copy speed). A second table times moving one buffer from one process
to three, by gloo's broadcast and by rayhf's relayed messages (over gloo's sockets, and through
shared memory). Writes
docs/benchmarks/realloc_throughput.{md,json}.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from _common import write_results

PAIRS = [  # (name, source layout, destination layout) as (mesh, dp, tp, pp)
    ("1 device -> 1 other device", ((0,), 1, 1, 1), ((1,), 1, 1, 1)),
    ("1 device -> 3 replicas on others", ((0,), 1, 1, 1), ((1, 2, 3), 3, 1, 1)),
    ("train tp2 -> generate dp4", ((0, 1), 1, 2, 1), ((0, 1, 2, 3), 4, 1, 1)),
    ("train tp2 -> generate dp2", ((0, 1), 1, 2, 1), ((0, 1), 2, 1, 1)),
    ("pp2 -> tp2", ((0, 1), 1, 1, 2), ((0, 1), 1, 2, 1)),
    ("dp2 -> tp2 on other devices", ((0, 1), 2, 1, 1), ((2, 3), 1, 2, 1)),
]


def role_groups(tmp: Path, init, vocab: int, lora=None):
    """Ray on 4 emulated devices, a maker of role groups of real actors holding the model of
    ``init`` (a ``ModelInit``; with ``lora``, a ``LoraConfig``'s adapters on it) with no weights
    read (zeros until a move fills them), and the model's spec."""
    import ray

    from rayhf.algorithms import InterfaceSettings
    from rayhf.algorithms.ppo import PPOConfig
    from rayhf.models.files import special_ids
    from rayhf.models.hf import hf_config, model_files
    from rayhf.models.lora import adapted, lora_of
    from rayhf.models.tokenizer import build_char_tokenizer
    from rayhf.parallel.layout import Layout
    from rayhf.planner import ClusterConfig
    from rayhf.runtime.cluster import connect, reserve_devices
    from rayhf.runtime.messages import WorkerSpec
    from rayhf.runtime.role_group import RoleGroup
    from rayhf.sampling import GenerationConfig

    cluster = ClusterConfig(n_devices=4)
    devices = reserve_devices(cluster, connect(cluster))
    tok = build_char_tokenizer("0123456789abcdef", tmp / "tok")
    config = hf_config(init, vocab, tok.pad_token_id, tok.bos_token_id, tok.eos_token_id)
    files = model_files(config, False)
    if lora is not None:
        files = adapted(files, lora_of(lora, files.spec, "lora"))
    settings = InterfaceSettings(PPOConfig(), GenerationConfig())

    def group(name: str, lay: tuple) -> RoleGroup:
        layout = Layout(*lay)

        def spec(rank: int) -> WorkerSpec:
            return WorkerSpec(
                name, layout.name, rank, layout.dp, layout.tp, layout.pp, 1, (), settings,
                str(tmp / "tok"), special_ids(tok), files, None, False, None, 0, 1,
            )  # fmt: skip

        g = RoleGroup(name, layout, spec, devices, 0.25, "rayhf-bench")
        g.setup()
        return g

    return ray, devices, group, files.spec


def _memcpy_seconds(n_bytes: int, reps: int) -> float:
    src = torch.empty(n_bytes // 4)
    dst = torch.empty_like(src)
    times = []
    for _ in range(reps + 1):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def _moves(mover, src, dst, spec, reps: int) -> float:
    mover.move(src, dst, spec)  # warm-up: creates the transfer group
    return statistics.median(mover.move(src, dst, spec).seconds for _ in range(reps))


def bench(layers: int, reps: int) -> dict:
    from rayhf.models.hf import ModelInit
    from rayhf.models.sharding import param_shards
    from rayhf.realloc.mover import ObjectStoreCopy, TransferGroupMover

    torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        init = ModelInit(family="llama", hidden_size=768, n_layers=layers, n_heads=12)
        ray, devices, group, spec = role_groups(Path(tmp), init, 8192)
        params = sum(p.numel for p in param_shards(spec))
        relayed, sockets, direct, naive = (
            TransferGroupMover(),
            TransferGroupMover(shm=False),
            TransferGroupMover(relay=False),
            ObjectStoreCopy(),
        )
        try:
            for i, (name, a, b) in enumerate(PAIRS):
                src, dst = group(f"src{i}", a), group(f"dst{i}", b)
                plan = relayed.plan(spec, src.layout, dst.layout)
                p2p = direct.plan(spec, src.layout, dst.layout)
                rows.append(
                    {
                        "pair": name,
                        "bytes": plan.total_bytes,
                        "max_sent": plan.max_sent,
                        "max_received": plan.max_received,
                        "p2p_max_sent": p2p.max_sent,
                        "rayhf_s": _moves(relayed, src, dst, spec, reps),
                        "sockets_s": _moves(sockets, src, dst, spec, reps),
                        "p2p_s": _moves(direct, src, dst, spec, reps),
                        "naive_s": statistics.median(
                            naive.move(src, dst, spec).seconds for _ in range(reps)
                        ),
                        "memcpy_s": _memcpy_seconds(plan.total_bytes, reps),
                    }
                )
                print(rows[-1], flush=True)
                src.kill()
                dst.kill()
        finally:
            devices.close()
            ray.shutdown()
    return {"params": params, "layers": layers, "reps": reps, "rows": rows}


def _chain_worker(rank: int, address: tuple[str, str], n_bytes: int, reps: int, out: str) -> None:
    """Rank 0 has a buffer; ranks 1-3 get it by gloo's broadcast, then by relayed messages over
    gloo's sockets, then through shared memory."""
    import json

    from rayhf.parallel.groups import join_store
    from rayhf.realloc.plan import Transfer
    from rayhf.realloc.transport import TransferGroup, recv_all, send_all

    torch.set_num_threads(1)
    groups = {
        "relay": TransferGroup(join_store(address[0]), rank, 4, same_host=False),
        "relay_shm": TransferGroup(join_store(address[1]), rank, 4),
    }
    group = groups["relay"]
    n = n_bytes // 4
    buf = {"w": torch.arange(n, dtype=torch.float32) if rank == 0 else torch.zeros(n)}
    hop = [Transfer("w", 0, 0, n, 0, 0, 0, 0, n_bytes, stream=0)]  # one stream, a chain
    times: dict[str, list[float]] = {"broadcast": [], "relay": [], "relay_shm": []}
    for _ in range(reps + 1):
        for how in times:
            group.pg.barrier().wait()
            start = time.perf_counter()
            if how == "broadcast":
                group.pg.broadcast([buf["w"]]).wait()
            elif rank == 0:
                send_all(groups[how], buf, {1: hop})
            else:
                forward = {rank + 1: hop} if rank < 3 else {}
                recv_all(groups[how], buf, {rank - 1: hop}, forward=forward)
            group.pg.barrier().wait()
            times[how].append(time.perf_counter() - start)
    assert torch.equal(buf["w"], torch.arange(n, dtype=torch.float32))
    if rank == 0:
        with open(out, "w") as f:
            json.dump({k: statistics.median(v[1:]) for k, v in times.items()}, f)


def chain(n_bytes: int, reps: int) -> dict:
    import json

    import torch.multiprocessing as mp

    from rayhf.parallel.groups import host_store

    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "chain.json")
        stores = [host_store() for _ in range(2)]  # open here while the ranks meet through them
        addresses = tuple(a for _, a in stores)
        mp.spawn(_chain_worker, args=(addresses, n_bytes, reps, out), nprocs=4)
        return {"bytes": n_bytes, **json.loads(Path(out).read_text())}


def report(res: dict) -> str:
    gb = [r["bytes"] / 1e9 for r in res["rows"]]
    lines = [
        f"# Reallocation throughput, {res['params'] / 1e6:.0f}M-parameter Llama "
        f"({res['layers']} layers, hidden 768, vocab 8192, fp32)",
        "",
        f"Command: `python benchmarks/realloc_throughput.py --layers {res['layers']} "
        f"--reps {res['reps']}` on {os.cpu_count()} CPU cores (4 emulated devices, one host: "
        "rayhf's large messages go through shared memory, `sockets` sends them over gloo's TCP "
        f"loopback). Median of {res['reps']} moves each. MB = what the destination ranks "
        "receive, summed; GB/s = that over the move's seconds; `of copy` = rayhf's GB/s over "
        "a one-process memory copy of the same bytes measured in the same run; busiest send = "
        "the most one device sends to others (rayhf / point to point), beside the most one "
        "receives.",
        "",
        "| layout pair | MB | rayhf GB/s | sockets GB/s | p2p GB/s | naive GB/s | rayhf / naive "
        "| copy GB/s | of copy | busiest send MB (rayhf / p2p) | busiest receive MB |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r, g in zip(res["rows"], gb, strict=True):
        lines.append(
            f"| {r['pair']} | {r['bytes'] / 1e6:.0f} | {g / r['rayhf_s']:.2f} | "
            f"{g / r['sockets_s']:.2f} | {g / r['p2p_s']:.2f} | {g / r['naive_s']:.2f} | "
            f"{r['naive_s'] / r['rayhf_s']:.1f}x "
            f"| {g / r['memcpy_s']:.2f} | {r['memcpy_s'] / r['rayhf_s']:.0%} | "
            f"{r['max_sent'] / 1e6:.0f} / {r['p2p_max_sent'] / 1e6:.0f} | "
            f"{r['max_received'] / 1e6:.0f} |"
        )
    speedups = [r["naive_s"] / r["rayhf_s"] for r in res["rows"]]
    geo = statistics.geometric_mean(speedups)
    largest = max(res["rows"], key=lambda r: r["bytes"])
    c = res["chain"]
    lines += [
        "",
        f"rayhf over the naive path: geometric mean {geo:.1f}x, median "
        f"{statistics.median(speedups):.1f}x, range {min(speedups):.1f}-{max(speedups):.1f}x. "
        f"The largest move ({largest['pair']}) runs at "
        f"{largest['memcpy_s'] / largest['rayhf_s']:.0%} of this machine's copy speed.",
        "",
        f"One buffer of {c['bytes'] / 1e6:.0f} MB from one process to three (median of "
        f"{res['reps']}): gloo's broadcast {c['broadcast']:.3f} s; rayhf's relayed messages over "
        f"gloo's sockets {c['relay']:.3f} s ({c['broadcast'] / c['relay']:.2f}x), through "
        f"shared memory {c['relay_shm']:.3f} s ({c['broadcast'] / c['relay_shm']:.2f}x).",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    res = bench(args.layers, args.reps)
    res["chain"] = chain(max(r["bytes"] for r in res["rows"]) // 4, args.reps)
    text = report(res)
    print(text)
    write_results("realloc_throughput", text, res)


if __name__ == "__main__":
    main()
