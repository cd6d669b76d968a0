"""The planner at scale (simulated): PPO with the ReaLHF paper's model sizes on H100 clusters.

    python benchmarks/planner_scale.py [--time-limit 25] [--quick]

For each setup (actor size, critic size, devices, generation length) the search's plan is
compared with the baselines' (colocated verl-style, disjoint OpenRLHF-style, ReaLHF's
heuristic) in estimated iteration time from the analytic cost model; infeasible (over memory)
plans are marked. Writes docs/benchmarks/planner_scale.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from _common import git_commit

from rayhf.graph import load_graph
from rayhf.models.shapes import public_shape
from rayhf.planner import baselines
from rayhf.planner.cost import AnalyticCost, Workload
from rayhf.planner.hardware import parse_cluster
from rayhf.planner.search import energy, search
from rayhf.planner.simulate import simulate

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "docs" / "benchmarks"
BATCH, PROMPT = 512, 128


def setups(quick: bool) -> list[tuple[str, str, int, int]]:
    """(actor, critic, devices, generation length), after the ReaLHF paper's Table/Figure setups."""
    out = []
    for actor, devices in [("llama2-7b", 16), ("llama2-13b", 32), ("codellama-34b", 64),
                           ("llama2-70b", 128)]:  # fmt: skip
        for gen in (128, 896):
            out.append((actor, "llama2-7b", devices, gen))  # actor grows, 7B critic
            if actor != "llama2-7b":
                out.append((actor, actor, devices, gen))  # all four models grow together
    return out[:2] if quick else out


def works(graph, gen: int) -> dict[str, Workload]:
    return {
        c.name: Workload(c.kind, BATCH, PROMPT, gen, 4 if c.kind == "train" else 1)
        for c in graph.calls
    }


def run_setup(actor: str, critic: str, devices: int, gen: int, time_limit: float) -> dict:
    graph = load_graph(REPO / "graphs" / "ppo.yaml")
    cluster = parse_cluster(f"{devices // 8}x8xH100")
    cost = AnalyticCost(cluster)
    specs = {
        "actor": public_shape(actor),
        "ref": public_shape(actor),
        "critic": public_shape(critic, value_head=True),
        "reward": public_shape(critic, value_head=True),
    }
    w = works(graph, gen)
    cap = cluster.device.memory_bytes

    def score(plan) -> float:
        return energy(simulate(graph, plan, specs, w, cost), cap)

    base = {
        "colocated": baselines.colocated(graph, specs, devices, 8, score),
        "disjoint": baselines.disjoint(graph, specs, devices, 8, score),
        "realhf": baselines.realhf(graph, specs, devices // 8, 8, score),
    }
    base = {k: v for k, v in base.items() if v is not None}
    found = search(graph, specs, w, cost, list(base.values()), time_limit=time_limit)
    row = {"actor": actor, "critic": critic, "devices": devices, "gen": gen}
    for name, plan in {**base, "search": found.plan}.items():
        sim = simulate(graph, plan, specs, w, cost)
        row[name] = {"seconds": sim.iteration_seconds, "feasible": sim.feasible}
    row["search_seconds"] = found.seconds
    row["iterations"] = found.iterations
    feasible = [row[k]["seconds"] for k in base if row[k]["feasible"]]
    row["best_baseline"] = min(feasible) if feasible else None
    return row


def report(rows: list[dict], commit: str) -> str:
    lines = [
        "# Planner at scale (simulated, analytic cost model, H100 datasheet figures)",
        "",
        f"PPO, batch {BATCH} prompts of {PROMPT} tokens; seconds per iteration (steps overlapped "
        "where the dataflow allows, as the driver runs them); `*` = does not fit memory. "
        f"Command: `python benchmarks/planner_scale.py`; commit {commit}.",
        "",
        "| actor | critic | GPUs | gen | colocated | disjoint | ReaLHF | search | speed-up | "
        "search s |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    ups = []
    for r in rows:
        cells = []
        for k in ("colocated", "disjoint", "realhf", "search"):
            v = r.get(k)
            cells.append("-" if v is None else f"{v['seconds']:.1f}{'' if v['feasible'] else '*'}")
        up = r["best_baseline"] / r["search"]["seconds"] if r["best_baseline"] else float("nan")
        ups.append(up)
        lines.append(
            f"| {r['actor']} | {r['critic']} | {r['devices']} | {r['gen']} | {' | '.join(cells)} "
            f"| {up:.2f}x | {r['search_seconds']:.1f} |"
        )
    finite = [u for u in ups if u == u]
    lines += [
        "",
        f"Speed-up over the best feasible baseline: geometric mean "
        f"{statistics.geometric_mean(finite):.2f}x, median {statistics.median(finite):.2f}x, "
        f"range {min(finite):.2f}-{max(finite):.2f}x over {len(finite)} setups.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--time-limit", type=float, default=25.0)
    parser.add_argument("--quick", action="store_true", help="first two setups only")
    args = parser.parse_args()
    rows = []
    for setup in setups(args.quick):
        rows.append(run_setup(*setup, time_limit=args.time_limit))
        print(rows[-1], flush=True)
    commit = git_commit()
    text = report(rows, commit)
    print(text)
    if not args.quick:
        OUT.mkdir(parents=True, exist_ok=True)
        (OUT / "planner_scale.md").write_text(text)
        (OUT / "planner_scale.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
