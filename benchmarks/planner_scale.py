"""The planner at scale (simulated): PPO with the ReaLHF paper's model sizes on H100 clusters.

    python benchmarks/planner_scale.py [--time-limit 25] [--quick]

For each setup (actor size, critic size, devices, generation length) the search's plan is
compared with every baseline's (``rayhf.planner.baselines``: one shared layout, verl's hybrid
engine, OpenRLHF, disjoint roles, ReaLHF's heuristic) in estimated iteration time from the
analytic cost model; infeasible (over memory) plans are marked and never count as the best
baseline. Writes docs/benchmarks/planner_scale.{md,json}, every plan included.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from _common import git_commit, write_results

from rayhf.graph import load_graph
from rayhf.models.shapes import public_shape
from rayhf.planner import baselines
from rayhf.planner.auto import open_stages
from rayhf.planner.cost import AnalyticCost, Workload
from rayhf.planner.hardware import parse_cluster
from rayhf.planner.plan import Plan
from rayhf.planner.problem import Problem
from rayhf.planner.search import candidates, search
from rayhf.planner.simulate import simulate

REPO = Path(__file__).resolve().parents[1]
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
    """Each call's work; train calls may take any ZeRO stage (0-1 torch, 2-3 DeepSpeed)."""
    return open_stages({
        c.name: Workload(c.kind, BATCH, PROMPT, gen, 4 if c.kind == "train" else 1)
        for c in graph.calls
    })  # fmt: skip


def bound(graph, specs, works, cost: AnalyticCost) -> float:
    """A floor under any plan's iteration time in this cost model, reallocation and memory
    sharing ignored: the larger of (a) every call's fewest device-seconds spread over all
    devices and (b) per trained role, the longest chain of dependent calls (at their fastest)
    from its first call to its train call, which its next step's first call waits for. A
    plan's time over it is the most any search could still gain on that plan."""
    cluster, cap = cost.cluster, cost.cluster.device.memory_bytes
    fewest, fastest = {}, {}
    for c in graph.calls:
        spec, work = specs[c.role], works[c.name]
        fits = []
        for lay in candidates(spec, cluster.n_devices, cluster.devices_per_node):
            for z in [work.zero_stage, *work.choices_on(lay)]:
                priced = cost.call(spec, lay, work.with_stage(z) if c.kind == "train" else work)
                if priced.memory <= cap:
                    fits.append((priced.seconds, len(lay.mesh)))
        fewest[c.name] = min(t * n for t, n in fits)
        fastest[c.name] = min(t for t, _ in fits)
    cycles = [0.0]
    for role in graph.roles:  # a trained role's first call of step i+1 waits for its train call
        calls = graph.role_calls(role)
        trains = [n for n in calls if graph.by_name[n].kind == "train"]
        if trains:
            cycles.append(_longest(graph, calls[0], trains[-1], fastest))
    return max(sum(fewest.values()) / cluster.n_devices, *cycles)


def _longest(graph, first: str, last: str, seconds: dict[str, float]) -> float:
    """The longest chain of dependent calls from ``first`` to ``last``."""
    reach = {first: seconds[first]}
    for name in graph.order:
        before = [reach[a] for a, b in graph.edges if b == name and a in reach]
        if before and name not in reach:
            reach[name] = max(before) + seconds[name]
    return reach.get(last, 0.0)


def setting(actor: str, critic: str, devices: int, gen: int):
    """The graph, model specs, workloads and H100 cost model of one setup."""
    graph = load_graph(REPO / "graphs" / "ppo.yaml")
    cost = AnalyticCost(parse_cluster(f"{devices // 8}x8xH100"))
    specs = {
        "actor": public_shape(actor),
        "ref": public_shape(actor),
        "critic": public_shape(critic, value_head=True),
        "reward": public_shape(critic, value_head=True),
    }
    return graph, specs, works(graph, gen), cost


def run_setup(actor: str, critic: str, devices: int, gen: int, time_limit: float) -> dict:
    graph, specs, w, cost = setting(actor, critic, devices, gen)
    row: dict = {"actor": actor, "critic": critic, "devices": devices, "gen": gen}
    row |= compare(Problem(graph, specs, w, cost), time_limit)
    row["bound"] = bound(graph, specs, w, cost)
    return row


def compare(problem: Problem, time_limit: float) -> dict:
    """Every baseline's plan and the search's (started from them), each simulated: its
    seconds, whether it fits and the plan (None: the baseline's rules give none); the best
    feasible baseline, the search's own seconds and steps."""
    began = time.perf_counter()
    built = baselines.build_all(baselines.Setting.priced(problem))
    row: dict = {"baseline_seconds": time.perf_counter() - began}
    base = {k: v for k, v in built.items() if v is not None}
    found = search(problem, list(base.values()), time_limit=time_limit)
    for name, plan in {**built, "search": found.plan}.items():
        if plan is None:
            row[name] = None  # its rules give no plan here
            continue
        sim = simulate(problem, plan)
        row[name] = {
            "seconds": sim.iteration_seconds,
            "feasible": sim.feasible,
            "plan": json.loads(
                Plan(plan.layouts, plan.source, sim.stages, released=sim.released).to_json()
            ),
        }
    row["search_seconds"] = found.seconds
    row["iterations"] = found.iterations
    feasible = {k: row[k]["seconds"] for k in base if row[k]["feasible"]}
    row["best_baseline"] = min(feasible, key=feasible.__getitem__) if feasible else None
    return row


def best_seconds(row: dict) -> float:
    """The best feasible baseline's seconds (nan when none is feasible)."""
    best = row["best_baseline"]
    return row[best]["seconds"] if best else float("nan")


