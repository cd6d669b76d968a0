"""Rollout correction with a bf16 generator and trainer that differ, measured on this machine.

    python benchmarks/rollout_correction.py [--steps 120] [--seed 1] [--window 10] [--modes ...]

GRPO on the demo task (examples/grpo_tiny.yaml) with the actor at ``precision: bf16``: its
generate call decodes in bf16 through the native generator's KV-cache path while its train call
forwards the packed sequences under bf16 autocast over fp32 master weights, so the two compute
the same policy with different kernels and accumulation orders and their log-probs differ.
Every mode runs the same seed, steps and dataset: the bypass (the ratio against the generator's
log-probs, no correction), the trainer's recomputed old log-probs without correction, each
correction (``tis``, ``mis``, ``icepop``) at the levels below, and the bypass with the actor in
fp32 as the control. Reported per mode: the step means of the log-prob mismatch and of the
ratio's spread and capped and masked shares, its largest value, the task reward over the first
and the last ``--window`` steps, and seconds per step. Writes
docs/benchmarks/rollout_correction.{md,json}, each run's stats per step in the JSON.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import ray
from _common import git_commit, write_results

import rayhf
from rayhf.runtime.cluster import connect

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "grpo_tiny.yaml"
QUIET = {"metrics.console": False, "metrics.plot": False, "metrics.ray_metrics": False}
BF16 = {"models.actor.precision": "bf16"}  # the generate and the train call then differ
WARMUP = 2  # steps left out of the time per step (actors warming up)

# mis at the geometric level masks a whole response whose mean per-token log-ratio leaves
# [-log cap, log cap]. Over the demo's first 80 steps in bf16 that mean's exp has a std of
# ~1e-3 and reaches 1.018 at most, so the default cap (2) and 1.01 mask (almost) nothing, and
# 1.0005 masked half of all tokens: 1.002, about two standard deviations, masks a few percent
GEOMETRIC_CAP = 1.002

BYPASS, RECOMPUTE, CONTROL = "bypass", "recompute, none", "bypass, fp32 actor (control)"
GEOMETRIC = f"mis geometric, cap {GEOMETRIC_CAP}"
DEFAULT_BANDS = ("tis token", "tis sequence", "mis token", "mis sequence", "icepop")
MODES: dict[str, dict] = {
    BYPASS: {"algorithm.correction": "none", "algorithm.old_logprobs": "generator"},
    RECOMPUTE: {"algorithm.correction": "none", "algorithm.old_logprobs": "recompute"},
    "tis token": {"algorithm.correction": "tis", "algorithm.correction_level": "token"},
    "tis sequence": {"algorithm.correction": "tis", "algorithm.correction_level": "sequence"},
    "mis token": {"algorithm.correction": "mis", "algorithm.correction_level": "token"},
    "mis sequence": {"algorithm.correction": "mis", "algorithm.correction_level": "sequence"},
    GEOMETRIC: {
        "algorithm.correction": "mis",
        "algorithm.correction_level": "geometric",
        "algorithm.weight_cap": GEOMETRIC_CAP,
    },
    "icepop": {"algorithm.correction": "icepop"},
    # the same bypass with the actor in fp32, where the generator and the trainer agree
    CONTROL: {
        "algorithm.correction": "none",
        "algorithm.old_logprobs": "generator",
        "models.actor.precision": "fp32",
    },
}
STATS = ("is_weight_mean", "is_weight_std", "is_weight_max", "is_capped_frac", "is_masked_frac")
SERIES = ("logprob_mismatch", *STATS, "task_reward", "step_seconds")  # kept per step


def one_run(tmp: str, i: int, mode: str, steps: int, seed: int) -> list[dict]:
    cfg = rayhf.load_config(EXAMPLE).with_overrides(
        {
            **QUIET,
            **BF16,
            **MODES[mode],
            "dataset.path": f"{tmp}/echo.parquet",
            "run_dir": f"{tmp}/mode{i}",
            "seed": seed,
            "steps": steps,
            "save_every": 0,
        }
    )
    return rayhf.run(cfg).metrics


def _mean(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if key in r]
    return statistics.fmean(values) if values else None


def summarize(rows: list[dict], window: int) -> dict:
    """One mode's run: step means of the mismatch and the ratio's stats (None where the mode
    reports none: the bypass has no ratio), its largest ratio, the reward at both ends, and
    each stat per step."""
    timed = [r["step_seconds"] for r in rows if r["step"] > WARMUP]
    maxima = [r["is_weight_max"] for r in rows if "is_weight_max" in r]
    reward = [r["task_reward"] for r in rows]
    return {
        "logprob_mismatch": _mean(rows, "logprob_mismatch"),
        "is_weight_mean": _mean(rows, "is_weight_mean"),
        "is_weight_std": _mean(rows, "is_weight_std"),
        "is_weight_max": max(maxima) if maxima else None,
        "is_capped_frac": _mean(rows, "is_capped_frac"),
        "is_masked_frac": _mean(rows, "is_masked_frac"),
        "reward_first": statistics.fmean(reward[:window]),
        "reward_last": statistics.fmean(reward[-window:]),
        "step_seconds": statistics.fmean(timed) if timed else None,
        "per_step": {k: [r.get(k) for r in rows] for k in SERIES},
    }


def alike(modes: dict[str, dict]) -> list[list[str]]:
    """The groups of two or more modes whose runs gave the same numbers (time aside) at every
    step (a correction that bounds nothing weighs the loss as another does)."""
    groups: dict[str, list[str]] = {}
    for mode, c in modes.items():
        numbers = {k: v for k, v in c["per_step"].items() if k != "step_seconds"}
        groups.setdefault(repr(numbers), []).append(mode)
    return [g for g in groups.values() if len(g) > 1]


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def table(res: dict) -> list[str]:
    w = res["window"]
    lines = [
        f"| mode | log-prob mismatch | rho std | rho max | capped | masked | reward, first {w} "
        f"| reward, last {w} | s/step |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for mode, c in res["modes"].items():
        lines.append(
            f"| {mode} | {_fmt(c['logprob_mismatch'], '.2e')} | {_fmt(c['is_weight_std'], '.2e')}"
            f" | {_fmt(c['is_weight_max'], '.4f')} | {_fmt(c['is_capped_frac'], '.2%')} | "
            f"{_fmt(c['is_masked_frac'], '.2%')} | {c['reward_first']:.3f} | "
            f"{c['reward_last']:.3f} | {_fmt(c['step_seconds'], '.2f')} |"
        )
    return lines


def what_differs(m: dict[str, dict], window: int) -> str:
    bf16 = [c["logprob_mismatch"] for k, c in m.items() if k != CONTROL]
    token, seq = m["tis token"], m["tis sequence"]
    mismatch = m[BYPASS]["per_step"]["logprob_mismatch"]
    first, last = statistics.fmean(mismatch[:window]), statistics.fmean(mismatch[-window:])
    return (
        f"**What differs.** In bf16 the generator's and the trainer's log-probs differ by "
        f"{min(bf16):.1e}-{max(bf16):.1e} per token on average, against "
        f"{m[CONTROL]['logprob_mismatch']:.1e} for the same run in fp32: real, and small. It "
        f"grows as the policy trains (the bypass: {first:.1e} over the first {window} steps, "
        f"{last:.1e} over the last). The "
        f"token ratio rho = pi_trainer / pi_generator spreads by {token['is_weight_std']:.1e} "
        f"(std within a step) and reaches {token['is_weight_max']:.3f} at most in a whole run; "
        f"the product over a response spreads {seq['is_weight_std'] / token['is_weight_std']:.1f}x"
        f" as much (largest {seq['is_weight_max']:.3f})."
    )


def default_bands(m: dict[str, dict]) -> str:
    bounded = [k for k in DEFAULT_BANDS if m[k]["is_capped_frac"] or m[k]["is_masked_frac"]]
    same = "; ".join(", ".join(g) for g in alike(m)) or "none"
    matched = same_start(m["tis token"], m[BYPASS])
    return (
        "**The default bands** ([1/2, 2] for tis and mis, [0.5, 5] for icepop): "
        + (
            f"tokens were capped or masked in {', '.join(bounded)}. "
            if bounded
            else "no token was capped or masked, so each of those modes weighs every token by "
            "rho itself. "
        )
        + f"Modes that ran identically, step for step: {same}. They differ from `{RECOMPUTE}` "
        "(every weight 1) only by those weights. Unbounded, the token weight undoes the "
        "recompute: rho * pi / pi_old = pi / pi_generator, the bypass's ratio, so `tis token` "
        f"differs from `{BYPASS}` only where the clip or the dual clip reads the two ratios "
        f"apart (its rewards matched the bypass's for the first {matched} steps)."
    )


def same_start(a: dict, b: dict) -> int:
    """The steps for which two runs' rewards were the same from the start."""
    n = 0
    for x, y in zip(a["per_step"]["task_reward"], b["per_step"]["task_reward"], strict=False):
        if x != y:
            break
        n += 1
    return n


