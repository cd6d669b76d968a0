"""Data-parallel shares balanced by tokens against equal counts of rows, on long-tailed batches.

    python benchmarks/token_balance.py [--batches 50] [--repeats 3]

Sampled reasoning traces are long-tailed: each batch here holds rows of a 256-token prompt and a
response whose length is log-normal (median 1,024 tokens, sigma 1, cut to 64..16,384), drawn
from a fixed seed. For each batch size and dp degree, ``--batches`` batches are split two ways:
equal counts of consecutive rows (what a split by rows gives) and ``PackedBatch.split``'s
partition by tokens, which every replica of a call takes (``rayhf.runtime.flow.replica_share``),
and the largest share's tokens over the mean share's is reported (geometric mean, median and
worst over the batches; the goal in issue 68: at most 1.1). Then a train call on 2 gloo ranks
(dp = 2, one process and one thread each): a Llama-shaped model (256 wide, 4 layers, fp32,
AdamW) trains one step on each rank's share of one 32-row batch of that distribution, scaled
to 16,384 tokens; the step's time is the slower rank's, the median of ``--repeats`` steps after
one warm-up, for each split. Writes docs/benchmarks/token_balance.{md,json}.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from _common import described, git_commit, llama_trainer, next_token_step, spawned, write_results

from rayhf.data.batch import balanced_partition
from rayhf.parallel.pipeline import split_rows

PROMPT, MEDIAN, SIGMA, SHORTEST, LONGEST = 256, 1024, 1.0, 64, 16384


def lengths_of(n_rows: int, gen: torch.Generator) -> list[int]:
    """Rows of a prompt and a log-normal response."""
    normal = torch.randn(n_rows, generator=gen, dtype=torch.float64)
    response = (MEDIAN * torch.exp(SIGMA * normal)).clamp(SHORTEST, LONGEST).round().long()
    return [PROMPT + int(n) for n in response]


def by_rows(lengths: list[int], n: int) -> list[list[int]]:
    return [list(r) for r in split_rows(len(lengths), n, exact=True)]


def by_tokens(lengths: list[int], n: int) -> list[list[int]]:
    return balanced_partition(lengths, n)


def imbalance(lengths: list[int], parts: list[list[int]]) -> float:
    loads = [sum(lengths[i] for i in p) for p in parts]
    return max(loads) / (sum(loads) / len(loads))


def bound(lengths: list[int], n: int) -> float:
    """No split does better: the longest row, or the mean, over the mean."""
    return max(1.0, max(lengths) / (sum(lengths) / n))


def _summary(values: list[float]) -> dict[str, float]:
    return {
        "geomean": math.exp(statistics.fmean(math.log(v) for v in values)),
        "median": statistics.median(values),
        "worst": max(values),
    }


def splits(n_batches: int) -> list[dict[str, Any]]:
    gen = torch.Generator().manual_seed(0)
    rows = []
    for n_rows in (64, 256):
        batches = [lengths_of(n_rows, gen) for _ in range(n_batches)]
        for dp in (2, 4, 8, 16):
            rows.append({
                "rows": n_rows, "dp": dp,
                "by_rows": _summary([imbalance(b, by_rows(b, dp)) for b in batches]),
                "by_tokens": _summary([imbalance(b, by_tokens(b, dp)) for b in batches]),
                "bound": _summary([bound(b, dp) for b in batches]),
            })  # fmt: skip
    return rows


WIDTH, LAYERS, VOCAB, STEP_ROWS, STEP_TOKENS = 256, 4, 512, 32, 16384


def step_lengths() -> list[int]:
    """One batch of the distribution, scaled to about ``STEP_TOKENS`` tokens (each row >= 8)."""
    lengths = lengths_of(STEP_ROWS, torch.Generator().manual_seed(1))
    scale = STEP_TOKENS / sum(lengths)
    return [max(8, round(n * scale)) for n in lengths]


def _rank(rank: int, address: str, out: Any, split: str, repeats: int) -> None:
    from rayhf.parallel.groups import build_groups, join_store, leave_spawned

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=join_store(address), rank=rank, world_size=2)
    shape = {"hidden_size": WIDTH, "n_layers": LAYERS, "n_heads": 4}
    engine = llama_trainer(build_groups(2, 1, 1, rank), VOCAB, **shape)
    all_lengths = step_lengths()
    parts = by_rows(all_lengths, 2) if split == "by_rows" else by_tokens(all_lengths, 2)
    lengths = [all_lengths[i] for i in parts[rank]]
    step = next_token_step(engine, lengths, VOCAB, torch.Generator().manual_seed(rank))
    times = []
    for _ in range(repeats + 1):
        dist.barrier()
        began = time.perf_counter()
        step()  # its gradient all-reduce waits for the other rank
        times.append(time.perf_counter() - began)
    out[rank] = {"tokens": sum(lengths), "seconds": statistics.median(times[1:])}
    leave_spawned()


def step(split: str, repeats: int) -> dict[str, Any]:
    ranks = spawned(_rank, 2, split, repeats)
    tokens = [r["tokens"] for r in ranks]
    return {
        "split": split,
        "tokens": tokens,
        "max_over_mean": max(tokens) / (sum(tokens) / 2),
        "seconds": max(r["seconds"] for r in ranks),
    }


def report(rows: list[dict], steps: list[dict], args: str, commit: str) -> str:
    lines = [
        "# Data-parallel shares balanced by tokens against equal counts of rows",
        "",
        f"`python benchmarks/token_balance.py{args}` on this machine (2 CPU cores), commit "
        f"{commit}. " + described(__doc__),
        "",
        "The largest share's tokens over the mean share's (geometric mean, median, worst), and",
        "the bound no split can beat (the longest row over the mean share, at least 1):",
        "",
        "| rows | dp | by rows | by tokens | bound |",
        "| ---: | ---: | --- | --- | --- |",
    ]
    for r in rows:
        cells = [
            f"{s['geomean']:.3f}, {s['median']:.3f}, {s['worst']:.3f}"
            for s in (r["by_rows"], r["by_tokens"], r["bound"])
        ]
        lines.append(f"| {r['rows']} | {r['dp']} | {' | '.join(cells)} |")
    lines += [
        "",
        f"A train step on 2 ranks, {sum(steps[0]['tokens'])} tokens in {STEP_ROWS} rows:",
        "",
        "| split | tokens per rank | largest over mean | step (slower rank) |",
        "| --- | --- | ---: | ---: |",
    ]
    for s in steps:
        lines.append(
            f"| {s['split'].replace('_', ' ')} | {', '.join(map(str, s['tokens']))} | "
            f"{s['max_over_mean']:.3f} | {s['seconds']:.2f} s |"
        )
    change = steps[1]["seconds"] / steps[0]["seconds"]
    lines += [
        "",
        f"By tokens the step takes {change:.2f}x the time it takes by rows. A step's time is not "
        "in proportion to its tokens: attention runs each row padded to its share's longest "
        "(work in proportion to the rows times the longest row squared), which a split by "
        "tokens leaves as it finds it.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    rows = splits(args.batches)
    for r in rows:
        print(r, flush=True)
    steps = [step(split, args.repeats) for split in ("by_rows", "by_tokens")]
    print(steps, flush=True)
    commit = git_commit()
    text = report(rows, steps, "".join(f" {a}" for a in sys.argv[1:]), commit)
    print(text)
    write_results("token_balance", text, {"splits": rows, "steps": steps}, commit)


if __name__ == "__main__":
    main()
