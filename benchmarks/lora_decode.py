"""The native decode step with LoRA adapters unmerged, against the same model merged.

    python benchmarks/lora_decode.py [--rank 16] [--reps 5]

A Qwen2-0.5B-shaped model (896 wide, 24 layers, Qwen2.5's vocabulary; random weights) on one CPU
rank, one torch thread, fp32. Greedy decoding of 8 prompts of 16 tokens, 32 new tokens each, by
the native generator (``CallEngine.generate``, uncompiled): with rank-``--rank`` adapters on every
linear layer of the decoder layers applied unmerged, as rayhf decodes (B drawn at random, so the
adapters change the tokens), and with the base model alone, which is what decoding with the
adapters merged into the weights runs. Merging in place also pays, at each weight update, the
merge (one ``[out, r] x [r, in]`` product added to each adapted weight:
``rayhf.models.lora.merged``) and, before the next train call or a reference call on the base
weights, the same again to unmerge; its seconds are measured too. Medians of ``--reps`` rounds.
Writes docs/benchmarks/lora_decode.{md,json}.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch
from _common import described, git_commit, median_seconds, write_results
from train_step import SIZES, Tok, model_of

from rayhf.engines.build import standalone_engine
from rayhf.models.hf import model_files
from rayhf.models.lora import LoraConfig, lora_of, merged
from rayhf.sampling import GenerationConfig

SIZE = SIZES["qwen2-0.5B"]
ROWS, PROMPT, NEW = 8, 16, 32


def measure(rank: int, reps: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    hf = model_of(SIZE)
    spec = model_files(hf.config, False).spec
    lora = lora_of(LoraConfig(rank=rank, alpha=2.0 * rank), spec, "lora")
    base = standalone_engine(hf, Tok(), False, None)
    adapted = standalone_engine(hf, Tok(), False, None, lora=lora)
    assert adapted.model is not None
    module = adapted.model.module
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for pair in module.adapters.values():
            b = module.param(pair.b.name)
            b.copy_(torch.randn(b.shape, generator=gen) * 0.01)
    vocab = hf.config.vocab_size
    prompts = torch.randint(3, vocab, (ROWS, PROMPT), generator=gen).tolist()
    greedy = GenerationConfig(max_new_tokens=NEW, min_new_tokens=NEW, greedy=True)
    seconds = median_seconds(
        {
            "merged": lambda: base.generate(prompts, greedy, 0),
            "unmerged": lambda: adapted.generate(prompts, greedy, 0),
        },
        reps,
    )
    state = {n: module.param(n).detach() for n in module.shards}
    merge = median_seconds({"merge": lambda: merged(state, lora)}, reps)["merge"]
    tokens = ROWS * NEW
    return {
        "rank": rank,
        "adapted_weights": len(module.adapters),
        "seconds": seconds,
        "tokens_per_s": {k: tokens / s for k, s in seconds.items()},
        "merge_s": merge,
    }


def report(res: dict, args: str, commit: str) -> str:
    tps, s = res["tokens_per_s"], res["seconds"]
    ratio = tps["unmerged"] / tps["merged"]
    merge = res["merge_s"]
    return "\n".join(
        [
            "# LoRA in the decode step: adapters unmerged against merged weights",
            "",
            f"`python benchmarks/lora_decode.py{args}` on this machine (2 CPU cores), commit "
            f"{commit}. " + described(__doc__),
            "",
            "| decoding | seconds | tokens/s |",
            "| --- | ---: | ---: |",
            f"| rank {res['rank']} adapters, unmerged ({res['adapted_weights']} adapted weights) "
            f"| {s['unmerged']:.2f} | {tps['unmerged']:.1f} |",
            f"| the weights alone (as merged) | {s['merged']:.2f} | {tps['merged']:.1f} |",
            "",
            f"Unmerged adapters decode at {ratio:.2f}x the merged weights' tokens/s. Merging "
            f"every adapter into its weight takes {merge:.2f} s, and unmerging as long: "
            f"{2 * merge:.2f} s a weight update, against {s['unmerged'] - s['merged']:.2f} s "
            f"that the adapters add to this decode of {ROWS * NEW} tokens.",
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
