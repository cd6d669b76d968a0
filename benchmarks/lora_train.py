"""A LoRA role's train call against full fine-tuning's: peak memory and step time.

    python benchmarks/lora_train.py [--rank 16] [--repeats 3] [--tokens 256 1024]

A Qwen2-0.5B-shaped model (896 wide, 24 layers, Qwen2.5's vocabulary; random weights) on one
CPU rank, trained one optimizer step at a time as a train call trains (``TorchTrainer.train``
of one minibatch, the SFT loss through ``response_forward``, fp32, AdamW), in full and with
rank-``--rank`` adapters on every linear layer of the decoder layers (``models.<role>.lora:
{rank: R}``), for each batch of ``--tokens`` tokens (rows of 32 prompt and 224 response
tokens) with activation checkpointing. Peak: torch's ``MemTracker`` over the second step
(weights, gradients, AdamW state, activations; the first step creates the state). Time: the
median of ``--repeats`` steps after one warm-up. Writes docs/benchmarks/lora_train.{md,json}.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
import train_step
from _common import described, git_commit, write_results
from train_step import SIZES, Tok, model_of

from rayhf.algorithms.lm import response_forward
from rayhf.algorithms.sft import sft_loss
from rayhf.data.batch import PackedBatch
from rayhf.engines.build import standalone_engine
from rayhf.engines.call import CallEngine
from rayhf.engines.torch_trainer import OptimizerConfig, TorchTrainer
from rayhf.models.hf import model_files
from rayhf.models.lora import LoraConfig, lora_of
from rayhf.models.sharding import param_shards

SIZE = SIZES["qwen2-0.5B"]
PROMPT, RESPONSE = 32, 224


def batch_of(tokens: int, vocab: int) -> PackedBatch:
    """Rows of ``PROMPT + RESPONSE`` tokens, as many as ``tokens`` holds (at least one)."""
    rows = max(1, tokens // (PROMPT + RESPONSE))
    return train_step.batch_of(
        {"rows": rows, "prompt": PROMPT, "response": RESPONSE, "vocab": vocab}
    )


def engine_of(rank: int) -> CallEngine:
    hf = model_of(SIZE)
    spec = model_files(hf.config, False).spec
    lora = lora_of(LoraConfig(rank=rank), spec, "lora") if rank else None
    opt = OptimizerConfig(lr=1e-5)
    return standalone_engine(hf, Tok(), False, opt, lora=lora, checkpointing=True)


class _NoHook:
    def remove(self) -> None:
        pass


def measure(rank: int, tokens: int, repeats: int) -> dict[str, Any]:
    from torch.distributed._tools.mem_tracker import MemTracker

    engine = engine_of(rank)
    assert isinstance(engine.trainer, TorchTrainer)
    batch = batch_of(tokens, SIZE["vocab"])

    def loss_fn(mb: PackedBatch) -> tuple[torch.Tensor, dict[str, float]]:
        logp, _, mask = response_forward(engine, mb)
        return sft_loss(logp, mask)

    def step() -> None:
        engine.train([batch], loss_fn)

    step()  # AdamW's state exists from here on
    tracker = MemTracker()
    # MemTracker hooks the gradient of every parameter, and a frozen one has none to hook: mark
    # those as hooked already (torch 2.13 raises otherwise)
    for p in engine.model.module.parameters():
        if not p.requires_grad:
            tracker._param_to_grad_hook_handles[p] = (_NoHook(), _NoHook())
    tracker.track_external(engine.model.module, engine.trainer.optimizer)
    with tracker:
        step()
    peak = int(tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"])
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        step()
        times.append(time.perf_counter() - began)
    spec = engine.model.spec
    shards = param_shards(spec)
    return {
        "rank": rank,
        "tokens": batch.n_samples * (PROMPT + RESPONSE),
        "peak_bytes": peak,
        "step_seconds": statistics.median(times),
        "trained": sum(p.numel for p in shards if p.trained),
    }


def report(rows: list[dict], args: str, commit: str) -> str:
    lines = [
        "# A LoRA role's train call against full fine-tuning",
        "",
        f"`python benchmarks/lora_train.py{args}` on this machine (2 CPU cores), commit {commit}. "
        + described(__doc__),
        "",
        "| tokens | training | trained parameters | peak memory | vs full | step | vs full |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        full = next(x for x in rows if x["tokens"] == r["tokens"] and x["rank"] == 0)
        name = "full" if r["rank"] == 0 else f"LoRA rank {r['rank']}"
        smaller = f"{full['peak_bytes'] / r['peak_bytes']:.2f}x smaller" if r["rank"] else "-"
        time = f"{r['step_seconds'] / full['step_seconds']:.2f}x" if r["rank"] else "-"
        lines.append(
            f"| {r['tokens']} | {name} | {r['trained']:,} | {r['peak_bytes'] / 2**30:.2f} GiB | "
            f"{smaller} | {r['step_seconds']:.2f} s | {time} |"
        )
    lines += ["", "What a LoRA role's weight moves carry: [lora_moves.md](lora_moves.md)."]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tokens", type=int, nargs="+", default=[256, 1024])
    args = ap.parse_args()
    torch.manual_seed(0)
    rows = []
    for tokens in args.tokens:
        for rank in (0, args.rank):
            rows.append(measure(rank, tokens, args.repeats))
            print(rows[-1], flush=True)
    commit = git_commit()
    text = report(rows, "".join(f" {a}" for a in __import__("sys").argv[1:]), commit)
    print(text)
    write_results("lora_train", text, {"rows": rows}, commit)


if __name__ == "__main__":
    main()
