"""Data-parallel gradient averaging: buckets that overlap backward against one flat all-reduce
after it.

    python benchmarks/dp_reduce.py [--repeats 7] [--size llama-45M] [--no-write]

Two processes (dp = 2, gloo, one torch thread each) train ``benchmarks/train_step.py``'s model and
batch with rayhf's torch trainer: as it is (``rayhf.engines.grad_buckets``: gradients are views of
25 MiB buckets, each all-reduced while backward goes on) and as it was (after backward, every
gradient copied into one flat buffer, all-reduced, copied back). Seconds per train call, median
and minimum over ``--repeats`` after two warm-ups, alternating the two; and the bytes the flat
path allocates on top (one more copy of the gradients).

Writes docs/benchmarks/dp_reduce.{md,json}.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _common import write_results
from train_step import SIZES, batch_of, model_of

from rayhf.algorithms.lm import response_forward
from rayhf.algorithms.sft import sft_loss
from rayhf.checks.common import Tok
from rayhf.engines.build import standalone_engine
from rayhf.engines.torch_trainer import OptimizerConfig
from rayhf.parallel.groups import build_groups


class FlatAfterBackward:
    """The reduction as it was: nothing during backward, then one flat all-reduce."""

    def __init__(self, params: list[torch.nn.Parameter], group: Any) -> None:
        self.params, self.group = params, group

    def arm(self) -> None:
        pass

    def finish(self) -> None:
        grads = [p.grad for p in self.params if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.group)
        flat /= dist.get_world_size(self.group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


def _worker(rank: int, store: str, args: Any, out: Any) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    size = SIZES[args.size]
    groups = build_groups(2, 1, 1, rank)
    engine = standalone_engine(model_of(size), Tok(), False, OptimizerConfig(lr=1e-5), groups)
    trainer = engine.trainer
    assert trainer is not None
    batch = batch_of(size)

    def loss_fn(mb):
        logp, _, mask = response_forward(engine, mb)
        return sft_loss(logp, mask)

    buckets = trainer._reducer()
    params = list(trainer.model.module.parameters())
    flat = FlatAfterBackward(params, groups.dp_group)
    ways = {"buckets": buckets, "flat": flat}
    times: dict[str, list[float]] = {w: [] for w in ways}
    for i in range(args.repeats + 2):
        for way in ways if i % 2 else reversed(list(ways)):
            trainer._reducer = lambda way=way: ways[way]  # type: ignore[method-assign]
            dist.barrier()
            start = time.perf_counter()
            trainer.train([batch], loss_fn)
            took = torch.tensor([time.perf_counter() - start])
            dist.all_reduce(took, op=dist.ReduceOp.MAX)
            if i >= 2:
                times[way].append(float(took))
    if rank == 0:
        out.put(
            {
                "times": times,
                "buckets_in_backward": buckets.in_backward,
                "n_buckets": len(buckets.buckets),
                "grad_bytes": sum(p.numel() * p.element_size() for p in params),
                "params": sum(p.numel() for p in params),
            }
        )
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--size", default="llama-45M", choices=list(SIZES))
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_worker, args=(r, f"{tmp}/store", args, out)) for r in range(2)]
        for p in procs:
            p.start()
        res = out.get()
        for p in procs:
            p.join(60)
    if any(p.exitcode for p in procs):
        sys.exit(f"dp_reduce: a worker failed ({[p.exitcode for p in procs]})")
    med = {w: statistics.median(t) for w, t in res["times"].items()}
    low = {w: min(t) for w, t in res["times"].items()}
    text = "\n".join(
        [
            "# Data-parallel gradient averaging: buckets during backward vs one flat all-reduce",
            "",
            f"Command: `python benchmarks/dp_reduce.py --repeats {args.repeats} --size "
            f"{args.size}` on {os.cpu_count()} CPU cores: dp = 2 (gloo), one torch thread a "
            f"process, a {res['params'] / 1e6:.1f}M-parameter model, "
            f"`benchmarks/train_step.py`'s batch; one train call (one AdamW step) each, "
            "alternating.",
            "",
            "| reduction | median s | min s | extra gradient copy |",
            "| --- | ---: | ---: | ---: |",
            f"| buckets during backward ({res['n_buckets']} of 25 MiB; "
            f"{res['buckets_in_backward']} launched before backward returned) | "
            f"{med['buckets']:.3f} | {low['buckets']:.3f} | 0 |",
            f"| one flat all-reduce after backward (before) | {med['flat']:.3f} | "
            f"{low['flat']:.3f} | {res['grad_bytes'] / 2**20:.0f} MiB |",
            "",
            f"Buckets over flat: {med['buckets'] / med['flat']:.2f}x (median).",
        ]
    )
    print(text)
    if not args.no_write:
        write_results("dp_reduce", text, {**res, "median": med, "min": low})


if __name__ == "__main__":
    main()
