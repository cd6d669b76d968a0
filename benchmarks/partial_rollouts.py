"""Would partial rollouts pay here? How much generation runs after a newer policy exists.

    python benchmarks/partial_rollouts.py [--steps 30]

A partial rollout lets a generation that a weight update interrupts go on with the new weights.
With ``max_staleness: 1`` the generate call of step i+1 runs while step i trains; step i's
update makes a version newer than the one that generate call samples with. This runs PPO and
GRPO on the demo task and GRPO on the GSM8K-format task (as ``async_rl.py`` does: the disjoint
plan, 2 emulated CPU devices, k=1), reads each run's trace and reports, over the steps after
warm-up, the share of each generate call's time after the actor's train call of the step
before it ended: the share of tokens a partial rollout could have sampled with newer weights.
Writes docs/benchmarks/partial_rollouts.{md,json}.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import async_rl
from _common import git_commit, write_results

from rayhf.metrics.trace import read_trace

K = 1  # the staleness measured
CASES = ("ppo", "grpo", "gsm8k")


def calls(events: list[dict], name: str) -> dict[int, tuple[float, float]]:
    """Step -> (start, end) in ms of the train-phase spans of call ``name``."""
    return {
        e["args"]["step"]: (e["ts"] / 1e3, (e["ts"] + e["dur"]) / 1e3)
        for e in events
        if e.get("cat") == "call" and e["name"] == name and e["args"].get("phase") == "train"
    }


def in_flight(events: list[dict], k: int, warmup: int) -> dict:
    """For each step i after ``warmup``: the share of the generate call of step i+k (the one
    running while step i trains) after step i's train call ended; and the times around it."""
    gen, train = calls(events, "actor_gen"), calls(events, "actor_train")
    shares, idle = [], []
    for i in sorted(train):
        if i <= warmup or i + k not in gen:
            continue
        (g0, g1), newer = gen[i + k], train[i][1]
        shares.append(min(1.0, max(0.0, (g1 - newer) / (g1 - g0))))
        if i + k + 1 in gen:
            idle.append(gen[i + k + 1][0] - g1)
    return {
        "periods": len(shares),
        "share": statistics.fmean(shares) if shares else 0.0,
        "periods_with_any": sum(s > 0 for s in shares),
        "generate_ms": statistics.median(b - a for a, b in gen.values()),
        "train_ms": statistics.median(b - a for a, b in train.values()),
        "generator_idle_ms": statistics.median(idle) if idle else 0.0,
    }


def bench(steps: int) -> dict:
    out: dict = {"steps": steps, "k": K, "warmup": async_rl.WARMUP, "cases": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for algo in CASES:
            async_rl.one_run(tmp, algo, "disjoint", K, steps, seed=1)
            trace = Path(tmp) / f"{algo}_disjoint_k{K}_s1" / "trace.json"
            out["cases"][algo] = in_flight(read_trace(trace), K, async_rl.WARMUP)
    return out


def report(res: dict, commit: str, command: str) -> str:
    lines = [
        "# Partial rollouts: generation after a newer policy exists (measured)",
        "",
        f"max_staleness {res['k']}, the disjoint plan of `async_rl.py` (the actor generates on "
        "device 0, trains on device 1), 2 emulated CPU devices, seed 1, "
        f"{res['steps']} steps, the steps after {res['warmup']}. Share: of each generate call's "
        "time, the part after the actor's train call of the step before it ended (what a "
        f"partial rollout could sample with the newer weights). Command: `{command}`; commit "
        f"{commit}.",
        "",
        "| task | periods | share of generation after a newer version | periods with any | "
        "generate ms | actor train ms | generator idle between generations ms |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    names = {"ppo": "PPO, demo", "grpo": "GRPO, demo", "gsm8k": "GRPO, GSM8K-format"}
    for algo, c in res["cases"].items():
        lines.append(
            f"| {names[algo]} | {c['periods']} | {c['share']:.3f} | {c['periods_with_any']} | "
            f"{c['generate_ms']:.0f} | {c['train_ms']:.0f} | {c['generator_idle_ms']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    commit = git_commit()
    res = bench(args.steps)
    command = "python benchmarks/partial_rollouts.py" + (
        f" --steps {args.steps}" if args.steps != ap.get_default("steps") else ""
    )
    text = report(res, commit, command)
    print(text)
    write_results("partial_rollouts", text, res, commit)


if __name__ == "__main__":
    main()
