"""The native decode step with LoRA adapters merged into its lent weights, unmerged, and without.

    python benchmarks/lora_decode.py [--rank 16] [--reps 5]

A Qwen2-0.5B-shaped model (896 wide, 24 layers, Qwen2.5's vocabulary; random weights) on one CPU
rank, one torch thread, fp32. Greedy decoding of 8 prompts of 16 tokens, 32 new tokens each, by
the native generator (``NativeGenerator.generate``, uncompiled) with rank-``--rank`` adapters on
every linear layer of the decoder layers (B drawn at random, so the adapters change the tokens):
merged into the copies of the weights the decode step is lent (``engines.<call>.merge_adapters``,
the default), unmerged (each adapted matmul adds the adapter's two products at every token),
and the base model alone. The lent copies are made again after each weight update (oneDNN-packed
on CPUs whether or not the adapters are merged in): ``lend`` is that, with and without the
merge. Medians of ``--reps`` rounds. Writes docs/benchmarks/lora_decode.{md,json}.
"""

from __future__ import annotations

import argparse
import functools
import sys
from typing import Any

import torch
from _common import described, git_commit, median_seconds, write_results
from train_step import SIZES, Tok, model_of

from rayhf.engines.config import NativeEngineConfig
from rayhf.engines.native import NativeGenerator
from rayhf.engines.rank_model import RankModel
from rayhf.models.hf import model_files
from rayhf.models.lora import LoraConfig, lora_of
from rayhf.sampling import GenerationConfig

SIZE = SIZES["qwen2-0.5B"]
ROWS, PROMPT, NEW = 8, 16, 32


def measure(rank: int, reps: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    hf = model_of(SIZE)
    spec = model_files(hf.config, False).spec
    lora = lora_of(LoraConfig(rank=rank, alpha=2.0 * rank), spec, "lora")
    base = RankModel.from_hf(hf, Tok(), False)
    model = RankModel.from_hf(hf, Tok(), False, lora)
    module = model.module
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for pair in module.adapters.values():
            b = module.param(pair.b.name)
            b.copy_(torch.randn(b.shape, generator=gen) * 0.01)
    gens = {
        "merged": NativeGenerator(model),
        "unmerged": NativeGenerator(model, NativeEngineConfig(merge_adapters=False)),
        "base": NativeGenerator(base),
    }
    vocab = hf.config.vocab_size
    prompts = torch.randint(3, vocab, (ROWS, PROMPT), generator=gen).tolist()
    greedy = GenerationConfig(max_new_tokens=NEW, min_new_tokens=NEW, greedy=True)
    tokens = {k: g.generate(prompts, greedy, 0).tokens for k, g in gens.items()}
    assert tokens["merged"] == tokens["unmerged"] != tokens["base"]
    seconds = median_seconds(
        {k: functools.partial(g.generate, prompts, greedy, 0) for k, g in gens.items()}, reps
    )

    def lend(g: NativeGenerator) -> None:  # after a weight update
        module.version += 1
        g.engine.lend_weights()

    lend_s = median_seconds(
        {k: functools.partial(lend, gens[k]) for k in ("merged", "unmerged")}, reps
    )
    n = ROWS * NEW
    return {
        "rank": rank,
        "adapted_weights": len(module.adapters),
        "seconds": seconds,
        "tokens_per_s": {k: n / s for k, s in seconds.items()},
        "lend_s": lend_s,
    }


def report(res: dict, args: str, commit: str) -> str:
    tps, s, lend = res["tokens_per_s"], res["seconds"], res["lend_s"]
    merge = lend["merged"] - lend["unmerged"]
    saved = s["unmerged"] - s["merged"]
    return "\n".join(
        [
            "# LoRA in the decode step: adapters merged into the lent weights, unmerged, none",
            "",
            f"`python benchmarks/lora_decode.py{args}` on this machine (2 CPU cores), commit "
            f"{commit}. " + described(__doc__),
            "",
            "| decoding | seconds | tokens/s | lending after a weight update, s |",
            "| --- | ---: | ---: | ---: |",
            f"| rank {res['rank']} adapters merged into the lent weights (the default) "
            f"| {s['merged']:.2f} | {tps['merged']:.1f} | {lend['merged']:.2f} |",
            f"| the same adapters unmerged ({res['adapted_weights']} adapted weights) "
            f"| {s['unmerged']:.2f} | {tps['unmerged']:.1f} | {lend['unmerged']:.2f} |",
            f"| the base weights alone | {s['base']:.2f} | {tps['base']:.1f} | |",
            "",
            f"Merged, the adapters decode at {tps['merged'] / tps['unmerged']:.2f}x the unmerged "
            f"tokens/s ({tps['merged'] / tps['base']:.2f}x the base weights'). The merge adds "
            f"{merge:.2f} s to lending the weights after an update, and saves {saved:.2f} s in "
            f"this decode of {ROWS * NEW} tokens ({ROWS} rows a step): it pays from about "
            f"{max(merge, 0.0) / saved * NEW:.0f} steps of {ROWS} rows a weight update.",
            "",
        ]
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    commit = git_commit()
    res = measure(args.rank, args.reps)
    text = report(res, "".join(f" {a}" for a in sys.argv[1:]), commit)
    print(text)
    write_results("lora_decode", text, res, commit)


if __name__ == "__main__":
    main()