def cost(m: dict[str, dict]) -> str:
    recomputing = [c["step_seconds"] for k, c in m.items() if k not in (BYPASS, CONTROL)]
    ratio = statistics.median(recomputing) / m[BYPASS]["step_seconds"]
    twins = [[m[k]["step_seconds"] for k in g] for g in alike(m)]
    noise = max((max(t) / min(t) for t in twins), default=1.0)
    bf16_fastest = min(c["step_seconds"] for k, c in m.items() if k != CONTROL)
    return (
        "**Cost.** Recomputing the old log-probs forwards 3/4 of the batch once more (the first "
        f"minibatch's own forward serves for it): the recomputing modes take {ratio:.2f}x the "
        "bypass's seconds per step (their median), on 2 cores shared with other work, where "
        f"runs that computed the same numbers took up to {noise:.2f}x one another's time: read "
        "the time column as noise around a small cost."
        + (
            " The fp32 control is faster than every bf16 run: CPU bf16 matmuls are emulated."
            if m[CONTROL]["step_seconds"] < bf16_fastest
            else ""
        )
    )


def reading(res: dict) -> list[str]:
    """What the numbers say, in sentences that follow them (a run of every mode)."""
    m = res["modes"]
    geo, w = m[GEOMETRIC], res["window"]
    bf16_last = [c["reward_last"] for k, c in m.items() if k != CONTROL]
    learned = all(c["reward_last"] > c["reward_first"] for c in m.values())
    return [
        what_differs(m, w),
        default_bands(m),
        f"**Where correction acts.** mis at the geometric level with cap {GEOMETRIC_CAP} masks "
        f"{geo['is_masked_frac']:.1%} of the tokens (whole responses); its reward over the last "
        f"{w} steps is {geo['reward_last']:.3f}, against {m[RECOMPUTE]['reward_last']:.3f} "
        "without correction.",
        cost(m),
        f"**Reward.** One seed, no error bar: over the last {w} steps the bf16 modes end "
        f"between {min(bf16_last):.3f} and {max(bf16_last):.3f} (the fp32 control: "
        f"{m[CONTROL]['reward_last']:.3f}); "
        + (
            "every mode learns (its last window above its first). "
            if learned
            else "not every mode learns (its last window above its first). "
        )
        + "These say whether a mode breaks learning, not which learns best: with a mismatch "
        "this small there is little for a correction to fix.",
    ]


