"""PPO step time on a ~1M-parameter Llama and where it goes.

    python benchmarks/ppo_step.py [--steps 8] [--devices 2]

16 prompts x 16 new tokens per step, 4 minibatches, the plan ``plan: auto`` picks (named in the
report). Reports seconds per step (steps overlapped where the dataflow allows, as rayhf runs
them), tokens/s, and the breakdown: each call's compute (slowest rank, measured inside the actor;
calls on different devices run at the same time, so their shares can add up past 100%), the
reallocations, and the overhead: the share of the measured steps' wall time in which no call or
weight move of the run was running on any actor (driver, Ray, data between calls). Writes
docs/benchmarks/ppo_step.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from _common import git_commit, write_results

import rayhf
from rayhf.metrics.trace import TRACE_FILE, read_trace
from rayhf.models.hf import n_params

REPO = Path(__file__).resolve().parents[1]
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
        plan = json.loads((result.run_dir / "plan.json").read_text())
        spans = [
            (e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6)
            for e in read_trace(result.run_dir / TRACE_FILE)
            if e["pid"] == 0 and e["ph"] == "X" and e["args"]["step"] > warmup
        ]
    rows = result.metrics[warmup:]
    calls = [k for k in rows[0] if k.startswith("seconds/")]
    keys = [*calls, "step_seconds", "tokens_per_s"]
    mean = {k: statistics.mean(r[k] for r in rows) for k in keys}
    wall = sum(r["step_seconds"] for r in rows)  # from the warm-up's end to the last step's
    end = max(e for _, e in spans)
    window = [(max(s, end - wall), e) for s, e in spans if e > end - wall]
    return {
        "params": size,
        "devices": devices,
        "steps": len(rows),
        "plan": plan,
        "mean": mean,
        "gen_tokens_per_step": 16 * 16,
        "realloc_seconds_per_step": statistics.mean(r.get("realloc_seconds", 0.0) for r in rows),
        "idle_share": max(0.0, 1.0 - busy(window) / wall),
        "init_realloc_seconds": result.info.get("init_realloc_seconds", 0.0),
    }


def busy(spans: list[tuple[float, float]]) -> float:
    """Seconds in which at least one of ``spans`` (start, end) was running."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def report(res: dict, commit: str) -> str:
    m = res["mean"]
    step = m["step_seconds"]
    plan = "; ".join(f"{call} {lay['mesh']} dp{lay['dp']}tp{lay['tp']}pp{lay['pp']}"
                     for call, lay in res["plan"].items())  # fmt: skip
    lines = [
        f"# PPO step benchmark ({res['params'] / 1e6:.2f}M-parameter Llama, "
        f"{res['devices']} emulated CPU devices)",
        "",
        "Command: `python benchmarks/ppo_step.py`; 16 prompts x 16 new tokens, 4 minibatches; "
        f"mean of {res['steps']} steps after warm-up; commit {commit}. Plan (`plan: auto`): "
        f"{plan}. Steps overlap where the dataflow allows and calls on "
        "different devices run at the same time, so the call shares can add up past 100%.",
        "",
        "| part | seconds | share of step |",
        "| --- | ---: | ---: |",
    ]
    for k, v in m.items():
        if k.startswith("seconds/"):
            lines.append(f"| compute: {k.removeprefix('seconds/')} | {v:.3f} | {v / step:.1%} |")
    realloc = res["realloc_seconds_per_step"]
    lines.append(f"| reallocation | {realloc:.3f} | {realloc / step:.1%} |")
    idle = res["idle_share"]
    lines.append(
        f"| overhead: no call or move running (driver, Ray, data movement) | {idle * step:.3f} | "
        f"{idle:.1%} |"
    )
    lines.append(f"| **step** | **{step:.3f}** | 100% |")
    lines += [
        "",
        f"Tokens/s (prompt + response tokens per step second): {m['tokens_per_s']:.0f}; "
        f"generated tokens/s: {res['gen_tokens_per_step'] / step:.0f}.",
        f"Overhead goal (< 20% of the step): {'met' if idle < 0.2 else 'NOT met'}.",
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
    res["commit"] = git_commit()
    text = report(res, res["commit"])
    print(text)
    write_results("ppo_step", text, res, res["commit"])


if __name__ == "__main__":
    main()
