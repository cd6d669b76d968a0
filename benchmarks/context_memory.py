"""A train call's memory and time per device with each sequence split over cp ranks.

    python benchmarks/context_memory.py [--tokens 8192 16384 32768] [--cp 1 2 4]

A Llama-shaped model (256 wide, 4 layers, 8 query and 4 key/value heads, 512-token vocabulary;
random weights, fp32, AdamW) trains one step on one packed batch of ``--tokens`` tokens in four
rows of very different lengths (1/2, 1/4, 1/8 and 1/8 of them: a long-tailed batch of reasoning
traces), the loss the mean next-token log-prob through ``score``, as a train call's
``TorchTrainer.train`` runs it, on ``cp`` gloo ranks that split each sequence
(``rayhf.parallel.context``; one process and one thread per rank, emulated devices). Memory:
torch's ``MemTracker`` over the second step on each rank (the first creates AdamW's state), the
largest rank's peak of everything it holds and of its activations (what autograd keeps for
backward); time: that second step, the slowest rank's. The goal (issue 68): activation memory
per device falls as 1/cp within 15%. Writes docs/benchmarks/context_memory.{md,json}.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from _common import described, git_commit, llama_trainer, next_token_step, spawned, write_results

WIDTH, LAYERS, HEADS, KV_HEADS, VOCAB = 256, 4, 8, 4, 512


def lengths_of(tokens: int) -> list[int]:
    """Four rows of 1/2, 1/4, 1/8 and 1/8 of ``tokens``."""
    return [tokens // 2, tokens // 4, tokens // 8, tokens - tokens // 2 - tokens // 4 - tokens // 8]


def _rank(rank: int, address: str, out: Any, cp: int, tokens: int) -> None:
    from torch.distributed._tools.mem_tracker import MemTracker

    from rayhf.parallel.groups import build_groups, join_store, leave_spawned, single

    torch.set_num_threads(1)
    if cp > 1:
        dist.init_process_group("gloo", store=join_store(address), rank=rank, world_size=cp)
    groups = build_groups(cp, 1, 1, rank, cp=cp) if cp > 1 else single()
    shape = {"hidden_size": WIDTH, "n_layers": LAYERS, "n_heads": HEADS, "n_kv_heads": KV_HEADS}
    engine = llama_trainer(groups, VOCAB, **shape)
    step = next_token_step(engine, lengths_of(tokens), VOCAB, torch.Generator())
    step()  # AdamW's state exists from here on
    tracker = MemTracker()
    tracker.track_external(engine.model.module, engine.trainer.optimizer)
    began = time.perf_counter()
    with tracker:
        step()
    seconds = time.perf_counter() - began
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
    act = sum(int(v) for k, v in peak.items() if str(k).endswith("ACT"))
    out[rank] = {"peak_bytes": int(peak["Total"]), "activation_bytes": act, "seconds": seconds}
    if cp > 1:
        leave_spawned()


def measure(tokens: int, cp: int) -> dict[str, Any]:
    ranks = spawned(_rank, cp, cp, tokens)
    return {
        "tokens": tokens,
        "cp": cp,
        "peak_bytes": max(r["peak_bytes"] for r in ranks),
        "activation_bytes": max(r["activation_bytes"] for r in ranks),
        "seconds": max(r["seconds"] for r in ranks),
    }


def report(rows: list[dict], args: str, commit: str) -> str:
    lines = [
        "# A train call's memory per device with each sequence split over cp ranks",
        "",
        f"`python benchmarks/context_memory.py{args}` on this machine (2 CPU cores), commit "
        f"{commit}. " + described(__doc__),
        "",
        "| tokens | cp | peak memory | activations | activations x cp / cp = 1's | step | "
        "vs cp = 1 |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        one = next(x for x in rows if x["tokens"] == r["tokens"] and x["cp"] == 1)
        ratio = r["activation_bytes"] * r["cp"] / one["activation_bytes"]
        lines.append(
            f"| {r['tokens']} | {r['cp']} | {r['peak_bytes'] / 2**20:.0f} MiB | "
            f"{r['activation_bytes'] / 2**20:.0f} MiB | {ratio:.3f} | {r['seconds']:.1f} s | "
            f"{r['seconds'] / one['seconds']:.2f}x |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[8192, 16384, 32768])
    ap.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    args = ap.parse_args()
    rows = []
    for tokens in args.tokens:
        for cp in sorted(set(args.cp) | {1}):
            rows.append(measure(tokens, cp))
            print(rows[-1], flush=True)
    commit = git_commit()
    text = report(rows, "".join(f" {a}" for a in sys.argv[1:]), commit)
    print(text)
    write_results("context_memory", text, {"rows": rows}, commit)


if __name__ == "__main__":
    main()