def report(res: dict, commit: str, args: str) -> str:
    lines = [
        "# Rollout correction with a bf16 generator and trainer (measured)",
        "",
        "GRPO on the demo task (examples/grpo_tiny.yaml, unchanged but for "
        "`models.actor.precision: bf16` and each mode's `algorithm` fields), 2 emulated CPU "
        f"devices, seed {res['seed']}, {res['steps']} steps per mode. The generate call decodes "
        "in bf16 through the native generator's KV-cache path; the train call forwards the "
        "packed sequences under bf16 autocast over fp32 master weights. Per mode, the mean over "
        "steps of: the generator/trainer log-prob mismatch (mean |difference| per token), the "
        "spread (std) of the ratio rho = pi_trainer / pi_generator at the mode's level (token, "
        "sequence product or geometric mean; the recomputing modes only), the shares of tokens "
        "above the cap and masked; rho's largest value over the run; the task reward over the "
        f"first and the last {res['window']} steps; seconds per step after step {WARMUP}. "
        f"Command: `python benchmarks/rollout_correction.py{args}`; commit {commit}.",
        "",
        *table(res),
    ]
    if set(MODES) <= set(res["modes"]):
        lines += ["", *(f"{p}\n" for p in reading(res))]
    return "\n".join(lines).rstrip("\n") + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--window", type=int, default=10, help="steps in each end's reward mean")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    ap.add_argument("--name", default="rollout_correction", help="the results' file name")
    args = ap.parse_args()
    commit = git_commit()
    res: dict = {"steps": args.steps, "seed": args.seed, "window": args.window, "modes": {}}
    started = connect(rayhf.load_config(EXAMPLE).cluster)  # one Ray for every run, not one each
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for i, mode in enumerate(args.modes):
                start = time.perf_counter()
                rows = one_run(tmp, i, mode, args.steps, args.seed)
                res["modes"][mode] = summarize(rows, args.window)
                res["modes"][mode]["run_seconds"] = time.perf_counter() - start
                print(mode, {k: v for k, v in res["modes"][mode].items() if k != "per_step"})
    finally:
        if started:
            ray.shutdown()
    text = report(res, commit, "".join(f" {a}" for a in sys.argv[1:]))
    print(text)
    write_results(args.name, text, res, commit)


if __name__ == "__main__":
    main()
