"""Policy-server latency and throughput over HTTP at a few concurrency levels.

    python benchmarks/serve_latency.py [--requests 64] [--concurrency 1,4,16] [--max-tokens 16]
                                       [--batch-wait-s 0.05]

Serves a random ~1M-parameter Llama (the ``ppo_step`` benchmark's shape, demo char tokenizer,
the LM head's EOS row zeroed so that greedy responses are ``max_tokens`` long)
with ``rayhf.serve.app:build_app`` on 127.0.0.1 (one replica, 1 CPU, Ray with 2 CPUs), then
for each concurrency C sends N greedy completions from C client threads (demo-task prompts,
``max_tokens`` new tokens; each level stops early after ``--time-limit`` seconds). Reports
requests/s, p50/p99 latency, generated tokens/s and the mean batch the server formed
(``/v1/stats``). Writes docs/benchmarks/serve_latency.{md,json}.
"""

from __future__ import annotations

import argparse
import platform
import socket
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import requests
import torch
from _common import write_results

from rayhf.models.files import quiet_transformers
from rayhf.models.hf import (
    ModelInit,
    build_model,
    hf_config,
    n_params,
    save_model,
)
from rayhf.tasks.demo import build_tokenizer, make_prompts

MODEL = ModelInit(family="llama", hidden_size=128, n_layers=5, n_heads=4, n_kv_heads=2)
MAX_BATCH_SIZE = 16


def make_checkpoint(out: Path) -> tuple[Path, int]:
    quiet_transformers()
    tok = build_tokenizer()
    cfg = hf_config(MODEL, len(tok), tok.pad_token_id, tok.bos_token_id, tok.eos_token_id)
    model = build_model(cfg, value_head=False, seed=0)
    with torch.no_grad():  # EOS logit 0: greedy responses run to max_tokens (else ~3 tokens)
        model.get_output_embeddings().weight[tok.eos_token_id] = 0.0
    return save_model(model, out, tok), n_params(model)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_request(url: str, prompt: str, max_tokens: int) -> tuple[float, int]:
    """Latency in seconds and generated tokens of one greedy completion."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    start = time.perf_counter()
    resp = requests.post(f"{url}/v1/completions", json=body, timeout=120)
    elapsed = time.perf_counter() - start
    resp.raise_for_status()
    return elapsed, resp.json()["usage"]["completion_tokens"]


def run_level(
    url: str, concurrency: int, n: int, max_tokens: int, time_limit: float
) -> dict[str, Any]:
    """``n`` requests from ``concurrency`` threads; requests not started by the deadline are
    skipped."""
    prompts = [r["prompt"] for r in make_prompts(n, seed=concurrency)]
    deadline = time.perf_counter() + time_limit
    stats_before = requests.get(f"{url}/v1/stats", timeout=30).json()

    def task(prompt: str) -> tuple[float, int] | None:
        if time.perf_counter() > deadline:
            return None
        return one_request(url, prompt, max_tokens)

    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = [r for r in pool.map(task, prompts) if r is not None]
    wall = time.perf_counter() - start
    stats_after = requests.get(f"{url}/v1/stats", timeout=30).json()
    latencies = np.array([r[0] for r in results])
    batches = stats_after["batches"] - stats_before["batches"]
    return {
        "concurrency": concurrency,
        "requests": len(results),
        "seconds": wall,
        "requests_per_s": len(results) / wall,
        "p50_ms": float(np.percentile(latencies, 50) * 1000),
        "p99_ms": float(np.percentile(latencies, 99) * 1000),
        "generated_tokens_per_s": sum(r[1] for r in results) / wall,
        "mean_batch": (stats_after["requests"] - stats_before["requests"]) / max(batches, 1),
        "batch_sizes": batch_size_counts(stats_before, stats_after),
    }


def batch_size_counts(before: dict[str, Any], after: dict[str, Any]) -> dict[int, int]:
    """Batches of each size formed between two ``/v1/stats`` snapshots."""
    old = {int(k): v for k, v in before["batch_sizes"].items()}
    new = {int(k): v for k, v in after["batch_sizes"].items()}
    return {k: v - old.get(k, 0) for k, v in sorted(new.items()) if v > old.get(k, 0)}


def bench(
    n: int, levels: list[int], max_tokens: int, time_limit: float, batch_wait_s: float
) -> dict[str, Any]:
    import ray
    from ray import serve

    from rayhf.serve.app import build_app

    with tempfile.TemporaryDirectory() as tmp:
        ckpt, size = make_checkpoint(Path(tmp) / "policy")
        ray.init(num_cpus=2, include_dashboard=False, configure_logging=False, log_to_driver=False)
        try:
            port = free_port()
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            args = {
                "checkpoint": str(ckpt),
                "max_batch_size": MAX_BATCH_SIZE,
                "batch_wait_timeout_s": batch_wait_s,
            }
            serve.run(build_app(args), name="policy", route_prefix="/")
            url = f"http://127.0.0.1:{port}"
            for _ in range(3):  # warm-up: first forward passes, proxy connections
                one_request(url, "1 2 3 =", max_tokens)
            rows = [run_level(url, c, n, max_tokens, time_limit) for c in levels]
        finally:
            serve.shutdown()
            ray.shutdown()
    return {
        "params": size,
        "max_tokens": max_tokens,
        "max_batch_size": MAX_BATCH_SIZE,
        "batch_wait_timeout_s": batch_wait_s,
        "cpu": platform.processor() or platform.machine(),
        "levels": rows,
    }


def report(res: dict[str, Any]) -> str:
    lines = [
        f"# Policy server latency ({res['params'] / 1e6:.2f}M-parameter Llama, CPU)",
        "",
        "Command: `python benchmarks/serve_latency.py`; greedy `/v1/completions` over HTTP on "
        f"127.0.0.1, {res['max_tokens']} new tokens per request (random weights, EOS "
        f"logit zeroed); one replica with 1 CPU, max_batch_size {res['max_batch_size']}, "
        f"batch_wait_timeout_s {res['batch_wait_timeout_s']}; Ray with "
        "2 CPUs on a 2-core machine shared with the client threads.",
        "",
        "| concurrency | requests | requests/s | p50 ms | p99 ms | generated tokens/s "
        "| mean batch |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in res["levels"]:
        lines.append(
            f"| {r['concurrency']} | {r['requests']} | {r['requests_per_s']:.1f} "
            f"| {r['p50_ms']:.0f} | {r['p99_ms']:.0f} | {r['generated_tokens_per_s']:.0f} "
            f"| {r['mean_batch']:.1f} |"
        )
    lines += [
        "",
        "Mean batch: prompts per engine call, from the replica's `/v1/stats`. Streaming replays "
        "a finished generation, so its time to first token equals the latency above.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64, help="per concurrency level")
    parser.add_argument("--concurrency", default="1,4,16", help="comma-separated levels")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--batch-wait-s", type=float, default=0.05, help="server batch wait")
    parser.add_argument("--time-limit", type=float, default=60.0, help="seconds per level")
    args = parser.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    res = bench(args.requests, levels, args.max_tokens, args.time_limit, args.batch_wait_s)
    text = report(res)
    print(text)
    write_results("serve_latency", text, res)


if __name__ == "__main__":
    main()
