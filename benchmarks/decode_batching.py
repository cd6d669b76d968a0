"""What finished rows cost the native decode engine on CPUs, and what refilling or compacting
them saves.

    python benchmarks/decode_batching.py [--prompts 64] [--new 128] [--reps 3]

A random model of the ``tiny`` shape of ``benchmarks/generation_engines.py`` samples at
temperature 1 with EOS allowed, so responses end at scattered lengths (EOS is one of the
character vocabulary's 25 tokens; a padded vocabulary would almost never sample it).
The same prompts and seed under each setting (the same responses: a response's samples depend
only on its prompt's index and the seed):

- all rows at once, finished rows left in place until the call ends (``compact: false``);
- all rows at once, the live rows moved into a smaller bucket at each look (the default);
- ``max_rows`` a quarter of the prompts: the rest wait and refill rows as they end.

Reports response tokens/s (tokens up to and including EOS) and decode steps (the median of
``--reps`` calls after a warm-up; 2 torch threads). Writes docs/benchmarks/decode_batching.*.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from _common import write_results
from generation_engines import SHAPES, _prompts

from rayhf.engines.rank_model import RankModel
from rayhf.models.hf import ModelInit, build_model, hf_config
from rayhf.models.tokenizer import build_char_tokenizer
from rayhf.parallel.decode import DecodeEngine, DecodeOptions
from rayhf.sampling import DecodeRules, GenerationConfig


def _settings(n: int) -> dict[str, DecodeOptions]:
    return {
        "all at once, finished rows stay": DecodeOptions(compact=False),
        "all at once, compacted (default)": DecodeOptions(),
        f"{n // 4} rows, refilled": DecodeOptions(max_rows=n // 4),
        f"{n // 4} rows, refilled, no compaction": DecodeOptions(max_rows=n // 4, compact=False),
    }


def measure(shape: str, args: argparse.Namespace, tok: Any) -> list[dict[str, Any]]:
    init = ModelInit(**SHAPES[shape])
    config = hf_config(init, len(tok), tok.pad_token_id, tok.bos_token_id, tok.eos_token_id)
    model = RankModel.from_hf(build_model(config, value_head=False, seed=0), tok, False)
    prompts = _prompts(args.prompts, 1)
    rules = DecodeRules.of(GenerationConfig(max_new_tokens=args.new), tok.eos_token_id, 0)
    rows = []
    for name, options in _settings(args.prompts).items():
        engine = DecodeEngine(model.pipe, options)
        engine.generate(prompts, rules, 0)  # warm-up
        times, steps = [], []
        for _ in range(args.reps):
            before = engine.n_steps
            began = time.perf_counter()
            out = engine.generate(prompts, rules, 0)
            times.append(time.perf_counter() - began)
            steps.append(engine.n_steps - before)
        lengths = [len(t) for t in out.tokens]
        row = {"shape": shape, "setting": name, "seconds": statistics.median(times),
               "steps": statistics.median(steps), "tokens": sum(lengths),
               "mean_length": statistics.mean(lengths), "ended": sum(out.finished)}  # fmt: skip
        row["tokens_per_s"] = row["tokens"] / row["seconds"]
        print(row, flush=True)
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["tiny"], choices=list(SHAPES))
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(2)
    tok = build_char_tokenizer("0123456789abcdefghij", Path(tempfile.mkdtemp()) / "tok")
    rows = [r for shape in args.shapes for r in measure(shape, args, tok)]
    lines = [
        "# Finished rows in the native decode engine (CPU)",
        "",
        f"`python benchmarks/decode_batching.py --shapes {' '.join(args.shapes)} --prompts "
        f"{args.prompts} --new {args.new} "
        f"--reps {args.reps}` on this 2-core machine (2 torch threads): {args.prompts} prompts, "
        f"up to {args.new} tokens each, sampled with EOS allowed; the same responses under "
        "every setting.",
        "",
        "| shape | setting | response tokens (mean length) | decode steps | seconds | tokens/s |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r['shape']} | {r['setting']} | {r['tokens']} ({r['mean_length']:.0f}) | "
            f"{r['steps']:.0f} | {r['seconds']:.2f} | {r['tokens_per_s']:.0f} |"
        )
    write_results("decode_batching", "\n".join(lines) + "\n", {"rows": rows, "args": vars(args)})
    print("\n".join(lines))


if __name__ == "__main__":
    main()
