"""Steps overlapped where the dataflow allows vs one step at a time, measured on this machine.

    python benchmarks/step_overlap.py [--steps 6] [--rounds 3]

PPO from examples/ppo_tiny.yaml on 2 emulated CPU devices, the actor's calls (and the ref's) on
device 0, the critic's and the reward's on device 1: with ``driver.overlap_steps`` step i+1's
generation runs while step i's critic trains. Two critics: the example's, and a larger one
(its training is the longer side). Each case runs both modes in interleaved rounds; reported:
steps/s over the steps after warm-up (median of rounds), and whether both modes gave the same
metrics. Writes docs/benchmarks/step_overlap.{md,json}.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from _common import git_commit, write_results

import rayhf

REPO = Path(__file__).resolve().parents[1]
CALLS = ("actor_gen", "rew_inf", "ref_inf", "critic_inf", "actor_train", "critic_train")
ACTOR_SIDE = ("actor_gen", "actor_train", "ref_inf")
SPLIT = {c: {"mesh": [0] if c in ACTOR_SIDE else [1]} for c in CALLS}
CRITICS = {
    "the example's critic": {},
    "critic 192 wide, 6 layers": {
        "models.critic.init.hidden_size": 192,
        "models.critic.init.n_layers": 6,
    },
}
TIMING = ("seconds", "per_s")


def one_run(tmp: str, name: str, critic: dict, overlap: bool, steps: int) -> list[dict]:
    cfg = rayhf.load_config(REPO / "examples" / "ppo_tiny.yaml").with_overrides(
        {
            "run_dir": f"{tmp}/{name}",
            "dataset.path": f"{tmp}/data.parquet",
            "steps": steps,
            "save_every": 0,
            "plan": SPLIT,
            "driver.overlap_steps": overlap,
            "metrics.console": False,
            "metrics.plot": False,
            "metrics.ray_metrics": False,
            **critic,
        }
    )
    return rayhf.run(cfg).metrics


def steps_per_s(rows: list[dict], warmup: int) -> float:
    timed = [r["step_seconds"] for r in rows if r["step"] > warmup]
    return len(timed) / sum(timed)


def numbers(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not any(t in k for t in TIMING)} for r in rows]


def bench(steps: int, warmup: int, rounds: int) -> dict:
    out: dict = {"steps": steps, "warmup": warmup, "rounds": rounds, "cases": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for case, critic in CRITICS.items():
            rates: dict[str, list[float]] = {"overlap": [], "barrier": []}
            same = True
            for r in range(rounds):
                runs = {}
                for mode in ("overlap", "barrier") if r % 2 == 0 else ("barrier", "overlap"):
                    name = f"{len(out['cases'])}_{mode}_{r}"
                    rows = one_run(tmp, name, critic, mode == "overlap", steps + warmup)
                    runs[mode] = rows
                    rates[mode].append(steps_per_s(rows, warmup))
                same = same and numbers(runs["overlap"]) == numbers(runs["barrier"])
            med = {m: statistics.median(v) for m, v in rates.items()}
            out["cases"][case] = {
                "steps_per_s": rates,
                "median": med,
                "gain": med["overlap"] / med["barrier"],
                "same_metrics": same,
            }
    return out


def report(res: dict, commit: str) -> str:
    lines = [
        "# Overlapped steps vs one step at a time (measured)",
        "",
        f"PPO (examples/ppo_tiny.yaml), 2 emulated CPU devices, actor and ref on device 0, critic "
        f"and reward on device 1; {res['steps']} steps after {res['warmup']} warm-up, median of "
        f"{res['rounds']} interleaved rounds. Command: `python benchmarks/step_overlap.py`; "
        f"commit {commit}.",
        "",
        "| case | overlap steps/s | one at a time steps/s | gain | same metrics |",
        "| --- | ---: | ---: | ---: | --- |",
    ]
    for case, c in res["cases"].items():
        m = c["median"]
        lines.append(
            f"| {case} | {m['overlap']:.2f} | {m['barrier']:.2f} | {c['gain']:.2f}x | "
            f"{'yes' if c['same_metrics'] else 'NO'} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    commit = git_commit()
    res = bench(args.steps, args.warmup, args.rounds)
    res["commit"] = commit
    text = report(res, commit)
    print(text)
    write_results("step_overlap", text, res, commit)


if __name__ == "__main__":
    main()
