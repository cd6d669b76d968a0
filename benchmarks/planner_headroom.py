"""What holds the planner's gain back, the search or the cost model (simulated, H100 figures).

    python benchmarks/planner_headroom.py [--time-limit 25] [--quick]

``planner_scale`` finds the search short of its 1.26x target. Two measurements say why:

- **More search.** On the 16- and 32-GPU setups, the search runs with three seeds and once
  with four times the iterations and time. If none of them finds a faster plan, more search
  does not raise the ratio.
- **Every role placement.** On the 16-GPU setups, every placement of the actor's generation,
  the actor's training, the critic, the reference and the reward model on ReaLHF's blocks
  (aligned power-of-two blocks in a node, or whole nodes) is simulated, one placement per
  class of placements that the cluster's symmetry makes alike (nodes are alike, and so are
  the halves of any block). A role's calls share its block. Each call takes its fastest
  layout there, or the layout of the role's other call on that block, in every
  combination. The best of these is a plan the search could have found.

Writes docs/benchmarks/planner_headroom.{md,json}.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
import time

from _common import git_commit, write_results
from planner_scale import setting, setups

from rayhf.planner import baselines
from rayhf.planner.plan import Plan
from rayhf.planner.problem import Problem
from rayhf.planner.search import _fitting, _Scorer, candidates, search
from rayhf.planner.simulate import simulate

# placed labels: each role's calls share a block, except the actor's generation
PLACED = {"actor_gen": "gen", "actor_train": "actor", "critic_inf": "critic",
          "critic_train": "critic", "ref_inf": "ref", "rew_inf": "reward"}  # fmt: skip
LABELS = ("actor", "critic", "gen", "ref", "reward")


@functools.cache
def placements(depth: int, labels: frozenset[str]) -> tuple:
    """One placement per symmetry class: ``labels`` placed on the nodes of a complete binary
    tree of ``depth`` levels below its root, as (labels here, left subtree, right subtree)
    with the two subtrees unordered (the left one never sorts after the right)."""
    out = []
    ordered = sorted(labels)
    for k in range(len(ordered) + 1):
        for here in itertools.combinations(ordered, k):
            rest = [x for x in ordered if x not in here]
            if depth == 0:
                out += [(here,)] if not rest else []
                continue
            for mask in range(1 << len(rest)):
                left = frozenset(x for i, x in enumerate(rest) if mask >> i & 1)
                for a in placements(depth - 1, left):
                    for b in placements(depth - 1, frozenset(rest) - left):
                        if a <= b:
                            out.append((here, a, b))
    return tuple(out)


def blocks_of(tree: tuple, start: int, size: int) -> dict[str, tuple[int, ...]]:
    """Each label's devices in a placement of the tree over ``start`` .. ``start + size``."""
    out = {label: tuple(range(start, start + size)) for label in tree[0]}
    if len(tree) == 3:
        half = size // 2
        out |= blocks_of(tree[1], start, half) | blocks_of(tree[2], start + half, half)
    return out


def exhaustive(score: _Scorer) -> tuple[float, dict, int]:
    """The fastest feasible plan among every role placement (see the module's docstring), its
    layouts, and how many plans were simulated."""
    problem = score.problem
    graph, specs, cluster = problem.graph, problem.specs, problem.cluster
    n = cluster.n_devices
    options = _fitting(  # layouts whose call alone fits a device (all, where none does)
        problem,
        {c.name: candidates(specs[c.role], n, cluster.devices_per_node) for c in graph.calls},
    )
    best, best_layouts, tried = math.inf, {}, 0
    for tree in placements(int(math.log2(n)), frozenset(LABELS)):
        where = blocks_of(tree, 0, n)
        fastest = {c: score.fastest(c, where[PLACED[c]], options[c]) for c in graph.order}
        if any(lay is None for lay in fastest.values()):
            continue  # a call that fits nowhere on its block
        choices = []
        for name in graph.order:  # its own fastest, or a same-role call's on the same block
            mine = {fastest[name]} | {
                fastest[o] for o in graph.role_calls(graph.by_name[name].role)
                if fastest[o].mesh == fastest[name].mesh
            }  # fmt: skip
            choices.append(sorted(mine, key=str))
        for combo in itertools.product(*choices):
            layouts = dict(zip(graph.order, combo, strict=True))
            e = score(layouts)
            tried += 1
            if e < best:
                best, best_layouts = e, layouts
    return best, best_layouts, tried


