"""Reallocation throughput on a ~100M-parameter Llama: collective slices vs the naive path.

    python benchmarks/realloc_throughput.py [--layers 12] [--reps 3]

For each (source layout -> destination layout) pair, two role groups of real rayhf actors on
emulated devices hold the model; the same bytes (the destination shards) are moved by
  collective: rayhf's planned slices over a transfer group (``TransferGroupMover``),
  naive:      the source gathers the whole state dict into one actor, puts it in the Ray object
              store, every destination actor fetches all of it and keeps its shards
              (``ObjectStoreCopy``),
and compared with a single-process memory copy of the same number of bytes (the physical limit
on this machine). Writes docs/benchmarks/realloc_throughput.{md,json}.
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
    ("train tp2 -> generate dp2", ((0, 1), 1, 2, 1), ((0, 1), 2, 1, 1)),
    ("pp2 -> tp2", ((0, 1), 1, 1, 2), ((0, 1), 1, 2, 1)),
    ("dp2 -> tp2 on other devices", ((0, 1), 2, 1, 1), ((2, 3), 1, 2, 1)),
]


def _groups(tmp: Path, layers: int):
    import ray

    from rayhf.algorithms import InterfaceSettings
    from rayhf.algorithms.ppo import PPOConfig
    from rayhf.models.hf import ModelInit, hf_config
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
    init = ModelInit(family="llama", hidden_size=768, n_layers=layers, n_heads=12)
    config = hf_config(init, 8192, tok.pad_token_id, tok.bos_token_id, tok.eos_token_id)
    config.save_pretrained(tmp / "model")
    settings = InterfaceSettings(PPOConfig(), GenerationConfig())

    def group(name: str, lay: tuple) -> RoleGroup:
        layout = Layout(*lay)

        def spec(rank: int) -> WorkerSpec:
            return WorkerSpec(
                name, layout.name, rank, layout.dp, layout.tp, layout.pp, 1, (), settings,
                str(tmp / "tok"), None, str(tmp / "model"), False, None, 0, 1,
            )  # fmt: skip

        g = RoleGroup(name, layout, spec, devices, 0.25, "rayhf-bench")
        g.setup()
        return g

    return ray, devices, group


def _memcpy_seconds(n_bytes: int, reps: int) -> float:
    src = torch.empty(n_bytes // 4)
    dst = torch.empty_like(src)
    times = []
    for _ in range(reps + 1):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def bench(layers: int, reps: int) -> dict:
    from transformers import AutoConfig

    from rayhf.models.sharding import param_shards
    from rayhf.models.spec import model_spec
    from rayhf.realloc.mover import ObjectStoreCopy, TransferGroupMover

    torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        ray, devices, group = _groups(Path(tmp), layers)
        spec = model_spec(AutoConfig.from_pretrained(Path(tmp) / "model"), value_head=False)
        params = sum(p.numel for p in param_shards(spec))
        collective, naive = TransferGroupMover(), ObjectStoreCopy()
        try:
            for i, (name, a, b) in enumerate(PAIRS):
                src, dst = group(f"src{i}", a), group(f"dst{i}", b)
                moved = collective.plan(spec, src.layout, dst.layout).total_bytes
                collective.move(src, dst, spec)  # warm-up: creates the transfer group
                fast = [collective.move(src, dst, spec).seconds for _ in range(reps)]
                slow = [naive.move(src, dst, spec).seconds for _ in range(reps)]
                rows.append(
                    {
                        "pair": name,
                        "bytes": moved,
                        "collective_s": statistics.median(fast),
                        "naive_s": statistics.median(slow),
                        "memcpy_s": _memcpy_seconds(moved, reps),
                    }
                )
                print(rows[-1], flush=True)
                src.kill()
                dst.kill()
        finally:
            devices.close()
            ray.shutdown()
    return {"params": params, "layers": layers, "reps": reps, "rows": rows}


def report(res: dict) -> str:
    lines = [
        f"# Reallocation throughput, {res['params'] / 1e6:.0f}M-parameter Llama "
        f"({res['layers']} layers, hidden 768, vocab 8192, fp32)",
        "",
        f"Command: `python benchmarks/realloc_throughput.py --layers {res['layers']} "
        f"--reps {res['reps']}` on {os.cpu_count()} CPU cores (4 emulated devices). Median of "
        f"{res['reps']} moves each; bytes = the destination shards.",
        "",
        "| layout pair | MB moved | collective GB/s | naive GB/s | speed-up | memcpy GB/s | "
        "of memcpy |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in res["rows"]:
        gb = r["bytes"] / 1e9
        lines.append(
            f"| {r['pair']} | {r['bytes'] / 1e6:.0f} | {gb / r['collective_s']:.2f} | "
            f"{gb / r['naive_s']:.2f} | {r['naive_s'] / r['collective_s']:.1f}x | "
            f"{gb / r['memcpy_s']:.2f} | {r['memcpy_s'] / r['collective_s']:.0%} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    res = bench(args.layers, args.reps)
    text = report(res)
    print(text)
    write_results("realloc_throughput", text, res)


if __name__ == "__main__":
    main()
