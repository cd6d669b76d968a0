"""PPO step time on a ~1M-parameter Llama and where it goes.

    python benchmarks/ppo_step.py [--steps 8] [--devices 2]

16 prompts x 16 new tokens per step, 4 minibatches. Reports seconds per step, tokens/s, and the
breakdown: each call's compute (slowest rank, measured inside the actor), reallocation, and the
rest (driver, Ray and data movement overhead). Writes docs/benchmarks/ppo_step.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import rayhf
from rayhf.models.hf import n_params

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "docs" / "benchmarks"
MODEL = {"family": "llama", "hidden_size": 128, "n_layers": 5, "n_heads": 4, "n_kv_heads": 2}


def bench(steps: int, devices: int, warmup: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cfg = rayhf.load_config(REPO / "examples" / "ppo_tiny.yaml").with_overrides(
            {
                "run_dir": f"{tmp}/run",
                "dataset.path": f"{tmp}/data.parquet",
                "steps": steps + warmup,
                "batch_size": 16,
                "save_every": 0,
                "generation.max_new_tokens": 16,
                "generation.min_new_tokens": 16,
                "algorithm.n_minibatches": 4,
                "cluster.n_devices": devices,
                "models.actor.init": MODEL,
                "models.critic.init": {**MODEL, "seed": 7},
                "metrics.console": False,
                "metrics.plot": False,
                "metrics.ray_metrics": False,
            }
        )
        result = rayhf.run(cfg)
        from transformers import AutoModelForCausalLM

        size = n_params(AutoModelForCausalLM.from_pretrained(result.run_dir / "init" / "actor"))
    rows = result.metrics[warmup:]
    calls = [k for k in rows[0] if k.startswith("seconds/")]
    mean = {
        k: statistics.mean(r[k] for r in rows)
        for k in [*calls, "step_seconds", "overhead_seconds", "tokens_per_s"]
    }
    return {
        "params": size,
        "devices": devices,
        "steps": len(rows),
        "mean": mean,
        "gen_tokens_per_step": 16 * 16,
        "realloc_seconds_per_step": 0.0,
        "init_realloc_seconds": result.info.get("init_realloc_seconds", 0.0),
    }


def report(res: dict) -> str:
    m = res["mean"]
    step = m["step_seconds"]
    lines = [
        f"# PPO step benchmark ({res['params'] / 1e6:.2f}M-parameter Llama, "
        f"{res['devices']} emulated CPU devices, dp={res['devices']})",
        "",
        "Command: `python benchmarks/ppo_step.py`; 16 prompts x 16 new tokens, 4 minibatches; "
        f"mean of {res['steps']} steps after warm-up.",
        "",
        "| part | seconds | share of step |",
        "| --- | ---: | ---: |",
    ]
    for k, v in m.items():
        if k.startswith("seconds/"):
            lines.append(f"| compute: {k.removeprefix('seconds/')} | {v:.3f} | {v / step:.1%} |")
    lines.append(f"| reallocation | {res['realloc_seconds_per_step']:.3f} | 0.0% |")
    lines.append(
        f"| overhead (driver, Ray, data movement) | {m['overhead_seconds']:.3f} | "
        f"{m['overhead_seconds'] / step:.1%} |"
    )
    lines.append(f"| **step** | **{step:.3f}** | 100% |")
    lines += [
        "",
        f"Tokens/s (prompt + response tokens per step second): {m['tokens_per_s']:.0f}; "
        f"generated tokens/s: {res['gen_tokens_per_step'] / step:.0f}.",
        f"Overhead goal (< 20% of the step): "
        f"{'met' if m['overhead_seconds'] / step < 0.2 else 'NOT met'}.",
        f"One-time reference initialisation by reallocation from the actor: "
        f"{res['init_realloc_seconds']:.3f} s.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--devices", type=int, default=2)
    args = ap.parse_args()
    res = bench(args.steps, args.devices, args.warmup)
    text = report(res)
    print(text)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "ppo_step.md").write_text(text)
    (OUT / "ppo_step.json").write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
