"""Asynchronous RL (``algorithm.max_staleness: k``) vs on-policy, measured on this machine.

    python benchmarks/async_rl.py [--steps 200] [--ks 0 1 2] [--algos ppo grpo] [--plans ...]
    python benchmarks/async_rl.py --algos gsm8k --steps 100 --plans disjoint

PPO (examples/ppo_tiny.yaml) and GRPO (examples/grpo_tiny.yaml) on the demo task ("echo the
digits"), or (``gsm8k``) examples/gsm8k_grpo.yaml on GSM8K-format problems from the instruct
model its SFT stage makes first (as examples/gsm8k/run.sh does), 2 emulated CPU devices,
unchanged but for the plan (and no evaluation): "disjoint", the actor generating on
device 0 beside the frozen models (reference, reward), the trained roles (actor, critic)
training on device 1 (with k >= 1 step i+1's generation, reference and reward run while step i
trains); "disjoint-train", the actor generating on device 0 and every other call on device 1;
and "auto", the plan the planner searches for each k (each k on its own best plan).
The same devices, seed and dataset for every k. Reported per (algorithm, plan, k): steps/s and
samples/s over the steps after warm-up, the batches by staleness, the mean and largest
importance weight, the generator/trainer log-prob mismatch, and the reward per sample seen: the
samples each k needs until its 20-step trailing mean reward reaches the one k=0 ends with.
Writes docs/benchmarks/async_rl.{md,json,png} (other algorithms, an --actor-lr or other --seeds: a
suffixed name), with each run's reward per step in the JSON.
"""

from __future__ import annotations

import argparse
import functools
import math
import statistics
import sys
import tempfile
from pathlib import Path

from _common import git_commit, write_results

import rayhf
from rayhf.runtime.train_stage import run_train_stage
from rayhf.tasks.arithmetic import build_tokenizer

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = {"ppo": "ppo_tiny.yaml", "grpo": "grpo_tiny.yaml", "gsm8k": "gsm8k_grpo.yaml"}
CALLS = {
    "ppo": ("actor_gen", "rew_inf", "ref_inf", "critic_inf", "actor_train", "critic_train"),
    "grpo": ("actor_gen", "rew_inf", "ref_inf", "actor_train"),
}
CALLS["gsm8k"] = CALLS["grpo"]
QUIET = {"metrics.console": False, "metrics.plot": False, "metrics.ray_metrics": False}
WINDOW = 20  # steps in the trailing mean of the reward
WARMUP = 3  # steps left out of the speed (actors warming up, the pipeline filling)


PLANS = ["disjoint", "disjoint-train", "auto"]  # --plans
FROZEN = ("ref_inf", "rew_inf")  # the calls of models nobody trains


ACTOR_LR: float | None = None  # --actor-lr: the actor's learning rate instead of the example's
TASKS = (
    "The demo task (examples/ppo_tiny.yaml, examples/grpo_tiny.yaml, unchanged but for the plan)"
)
ARGS = ""  # the command's arguments, as the report names them
PROXIMAL: str | None = None  # algorithm.proximal, instead of the example's (recompute)


@functools.cache
def instruct_model(home: Path) -> Path:
    """The GSM8K example's instruct model, made once in ``home`` by its SFT stage."""
    build_tokenizer(home / "tokenizer")
    sft = rayhf.load_config(REPO / "examples" / "gsm8k" / "sft.yaml").with_overrides(
        {**QUIET, "run_dir": str(home / "sft"), "tokenizer.path": str(home / "tokenizer"),
         "dataset.path": str(home / "sft.parquet")}
    )  # fmt: skip
    made = run_train_stage(sft).policy_checkpoint
    assert made is not None, "the SFT stage wrote no policy checkpoint"
    return made


def task_overrides(tmp: str, algo: str) -> dict:
    """The dataset (and for ``gsm8k`` the instruct model) a run reads."""
    if algo != "gsm8k":
        return {"dataset.path": f"{tmp}/echo.parquet"}
    home = Path(tmp) / "gsm8k"
    return {"models.actor.path": str(instruct_model(home)),
            "dataset.path": str(home / "train.parquet"), "eval_every": 0}  # fmt: skip