def run_setup(actor: str, critic: str, devices: int, gen: int, limit: float, every: bool) -> dict:
    problem = Problem(*setting(actor, critic, devices, gen))
    built = baselines.build_all(baselines.Setting.priced(problem))
    starts = [p for p in built.values() if p is not None]
    best_base = min(
        (s.iteration_seconds for s in (simulate(problem, p) for p in starts) if s.feasible),
        default=math.nan,
    )  # fmt: skip
    row: dict = {"actor": actor, "critic": critic, "devices": devices, "gen": gen,
                 "best_baseline": best_base, "search": {}}  # fmt: skip
    for label, seed, scale in [("seed 0", 0, 1), ("seed 1", 1, 1), ("seed 2", 2, 1),
                               ("seed 0, 4x", 0, 4)]:  # fmt: skip
        found = search(problem, starts, seed, 20000 * scale, limit * scale)
        row["search"][label] = {
            "seconds": found.simulation.iteration_seconds,
            "feasible": found.simulation.feasible,
            "search_seconds": found.seconds,
            "plan": json.loads(found.plan.to_json()),
        }
    if every:
        score = _Scorer(problem, deadline=math.inf)
        began = time.perf_counter()
        _, layouts, tried = exhaustive(score)
        sim = simulate(problem, Plan(layouts, "placements"))
        row["placements"] = {
            "seconds": sim.iteration_seconds,
            "feasible": sim.feasible,
            "simulated": tried,
            "wall_seconds": time.perf_counter() - began,
            "plan": json.loads(
                Plan(layouts, "placements", sim.stages, released=sim.released).to_json()
            ),
        }
    return row


def report(rows: list[dict], commit: str, limit: float) -> str:
    labels = list(rows[0]["search"])
    lines = [
        "# Planner headroom: the search or the cost model? (simulated, H100 figures)",
        "",
        f"PPO setups of `planner_scale` (16-32 GPUs); seconds per iteration. Search: {limit:g} s "
        "and 20000 iterations per run (as in `planner_scale`), `4x`: four times both. "
        "Placements: the fastest of every role placement on the cluster's blocks (16 GPUs only; "
        "see the script's docstring). Command: `python benchmarks/planner_headroom.py`; "
        f"commit {commit}.",
        "",
        "| actor | critic | GPUs | gen | best baseline | "
        + " | ".join(f"search {k}" for k in labels)
        + " | placements | plans simulated | best search gain over seed 0 |",
        "| --- | --- | ---: | ---: | ---: | "
        + " | ".join("---:" for _ in labels)
        + " | ---: | ---: | ---: |",
    ]
    for r in rows:
        runs = [r["search"][k] for k in labels]
        cells = [f"{v['seconds']:.2f}{'' if v['feasible'] else '*'}" for v in runs]
        p = r.get("placements")
        placed = "-" if p is None else f"{p['seconds']:.2f}"
        gain = runs[0]["seconds"] / min(v["seconds"] for v in runs if v["feasible"])
        lines.append(
            f"| {r['actor']} | {r['critic']} | {r['devices']} | {r['gen']} "
            f"| {r['best_baseline']:.2f} | {' | '.join(cells)} "
            f"| {placed} "
            f"| {'-' if p is None else p['simulated']} | {gain:.3f}x |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--time-limit", type=float, default=25.0)
    parser.add_argument("--quick", action="store_true", help="first setup, short searches")
    args = parser.parse_args()
    chosen = [s for s in setups(False) if s[2] <= 32]
    limit = args.time_limit
    if args.quick:
        chosen, limit = chosen[:1], 2.0
    rows = []
    for setup in chosen:
        rows.append(run_setup(*setup, limit=limit, every=setup[2] == 16))
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "search"})[:400], flush=True)
    commit = git_commit()
    text = report(rows, commit, limit)
    print(text)
    if not args.quick:
        write_results("planner_headroom", text, rows, commit, indent=None)


if __name__ == "__main__":
    main()
