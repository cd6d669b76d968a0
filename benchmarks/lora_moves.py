"""What a LoRA role's weight moves carry and cost: the adapters alone against the whole model.

    python benchmarks/lora_moves.py [--rank 16] [--reps 3]

Measured: a Qwen2-0.5B-shaped model (896 wide, 24 layers, Qwen2.5's vocabulary, tied
embedding) with rank-``--rank`` adapters on every linear layer of the decoder layers, held by
role groups of real rayhf actors on emulated CPU devices (fp32, as
benchmarks/realloc_throughput.py holds them), moved from the layout its train call holds it in
to a generate call's, as a step moves it before generating: the whole model (what a role
without adapters moves, and what a LoRA role's moves carried before they skipped the frozen
weights) and the adapters alone (``skip_frozen``: what a LoRA role's step moves, its copies
keeping the frozen weights they loaded). Bytes: what the destination ranks receive; seconds:
the median of ``--reps`` moves after a warm-up that joins the transfer group.

Priced: the planner's model of the same two moves (``realloc_seconds``; bf16 copies, the
cluster's compute dtype; H100 datasheet figures) for Qwen2.5-7B and 32B between the train and
generate layouts of the searched LoRA plans in docs/benchmarks/planner_lora.md. Writes
docs/benchmarks/lora_moves.{md,json}.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from _common import described, git_commit, write_results
from realloc_throughput import role_groups
from train_step import SIZES

SIZE = SIZES["qwen2-0.5B"]
CPU_PAIRS = [  # (what, train layout, generate layout) as (mesh, dp, tp, pp)
    ("train tp2 -> generate dp2, the same devices", ((0, 1), 1, 2, 1), ((0, 1), 2, 1, 1)),
    ("train tp2 -> generate dp2 on two others", ((0, 1), 1, 2, 1), ((2, 3), 2, 1, 1)),
]
PRICED = [  # (policy, cluster, train layout, generate layout): the searched LoRA plans' calls
    ("qwen2.5-7b", "1x8xH100", (tuple(range(8)), 8, 1, 1), (tuple(range(8)), 2, 4, 1)),
    ("qwen2.5-32b", "2x8xH100", (tuple(range(16)), 4, 2, 2), (tuple(range(16)), 2, 8, 1)),
    ("qwen2.5-32b", "2x8xH100", (tuple(range(16)), 2, 2, 4), (tuple(range(16)), 2, 8, 1)),
]


def measured(rank: int, reps: int) -> list[dict[str, Any]]:
    from rayhf.models.hf import ModelInit
    from rayhf.models.lora import LoraConfig
    from rayhf.realloc.mover import TransferGroupMover

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        init = ModelInit(**{"family": "llama", **SIZE["init"]})
        ray, devices, group, spec = role_groups(
            Path(tmp), init, SIZE["vocab"], LoraConfig(rank=rank)
        )
        mover = TransferGroupMover()
        try:
            for i, (what, a, b) in enumerate(CPU_PAIRS):
                src, dst = group(f"train{i}", a), group(f"gen{i}", b)
                row: dict[str, Any] = {"pair": what}
                for way, skip in (("whole", False), ("adapters", True)):
                    mover.move(src, dst, spec, skip_frozen=skip)  # warm-up
                    stats = [mover.move(src, dst, spec, skip_frozen=skip) for _ in range(reps)]
                    row[f"{way}_bytes"] = stats[0].bytes
                    row[f"{way}_s"] = statistics.median(s.seconds for s in stats)
                rows.append(row)
                print(row, flush=True)
                src.kill()
                dst.kill()
        finally:
            devices.close()
            ray.shutdown()
    return rows


def priced(rank: int) -> list[dict[str, Any]]:
    from rayhf.models.lora import LoraConfig, with_lora
    from rayhf.models.shapes import public_shape
    from rayhf.parallel.layout import Layout
    from rayhf.planner.cost import AnalyticCost
    from rayhf.planner.hardware import parse_cluster
    from rayhf.planner.simulate import Carried, realloc_seconds
    from rayhf.realloc.plan import plan_realloc

    rows = []
    for policy, cluster, a, b in PRICED:
        spec = with_lora(public_shape(policy), LoraConfig(rank=rank), "lora")
        cost = AnalyticCost(parse_cluster(cluster))
        src, dst = Layout(*a), Layout(*b)
        row: dict[str, Any] = {"policy": policy, "cluster": cluster, "src": src.name}
        row["dst"] = dst.name
        for way, skip in (("whole", False), ("adapters", True)):
            plan = plan_realloc(spec, src, dst, cost.weight_bytes(spec), skip_frozen=skip)
            row[f"{way}_bytes"] = plan.total_bytes
            row[f"{way}_s"] = realloc_seconds(cost, spec, src, dst, Carried(skip_frozen=skip))
        rows.append(row)
        print(row, flush=True)
    return rows


def _ratio(row: dict[str, Any]) -> str:
    return (
        f"{row['whole_bytes'] / row['adapters_bytes']:.0f}x fewer bytes, "
        f"{row['whole_s'] / row['adapters_s']:.0f}x less time"
    )


def report(res: dict[str, Any], commit: str, args: str) -> str:
    mib = 2**20
    lines = [
        "# A LoRA role's weight moves: the adapters alone against the whole model",
        "",
        f"`python benchmarks/lora_moves.py{args}` on this machine (2 CPU cores), commit {commit}. "
        + described(__doc__),
        "",
        f"Measured, rank {res['rank']}:",
        "",
        "| move | whole model | s | adapters alone | s | adapters against whole |",
        "| --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in res["measured"]:
        lines.append(
            f"| {r['pair']} | {r['whole_bytes'] / mib:,.1f} MiB | {r['whole_s']:.3f} | "
            f"{r['adapters_bytes'] / mib:,.1f} MiB | {r['adapters_s']:.3f} | {_ratio(r)} |"
        )
    lines += [
        "",
        f"Priced by the planner's model, rank {res['rank']}, bf16:",
        "",
        "| policy | cluster | train -> generate | whole model | s | adapters alone | s | "
        "adapters against whole |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in res["priced"]:
        lines.append(
            f"| {r['policy']} | {r['cluster']} | {r['src']} -> {r['dst']} | "
            f"{r['whole_bytes'] / 2**30:,.1f} GiB | {r['whole_s']:.3f} | "
            f"{r['adapters_bytes'] / mib:,.0f} MiB | {r['adapters_s']:.4f} | {_ratio(r)} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    commit = git_commit()
    res = {"rank": args.rank, "priced": priced(args.rank)}
    res["measured"] = measured(args.rank, args.reps)
    text = report(res, commit, "".join(f" {a}" for a in sys.argv[1:]))
    print(text)
    write_results("lora_moves", text, res, commit)


if __name__ == "__main__":
    main()