def one_run(tmp: str, algo: str, plan_name: str, k: int, steps: int, seed: int) -> list[dict]:
    on_0 = ("actor_gen", *FROZEN) if plan_name == "disjoint" else ("actor_gen",)
    disjoint = {c: {"mesh": [0] if c in on_0 else [1]} for c in CALLS[algo]}
    plan = "auto" if plan_name == "auto" else disjoint
    cfg = rayhf.load_config(REPO / "examples" / EXAMPLES[algo]).with_overrides(
        {
            **QUIET,
            **task_overrides(tmp, algo),
            "run_dir": f"{tmp}/{algo}_{plan_name}_k{k}_s{seed}",
            "seed": seed,
            "steps": steps,
            "save_every": 0,
            "plan": plan,
            "algorithm.max_staleness": k,
            **({"models.actor.optimizer.lr": ACTOR_LR} if ACTOR_LR is not None else {}),
            **({"algorithm.proximal": PROXIMAL} if PROXIMAL is not None else {}),
        }
    )
    return rayhf.run(cfg).metrics


def samples_per_step(algo: str) -> int:
    cfg = rayhf.load_config(REPO / "examples" / EXAMPLES[algo])
    return cfg.batch_size * getattr(cfg.algorithm, "group_size", 1)


def trailing(values: list[float], window: int = WINDOW) -> list[float]:
    return [statistics.fmean(values[max(0, i + 1 - window) : i + 1]) for i in range(len(values))]


def summarize(algo: str, runs: list[list[dict]]) -> dict:
    """One (algorithm, plan, k) over its seeds' runs: speed as the median run's, the reward per
    step as the mean over the runs, the rest pooled."""
    per_step = samples_per_step(algo)
    speeds = []
    for rows in runs:
        timed = [r["step_seconds"] for r in rows if r["step"] > WARMUP]
        speeds.append(len(timed) / sum(timed))
    pooled = [r for rows in runs for r in rows]
    steps = min(len(rows) for rows in runs)
    rewards = [statistics.fmean(rows[i]["task_reward"] for rows in runs) for i in range(steps)]
    staleness = [int(r["async/staleness"]) for r in pooled]
    return {
        "steps_per_s": statistics.median(speeds),
        "samples_per_s": per_step * statistics.median(speeds),
        "samples_per_step": per_step,
        "runs": len(runs),
        "seed_rewards": [[r["task_reward"] for r in rows] for rows in runs],  # per run, per step
        "reward": rewards,
        "trailing_reward": trailing(rewards),
        "staleness": {str(s): staleness.count(s) for s in sorted(set(staleness))},
        "is_weight_mean": statistics.fmean(r.get("is_weight_mean", 1.0) for r in pooled),
        "is_weight_max": max(r.get("is_weight_max", 1.0) for r in pooled),
        "logprob_mismatch": statistics.fmean(r["logprob_mismatch"] for r in pooled),
    }


def samples_to(target: float, case: dict) -> int | None:
    """Samples seen when the trailing mean reward first reaches ``target`` (None: never)."""
    for i, r in enumerate(case["trailing_reward"]):
        if i + 1 >= WINDOW and r >= target:
            return (i + 1) * case["samples_per_step"]
    return None


RISE = (0.25, 0.5, 0.75)  # shares of k=0's rise at which the samples are compared as well


def samples_ratios(case: dict, base: dict) -> list[float | None]:
    """The samples ``case`` needs over those k=0 (``base``) needs to reach each ``RISE`` share of
    the way from k=0's first full-window trailing mean to its final one (None: not reached)."""
    start, end = base["trailing_reward"][WINDOW - 1], base["trailing_reward"][-1]
    out: list[float | None] = []
    for share in RISE:
        level = start + share * (end - start)
        mine, theirs = samples_to(level, case), samples_to(level, base)
        out.append(None if mine is None or not theirs else mine / theirs)
    return out


def final_error(case: dict) -> float:
    """The standard error over seeds of each seed's final trailing mean reward (0: one seed)."""
    finals = [trailing(rewards)[-1] for rewards in case["seed_rewards"]]
    return statistics.stdev(finals) / math.sqrt(len(finals)) if len(finals) > 1 else 0.0


