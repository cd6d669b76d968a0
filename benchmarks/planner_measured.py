"""The planner's gain measured: the searched plan and every fair baseline run as real PPO runs
on 4 emulated devices (sharing this machine's 2 cores), for three models (one a Qwen3.5-shaped
hybrid), beside what the simulator predicted for each.

    python benchmarks/planner_measured.py [--steps 3] [--warmup 2] [--rounds 3]

Per model, the baselines (``rayhf.planner.baselines``: one layout, verl, OpenRLHF, disjoint,
ReaLHF) and the search plan PPO under the profiled cost with the runtime constants ``plan:
auto`` uses (``rayhf.planner.hardware``, fitted on 2 devices by planner_calibration.py: nothing
here is fitted to these runs), ZeRO stages 0-3 open. Every distinct plan then runs with rayhf,
its ZeRO stages included (1: torch's zero1, 2-3: DeepSpeed), in interleaved rounds; per plan the
round with the median step time is kept. Writes docs/benchmarks/planner_measured.{md,json}.
"""

from __future__ import annotations

import argparse
import math
import statistics
import tempfile
from typing import Any, NamedTuple

import yaml
from _common import REPO, git_commit, write_results
from planner_calibration import as_config, base_config, measure_rounds, planner, same_as

from rayhf.planner import baselines
from rayhf.planner.auto import open_stages
from rayhf.planner.hardware import CPU_ACTOR, CPU_CALL_OVERHEAD
from rayhf.planner.plan import Plan
from rayhf.planner.problem import Problem
from rayhf.planner.profile import ProfiledCost
from rayhf.planner.search import search
from rayhf.planner.simulate import simulate

DEVICES = 4
# its policy: three Gated DeltaNet layers, then one attention layer
HYBRID_EXAMPLE = yaml.safe_load((REPO / "examples" / "grpo_hybrid_tiny.yaml").read_text())
MODELS = {
    "ppo_tiny (0.1M)": {},  # the example's own models
    "12.6M": {"family": "llama", "hidden_size": 512, "n_layers": 4, "n_heads": 8, "n_kv_heads": 4},
    "qwen3.5-shaped (0.1M)": HYBRID_EXAMPLE["models"]["actor"]["init"],
}


class Setup(NamedTuple):
    cfg: Any
    graph: Any
    specs: dict
    works: dict
    cost: ProfiledCost

    def problem(self) -> Problem:
        return Problem(self.graph, self.specs, self.works, self.cost)


def setup(model: dict, tmp: str) -> Setup:
    cfg = base_config(model, tmp, DEVICES)
    graph, specs, works, bare = planner(cfg, DEVICES)
    cost = ProfiledCost(bare.cluster, bare.profiles, CPU_CALL_OVERHEAD, CPU_ACTOR)
    return Setup(cfg, graph, specs, open_stages(works), cost)


def chosen(s: Setup, seconds: float) -> tuple[dict[str, Plan], list[str]]:
    """Every baseline's plan and the search's, each with the ZeRO stage of every train call
    (as the simulator chose them: what the run must execute), and the baselines with no plan."""
    problem = s.problem()
    built = baselines.build_all(baselines.Setting.priced(problem))
    plans = {f"baseline: {k}": p for k, p in built.items() if p is not None}
    found = search(problem, list(plans.values()), time_limit=seconds)
    plans["search"] = found.plan
    out = {}
    for label, plan in plans.items():
        stages = simulate(problem, plan).stages
        out[label] = Plan(plan.layouts, plan.source, stages)
    return out, [k for k, p in built.items() if p is None]


def rows_of(name: str, s: Setup, plans: dict[str, Plan], runs) -> list[dict]:
    rows = []
    for label, plan in plans.items():
        same = same_as(plans, label)
        sim = simulate(s.problem(), plan)
        step = runs[name, same].step_seconds
        rows.append({"model": name, "plan": label, "layouts": as_config(plan),
                     "zero": plan.zero, "feasible": sim.feasible,
                     "estimate": sim.iteration_seconds, "measured": step,
                     "error": sim.iteration_seconds / step - 1,
                     "same_as": same if same != label else None})  # fmt: skip
    return rows