def speedup(row: dict) -> float:
    """The best feasible baseline's seconds over the search's (nan when none is feasible)."""
    return best_seconds(row) / row["search"]["seconds"]


def seconds_table(
    rows: list[dict], columns: dict[str, str], labels: tuple[str, ...], digits: int = 1
) -> list[str]:
    """A table row per setup: its ``labels`` (keys of the row), each of ``columns``' seconds
    and the search's (``*``: over memory, ``-``: no plan), the best feasible baseline and the
    search's speed-up over it; then a line of the speed-ups' geometric mean, median, worst and
    best."""
    lines, ups = [], []
    for r in rows:
        cells = []
        for k in [*columns, "search"]:
            v = r.get(k)
            mark = "" if v is None or v["feasible"] else "*"
            cells.append("-" if v is None else f"{v['seconds']:.{digits}f}{mark}")
        up = speedup(r) if r["best_baseline"] and r["search_feasible"] else float("nan")
        ups.append(up)
        lines.append(
            "| " + " | ".join(str(r[k]) for k in labels) + f" | {' | '.join(cells)} "
            f"| {columns.get(r['best_baseline'] or '', 'none')} | "
            + ("-" if up != up else f"{up:.2f}x")
            + " |"
        )
    finite = [u for u in ups if u == u]
    none = len(rows) - len(finite)
    lines += [""]
    if finite:
        lines.append(
            f"Speed-up of the search over the best feasible baseline: geometric mean "
            f"{statistics.geometric_mean(finite):.2f}x, median {statistics.median(finite):.2f}x, "
            f"worst {min(finite):.2f}x, best {max(finite):.2f}x over {len(finite)} setups"
            + (f"; {none} setups have no feasible plan to compare." if none else ".")
        )
    return lines


def report(rows: list[dict], commit: str) -> str:
    lines = [
        "# Planner at scale (simulated, analytic cost model, H100 datasheet figures)",
        "",
        f"PPO, batch {BATCH} prompts of {PROMPT} tokens, 4 minibatches; seconds per iteration "
        "(steps overlapped where the dataflow allows, as the driver runs them); `*` = does not "
        "fit memory, `-` = the baseline's rules give no plan. Train calls may take ZeRO stage "
        "0-1 (torch) or 2-3 (DeepSpeed, dp only) in every plan; verl and OpenRLHF train at "
        f"ZeRO-3 by their rules. Command: `python benchmarks/planner_scale.py`; commit {commit}. "
        "Every plan, with its stages, is in `planner_scale.json`.",
        "",
        "| actor | critic | GPUs | gen | "
        + " | ".join(COLUMNS.values())
        + " | search | best baseline | speed-up | bound | search s |",
        "| --- | --- | ---: | ---: | "
        + " | ".join("---:" for _ in COLUMNS)
        + " | ---: | --- | ---: | ---: | ---: |",
    ]
    ups = []
    for r in rows:
        cells = []
        for k in [*COLUMNS, "search"]:
            v = r.get(k)
            cells.append("-" if v is None else f"{v['seconds']:.1f}{'' if v['feasible'] else '*'}")
        up = speedup(r)
        ups.append(up)
        lines.append(
            f"| {r['actor']} | {r['critic']} | {r['devices']} | {r['gen']} | {' | '.join(cells)} "
            f"| {COLUMNS.get(r['best_baseline'], 'none')} | {up:.2f}x | {r['bound']:.1f} "
            f"| {r['search_seconds']:.1f} |"
        )
    finite = [u for u in ups if u == u]
    lost = [r for r, u in zip(rows, ups, strict=True) if u == u and u < 1.0]
    none = len(rows) - len(finite)
    lines += [
        "",
        f"Speed-up over the best feasible baseline: geometric mean "
        f"{statistics.geometric_mean(finite):.2f}x, median {statistics.median(finite):.2f}x, "
        f"range {min(finite):.2f}-{max(finite):.2f}x over {len(finite)} setups"
        + (f" ({none} with no feasible baseline)." if none else "."),
        f"Setups where a baseline is faster than the search: {len(lost)}.",
        "",
        "`bound`: no plan can run an iteration faster in this cost model (the larger of every "
        "call's fewest device-seconds spread over all devices and, per trained role, the chain of "
        "dependent calls at their fastest from its first call to its train call, which its next "
        "step waits for; reallocation and memory sharing ignored). The best "
        "baseline is at a geometric mean of "
        f"{_gmean([best_seconds(r) / r['bound'] for r in rows]):.2f}x"
        " the bound, the search at "
        f"{_gmean([r['search']['seconds'] / r['bound'] for r in rows]):.2f}x: the first is the "
        "most any plan could gain over the best baseline, the second what the search leaves.",
        "",
        "Feasible plans per baseline: "
        + ", ".join(
            f"{label} {sum(1 for r in rows if r.get(k) and r[k]['feasible'])}/{len(rows)}"
            for k, label in COLUMNS.items()
        )
        + "; best feasible baseline: "
        + ", ".join(
            f"{label} {sum(1 for r in rows if r['best_baseline'] == k)}"
            for k, label in COLUMNS.items()
        )
        + ".",
    ]
    return "\n".join(lines) + "\n"


def _gmean(values: list[float]) -> float:
    return statistics.geometric_mean(values) if values else float("nan")


COLUMNS = {
    "colocated": "one layout",
    "verl": "verl",
    "openrlhf": "OpenRLHF",
    "disjoint": "disjoint",
    "realhf": "ReaLHF",
}


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
        write_results("planner_scale", text, rows, commit, indent=None)


if __name__ == "__main__":
    main()