def bench(steps: int, speed_steps: int, ks: list[int], algos: list[str], seeds: list[int]) -> dict:
    """On the disjoint plan every k runs each seed, k=0 for ``steps`` steps and k >= 1 for 20%
    more (so "the same reward within 20% more samples" can be seen); on the other plans (each
    k's own searched plan for "auto"), the first seed for ``speed_steps`` steps (the speed; the
    rewards are the same)."""
    out: dict = {
        "steps": steps, "speed_steps": speed_steps, "warmup": WARMUP, "window": WINDOW,
        "seeds": seeds, "cases": {},
    }  # fmt: skip
    longer = math.ceil(1.2 * steps)
    with tempfile.TemporaryDirectory() as tmp:
        for algo, plan in ((a, p) for p in PLANS for a in algos):
            cases = {}
            for k in ks:
                n, plan_seeds = (steps if k == ks[0] else longer, seeds)
                if plan != "disjoint":
                    n, plan_seeds = speed_steps, seeds[:1]
                runs = [one_run(tmp, algo, plan, k, n, seed) for seed in plan_seeds]
                cases[k] = summarize(algo, runs)
            target = cases[ks[0]]["trailing_reward"][-1]
            for case in cases.values():
                case["target_reward"] = target
                case["samples_to_target"] = samples_to(target, case) if plan == "disjoint" else None
                case["samples_ratios"] = samples_ratios(case, cases[ks[0]])
                case["final_error"] = final_error(case)
                case["speedup"] = case["samples_per_s"] / cases[ks[0]]["samples_per_s"]
            out["cases"][f"{algo}, {plan}"] = {str(k): c for k, c in cases.items()}
    return out


