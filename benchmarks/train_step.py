"""A train call's step against a plain Hugging Face step, and the memory of the log-prob path.

    python benchmarks/train_step.py [--device cpu] [--repeats 5] [--no-write]

Time: one batch (rows of prompt + response tokens) trained one optimizer step two ways, on the
same model and device: rayhf's (``TorchTrainer.train`` of one minibatch, the SFT loss through
``response_forward``: packed rows, the sliced scoring head, foreach gradient norm, AdamW) and
plain Hugging Face (``model(...).logits``, log-softmax of the response positions, backward,
``clip_grad_norm_``, ``torch.optim.AdamW(fused=True)``, as fast as torch's AdamW gets: the
same option rayhf takes). Seconds per
step, median and minimum over ``--repeats`` after two warm-up steps; on CUDA both run bf16
autocast over fp32 weights (SDPA attention for Hugging Face), and the peak memory and MFU are
reported (``train_flops_per_token`` x tokens / time / the GPU's bf16 peak).

Memory: the peak of one forward and backward of a PPO-shaped loss (log-probs and entropy of the
response tokens) on a model with Qwen2.5's 151,936-entry vocabulary and a tiny body, through
the path rayhf had before the sliced head (whole logits ``[rows, tokens, vocab]``, gathered to
the response positions, log-softmax and entropy in fp32) and through ``RankModel.score``.
On CPU torch's ``MemTracker`` counts the tensors; on CUDA ``max_memory_allocated``.

Writes docs/benchmarks/train_step{_cuda}.{md,json}.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
from _common import write_results

from rayhf.algorithms.lm import entropy_from_logits, response_forward, token_logprobs
from rayhf.algorithms.seqs import gather_positions, padded_inputs, response_index
from rayhf.algorithms.sft import sft_loss
from rayhf.data.batch import PackedBatch
from rayhf.engines.build import standalone_engine
from rayhf.engines.torch_trainer import OptimizerConfig
from rayhf.models.hf import ModelInit, build_model, hf_config, n_params

PAD, BOS, EOS = 0, 1, 2
SIZES: dict[str, dict[str, Any]] = {  # name -> (model, rows, prompt, response tokens)
    "llama-20M": {"init": {"hidden_size": 256, "n_layers": 4, "n_heads": 8, "n_kv_heads": 4},
                  "vocab": 32000, "rows": 4, "prompt": 64, "response": 64},
    "llama-45M": {"init": {"hidden_size": 512, "n_layers": 4, "n_heads": 8, "n_kv_heads": 4},
                  "vocab": 32000, "rows": 4, "prompt": 64, "response": 64},
    "qwen2-0.5B": {"init": {"family": "qwen2", "hidden_size": 896, "n_layers": 24,
                            "n_heads": 14, "n_kv_heads": 2, "intermediate_size": 4864,
                            "tied": True, "max_positions": 1024},
                   "vocab": 151936, "rows": 16, "prompt": 24, "response": 256},
}  # fmt: skip
GPU_SIZES = ["qwen2-0.5B"]
CPU_SIZES = ["llama-20M", "llama-45M"]
MEMORY = {"init": {"hidden_size": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2},
          "vocab": 151936, "rows": 8, "prompt": 32, "response": 128}  # fmt: skip
BF16_PEAK = {"H100": 989e12, "H200": 989e12, "A100": 312e12}


def matmul_params(model: torch.nn.Module) -> int:
    """Parameters a token multiplies by: the 2-D weights except the embedding lookup, plus the
    LM head when it is the tied embedding."""
    named = model.named_parameters()
    n = sum(p.numel() for name, p in named if p.dim() == 2 and "embed" not in name)
    config = model.config
    if getattr(config, "tie_word_embeddings", False) and hasattr(model, "lm_head"):
        n += config.vocab_size * config.hidden_size
    return n


def train_flops_per_token(model: torch.nn.Module, seq_len: float) -> float:
    """Forward and backward: 6 x matmul parameters, plus 12 x layers x width x sequence for the
    attention scores and their weighted sums."""
    c = model.config
    return 6 * matmul_params(model) + 12 * c.num_hidden_layers * c.hidden_size * seq_len


class Tok:
    pad_token_id, eos_token_id = PAD, EOS


def model_of(size: dict[str, Any], seed: int = 0):
    init = ModelInit(**{"family": "llama", **size["init"]})
    model = build_model(hf_config(init, size["vocab"], PAD, BOS, EOS), False, seed=seed)
    model.config._attn_implementation = "sdpa"  # Hugging Face's default on GPUs
    return model


def batch_of(size: dict[str, Any]) -> PackedBatch:
    g = torch.Generator().manual_seed(0)
    rows, p, r = size["rows"], size["prompt"], size["response"]
    seqs = torch.randint(3, size["vocab"], (rows, p + r), generator=g)
    batch = PackedBatch(list(range(rows)))
    batch.add("seq", seqs.reshape(-1), [p + r] * rows)
    batch.add("prompt_lens", torch.full((rows,), p), [1] * rows)
    return batch


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _timed(step, device: str, repeats: int) -> list[float]:
    for _ in range(2):
        step()
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - start)
    return times


def rayhf_step(size: dict[str, Any], device: str, precision: str):
    engine = standalone_engine(
        model_of(size), Tok(), False, OptimizerConfig(lr=1e-5), device=device, precision=precision
    )
    batch = batch_of(size)

    def loss_fn(mb: PackedBatch):
        logp, _, mask = response_forward(engine, mb)
        return sft_loss(logp, mask)

    return lambda: engine.train([batch], loss_fn)


def hf_step(size: dict[str, Any], device: str, precision: str):
    model = model_of(size).to(device).train()
    opt = torch.optim.AdamW(
        model.parameters(), lr=1e-5, betas=(0.9, 0.95), weight_decay=0.0, fused=True
    )
    batch = batch_of(size)
    ids, attn = (t.to(device) for t in padded_inputs(batch, PAD))
    positions, mask = (t.to(device) for t in response_index(batch))
    labels = ids.gather(1, positions + 1)
    low = torch.bfloat16 if precision == "bf16" else None

    def step() -> None:
        with torch.autocast(torch.device(device).type, dtype=low, enabled=low is not None):
            logits = model(input_ids=ids, attention_mask=attn).logits
        logp = token_logprobs(gather_positions(logits, positions), labels)
        loss = -(logp * mask).sum() / mask.sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=False)

    return step


def _measured(step, device: str, repeats: int) -> tuple[list[float], int]:
    """``_timed``, and on CUDA the peak bytes allocated meanwhile (0 on CPU)."""
    if not device.startswith("cuda"):
        return _timed(step, device, repeats), 0
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    times = _timed(step, device, repeats)
    return times, int(torch.cuda.max_memory_allocated())


def time_sizes(device: str, names: list[str], repeats: int) -> list[dict[str, Any]]:
    precision = "bf16" if device.startswith("cuda") else "fp32"
    peak = next((v for k, v in BF16_PEAK.items() if k in _device_name(device)), None)
    rows = []
    for name in names:
        size = SIZES[name]
        ours, ours_peak = _measured(rayhf_step(size, device, precision), device, repeats)
        plain, plain_peak = _measured(hf_step(size, device, precision), device, repeats)
        model = model_of(size)
        tokens = size["rows"] * (size["prompt"] + size["response"])
        seq = size["prompt"] + size["response"]
        flops = train_flops_per_token(model, seq) * tokens
        row = {
            "size": name,
            "params": n_params(model),
            "rows": size["rows"],
            "tokens": tokens,
            "precision": precision,
            "rayhf_s": statistics.median(ours),
            "rayhf_min_s": min(ours),
            "hf_s": statistics.median(plain),
            "hf_min_s": min(plain),
        }
        row["ratio"] = row["rayhf_s"] / row["hf_s"]
        if device.startswith("cuda"):
            row["rayhf_peak_mib"], row["hf_peak_mib"] = ours_peak / 2**20, plain_peak / 2**20
        if peak is not None:
            row["rayhf_mfu"] = flops / row["rayhf_s"] / peak
            row["hf_mfu"] = flops / row["hf_s"] / peak
        rows.append(row)
        print(row, flush=True)
    return rows


def _device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(device)
    return "CPU"


def logprob_path_peak(device: str, sliced: bool) -> int:
    """Peak bytes of one forward + backward of a PPO-shaped loss through one of the paths."""
    engine = standalone_engine(model_of(MEMORY), Tok(), False, OptimizerConfig(), device=device)
    engine.model.module.train(True)
    batch = batch_of(MEMORY)

    def run() -> None:
        if sliced:
            logp, entropy, mask = response_forward(engine, batch)
        else:  # the path before the sliced head: whole logits, then fp32 over the response
            ids, attn = padded_inputs(batch, PAD)
            positions, mask = response_index(batch)
            logits = gather_positions(engine.forward(ids, attn), positions.to(device))
            labels = ids.to(device).gather(1, positions.to(device) + 1)
            logp, entropy = token_logprobs(logits, labels), entropy_from_logits(logits)
        m = mask.to(logp.device)
        loss = -(logp * m).sum() / m.sum() - 0.01 * (entropy * m).sum() / m.sum()
        loss.backward()

    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        run()
        return int(torch.cuda.max_memory_allocated())
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    with tracker:
        run()
    return int(tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"])


def memory(device: str) -> dict[str, Any]:
    before, after = logprob_path_peak(device, False), logprob_path_peak(device, True)
    tokens = MEMORY["rows"] * (MEMORY["prompt"] + MEMORY["response"])
    return {
        "vocab": MEMORY["vocab"],
        "tokens": tokens,
        "whole_logits_bytes": tokens * MEMORY["vocab"] * 4,
        "before_peak": before,
        "after_peak": after,
        "ratio": before / after,
    }


def memory_lines(mem: dict[str, Any]) -> list[str]:
    """The memory part of the page (``benchmarks/gpu.py`` prints it too)."""
    mib = 2**20
    return [
        "## Memory of the log-prob path",
        "",
        f"Forward and backward of a PPO-shaped loss, {mem['tokens']} tokens (half of them",
        f"response), a {mem['vocab']:,}-entry vocabulary on a tiny body (whole fp32 logits:",
        f"{mem['whole_logits_bytes'] / mib:.0f} MiB).",
        "",
        "| path | peak MiB |",
        "| --- | ---: |",
        f"| whole logits, then fp32 log-softmax and entropy | {mem['before_peak'] / mib:.0f} |",
        f"| sliced scoring head (`RankModel.score`) | {mem['after_peak'] / mib:.0f} |",
        "",
        f"{mem['ratio']:.1f}x smaller.",
    ]


def report(device: str, rows: list[dict[str, Any]], mem: dict[str, Any]) -> str:
    lines = [
        f"# Train step: rayhf against plain Hugging Face ({_device_name(device)})",
        "",
        f"`python benchmarks/train_step.py --device {device}`: one optimizer step on the same",
        "batch, median (min) seconds over the repeats; see the script's docstring.",
        "",
        "| model | params | tokens | precision | rayhf s | HF s | rayhf / HF |"
        + (" rayhf MFU | HF MFU |" if rows and "rayhf_mfu" in rows[0] else ""),
        "| --- | ---: | ---: | --- | ---: | ---: | ---: |"
        + (" ---: | ---: |" if rows and "rayhf_mfu" in rows[0] else ""),
    ]
    for r in rows:
        line = (
            f"| {r['size']} | {r['params'] / 1e6:.1f}M | {r['tokens']} | {r['precision']} "
            f"| {r['rayhf_s']:.3f} ({r['rayhf_min_s']:.3f}) | {r['hf_s']:.3f} "
            f"({r['hf_min_s']:.3f}) | {r['ratio']:.2f}x |"
        )
        if "rayhf_mfu" in r:
            line += f" {r['rayhf_mfu']:.1%} | {r['hf_mfu']:.1%} |"
        lines.append(line)
    lines += ["", *memory_lines(mem)]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--sizes", nargs="+", choices=list(SIZES))
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    cuda = args.device.startswith("cuda")
    names = args.sizes or (GPU_SIZES if cuda else CPU_SIZES)
    mem = memory(args.device)
    print(mem, flush=True)
    rows = time_sizes(args.device, names, args.repeats)
    text = report(args.device, rows, mem)
    print(text)
    if not args.no_write:
        data = {"device": _device_name(args.device), "rows": rows, "memory": mem}
        write_results("train_step_cuda" if cuda else "train_step", text, data)


if __name__ == "__main__":
    main()