def describe(plan: dict, zero: dict) -> str:
    """A plan in a few words: each call's devices and dp/tp/pp, and the ZeRO stages."""
    parts = []
    for call, lay in plan.items():
        mesh = lay["mesh"]
        where = f"d{mesh[0]}" + (f"-{mesh[-1]}" if len(mesh) > 1 else "")
        shape = "".join(f"{k}{lay[k]}" for k in ("dp", "tp", "pp") if lay[k] > 1) or "1"
        parts.append(f"{call} {where} {shape}")
    stages = ", ".join(f"{c} Z{z}" for c, z in zero.items() if z)
    return "; ".join(parts) + (f"; {stages}" if stages else "")


def report(rows: list[dict], absent: dict[str, list[str]], args, commit: str) -> str:
    lines = [
        "# The planner measured: searched plan vs fair baselines, real runs",
        "",
        f"{DEVICES} emulated CPU devices on this machine's 2 cores, PPO batch 32, 12 new tokens, "
        f"4 minibatches; measured: mean of {args.steps} steps after {args.warmup} warm-up, median "
        f"of {args.rounds} interleaved rounds. Estimates: the simulator with the profiled cost and "
        "the runtime constants `plan: auto` uses (fitted on 2 devices by planner_calibration.py; "
        "none fitted to these runs). Command: `python benchmarks/planner_measured.py`; "
        f"commit {commit}.",
        "",
        "| model | plan | estimate s | measured s | error |",
        "| --- | --- | ---: | ---: | ---: |",
    ]
    for r in rows:
        same = f" (= {r['same_as']})" if r["same_as"] else ""
        lines.append(f"| {r['model']} | {r['plan']}{same} | {r['estimate']:.3f} | "
                     f"{r['measured']:.3f} | {r['error']:+.1%} |")  # fmt: skip
    worst = max(rows, key=lambda r: abs(r["error"]))
    lines += ["", f"Largest error: {worst['error']:+.1%} ({worst['model']}, {worst['plan']}; "
              "goal: every plan within 25%)."]  # fmt: skip
    ratios = []
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = {r["plan"]: r for r in rows if r["model"] == model}
        base = {k: v for k, v in mine.items() if k.startswith("baseline")}
        best = min(base, key=lambda k: base[k]["measured"])
        sim_best = min(v["estimate"] for v in base.values())
        ratio = base[best]["measured"] / mine["search"]["measured"]
        ratios.append(ratio)
        lines.append(
            f"- {model}: the search's plan measured {mine['search']['measured']:.3f} s, the "
            f"fastest baseline ({best.removeprefix('baseline: ')}) {base[best]['measured']:.3f} "
            f"s: **{ratio:.2f}x** (simulated: {sim_best / mine['search']['estimate']:.2f}x). "
            f"No plan from: {', '.join(absent[model]) or 'none'} (ReaLHF's rules are for nodes "
            "of 8 devices)."
        )
    geo = math.exp(statistics.mean(math.log(x) for x in ratios))
    lines += ["", f"Geometric mean of the measured ratios: {geo:.2f}x.", "", "Plans:", ""]
    for r in rows:
        if not r["same_as"]:
            lines.append(f"- {r['model']}, {r['plan']}: {describe(r['layouts'], r['zero'])}")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--search-seconds", type=float, default=20.0)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        setups = {name: setup(model, f"{tmp}/m{i}") for i, (name, model) in
                  enumerate(MODELS.items())}  # fmt: skip
        plans, absent = {}, {}
        for name, s in setups.items():
            plans[name], absent[name] = chosen(s, args.search_seconds)
            for label, plan in plans[name].items():
                print(f"{name:<18}{label:<22}{describe(as_config(plan), plan.zero)}", flush=True)
        runs = measure_rounds(setups, plans, args, tmp)
    rows = [r for name, s in setups.items() for r in rows_of(name, s, plans[name], runs)]
    commit = git_commit()
    text = report(rows, absent, args, commit)
    print(text)
    write_results("planner_measured", text, rows, commit)


if __name__ == "__main__":
    main()