def report(res: dict, commit: str) -> str:
    lines = [
        "# Asynchronous RL: max_staleness k vs on-policy (measured)",
        "",
        f"{TASKS} on 2 emulated CPU devices. Disjoint plan: the actor generates on device 0 "
        "beside the frozen models' calls (reference, reward), which then run ahead with the "
        "generation; the trained models (the actor, and PPO's critic) train on device 1. "
        f"Seeds {res['seeds']}, k=0 for {res['steps']} steps and "
        f"k >= 1 for 20% more; speed: the median seed's, over the steps after {res['warmup']}; "
        f"reward: the mean over seeds, as a {res['window']}-step trailing mean (the final one "
        "+- its standard error over seeds), the samples each k needs to reach the one k=0 ends "
        f"with, and those it needs over k=0's to reach {', '.join(f'{r:.0%}' for r in RISE)} of "
        "the way from k=0's first full-window mean to its final one. "
        + (
            "Disjoint-train: the actor generates on device 0, every other call runs on device 1. "
            if "disjoint-train" in PLANS
            else ""
        )
        + ("Auto: each k on the plan the planner searches for it. " if "auto" in PLANS else "")
        + (
            f"Those: seed {res['seeds'][0]}, {res['speed_steps']} steps, speed only (the "
            "rewards do not depend on the plan). "
            if PLANS != ["disjoint"]
            else ""
        )
        + f"Command: `python benchmarks/async_rl.py{ARGS}`; commit {commit}.",
        "",
        "| algorithm, plan | k | steps/s | samples/s | vs k=0 | batches by staleness | IS "
        "weight mean / max | log-prob mismatch | final reward | samples to k=0's final reward "
        f"| samples vs k=0 at {' / '.join(f'{r:.0%}' for r in RISE)} of its rise |",
        "| --- | ---: | ---: | ---: | ---: | --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for case_name, cases in res["cases"].items():
        base = cases[min(cases, key=int)]["samples_to_target"]
        for k, c in cases.items():
            reached = c["samples_to_target"]
            to = "not reached" if reached is None else f"{reached}"
            if reached is not None and base:
                to += f" ({reached / base:.2f}x k=0)"
            final = f"{c['trailing_reward'][-1]:.3f} +- {c['final_error']:.3f}"
            rise = " / ".join("-" if r is None else f"{r:.2f}x" for r in c["samples_ratios"])
            if not case_name.endswith("disjoint"):
                to = final = rise = "-"
            stale = ", ".join(f"{s}: {n}" for s, n in c["staleness"].items())
            lines.append(
                f"| {case_name} | {k} | {c['steps_per_s']:.2f} | {c['samples_per_s']:.1f} | "
                f"{c['speedup']:.2f}x | {stale} | {c['is_weight_mean']:.3f} / "
                f"{c['is_weight_max']:.2f} | {c['logprob_mismatch']:.2e} | {final} | {to} | "
                f"{rise} |"
            )
    for k in sorted({k for cases in res["cases"].values() for k in cases}, key=int)[1:]:
        gains = [cases[k]["speedup"] for cases in res["cases"].values() if k in cases]
        mean, median = statistics.geometric_mean(gains), statistics.median(gains)
        lines.append(
            f"\nk={k} over k=0 in samples/s: geometric mean {mean:.2f}x, median {median:.2f}x, "
            f"range {min(gains):.2f}-{max(gains):.2f}x."
        )
    for case, cases in res["cases"].items():
        if case.endswith("disjoint") and "1" in cases:
            c = cases["1"]
            met = c["speedup"] >= 1.4
            base = cases["0"]["samples_to_target"]
            reached = c["samples_to_target"]
            learned = reached is not None and base is not None and reached <= 1.2 * base
            lines.append(
                f"\n{case}: k=1 {c['speedup']:.2f}x the samples/s of k=0 (goal 1.4x: "
                f"{'met' if met else 'not met'}); k=0's final reward reached "
                f"{'within' if learned else 'not within'} 20% more samples."
            )
    lines += ["", "![reward per sample seen](async_rl.png)"]
    return "\n".join(lines) + "\n"


def plot(res: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    algos = [c for c in res["cases"] if c.endswith("disjoint")]
    cols = min(2, len(algos))
    rows = (len(algos) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 4 * rows), squeeze=False)
    for ax, algo in zip(axes.flat, algos, strict=False):
        for k, c in res["cases"][algo].items():
            seen = [(i + 1) * c["samples_per_step"] for i in range(len(c["trailing_reward"]))]
            label = f"k={k} ({c['samples_per_s']:.0f} samples/s)"
            ax.plot(seen, c["trailing_reward"], label=label)
        ax.set_title(f"{algo}: reward per sample seen")
        ax.set_xlabel("samples seen")
        ax.set_ylabel(f"task reward ({res['window']}-step trailing mean)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--speed-steps", type=int, default=60)
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--ks", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--algos", nargs="+", default=["ppo", "grpo"], choices=sorted(EXAMPLES))
    ap.add_argument("--plans", nargs="+", default=PLANS, choices=PLANS)
    ap.add_argument("--actor-lr", type=float, default=None, help="instead of the example's")
    ap.add_argument("--proximal", choices=["recompute", "interpolate"], default=None)
    args = ap.parse_args()
    global ACTOR_LR, TASKS, ARGS, PROXIMAL
    ACTOR_LR, PLANS[:], PROXIMAL = args.actor_lr, args.plans, args.proximal
    ARGS = "".join(f" {a}" for a in sys.argv[1:])
    name = "async_rl" if ACTOR_LR is None else f"async_rl_lr{ACTOR_LR:g}"
    if args.algos == ["gsm8k"]:
        name = "async_rl_gsm8k"
        TASKS = (
            "GRPO on GSM8K-format problems (examples/gsm8k_grpo.yaml from the instruct model "
            "its SFT stage makes, unchanged but for the plan and no evaluation)"
        )
    if args.algos not in (ap.get_default("algos"), ["gsm8k"]):  # some of the demo's algorithms
        name += "_" + "_".join(args.algos)
    if args.seeds != ap.get_default("seeds"):  # another seed set: a report of its own
        name += f"_{len(args.seeds)}seeds"
    if PROXIMAL is not None:
        name += f"_{PROXIMAL}"
    commit = git_commit()
    res = bench(args.steps, args.speed_steps, args.ks, args.algos, args.seeds)
    res["commit"] = commit
    text = report(res, commit)
    if ACTOR_LR is not None:
        lr = f"{ACTOR_LR:g}"
        text = text.replace("but for the plan", f"but for the plan and the actor's lr, {lr}")
    if PROXIMAL is not None:
        text = text.replace("but for the plan", f"but for the plan, algorithm.proximal {PROXIMAL}")
    text = text.replace("(async_rl.png)", f"({name}.png)")
    print(text)
    write_results(name, text, res, commit)
    plot(res, REPO / "docs" / "benchmarks" / f"{name}.png")


if __name__ == "__main__":
    main()
