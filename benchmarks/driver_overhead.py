"""The driver's own cost: empty calls through rayhf's step DAG, plain vs compiled executor.

    python benchmarks/driver_overhead.py [--steps 200]

The real driver (``StepDag``, ``DagExecutor``: the schedule, the nodes' arguments, object refs or
compiled channels, the step outcome) runs graphs of empty calls on Ray actors that stand in for
role-group workers (their ``dag_call`` returns at once, or after sleeping):
  overhead:    4 role groups (1 or 2 actors each, a quarter CPU per actor), a chain of 4 calls;
               seconds per call = step time / 4, and the CPU the idle actors burn between steps
  concurrency: two 2-second calls on disjoint meshes (devices 0 and 1) vs the same device
Writes docs/benchmarks/driver_overhead.{md,json}.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from _common import write_results

from rayhf.runtime.probe import probe_batch, probe_executor

IDLE_S = 3.0


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def overhead(ranks: int, compiled: bool, steps: int) -> dict[str, float]:
    import ray

    meshes = [tuple(range(2 * g, 2 * g + ranks)) for g in range(4)]
    executor, groups = probe_executor(meshes, chain=True, seconds=0.0, compiled=compiled)
    pids = ray.get([a.pid.remote() for g in groups for a in g.actors])
    batch = probe_batch()
    for step in range(5):  # warm up (and compile)
        executor.run_step(step, batch)
    began = time.perf_counter()
    per_step = []
    for step in range(steps):
        t = time.perf_counter()
        executor.run_step(step, batch)
        per_step.append(time.perf_counter() - t)
    total = time.perf_counter() - began
    before = [_cpu_seconds(p) for p in pids]
    time.sleep(IDLE_S)
    idle = [(_cpu_seconds(p) - b) / IDLE_S * 100 for p, b in zip(pids, before, strict=True)]
    executor.close()
    for g in groups:
        g.kill()
    return {
        "ms_per_call": total / steps / 4 * 1e3,
        "ms_per_call_p50": statistics.median(per_step) / 4 * 1e3,
        "idle_cpu_pct_per_actor": statistics.mean(idle),
        "actors": len(pids),
    }


def concurrency(disjoint: bool, compiled: bool) -> float:

    meshes = [(0,), (1,)] if disjoint else [(0,), (0,)]
    executor, groups = probe_executor(meshes, chain=False, seconds=2.0, compiled=compiled)
    batch = probe_batch()
    executor.run_step(0, batch)  # warm up
    began = time.perf_counter()
    executor.run_step(1, batch)
    seconds = time.perf_counter() - began
    executor.close()
    for g in groups:
        g.kill()
    return seconds


def main() -> None:
    import ray

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    ray.init(num_cpus=2, include_dashboard=False, configure_logging=False, log_to_driver=False)
    rows = []
    for ranks in (1, 2):
        for compiled in (False, True):
            row = {"ranks_per_group": ranks, "executor": "compiled" if compiled else "plain"}
            row.update(overhead(ranks, compiled, args.steps))
            rows.append(row)
            print(row, flush=True)
    conc = []
    for compiled in (False, True):
        for disjoint in (True, False):
            s = concurrency(disjoint, compiled)
            meshes = "disjoint" if disjoint else "overlapping"
            executor = "compiled" if compiled else "plain"
            conc.append({"executor": executor, "meshes": meshes, "seconds": s})
            print(conc[-1], flush=True)
    ray.shutdown()
    _write(rows, conc, args.steps)


def _write(rows: list[dict], conc: list[dict], steps: int) -> None:
    lines = [
        "# Driver overhead: empty calls through the step DAG",
        "",
        f"`python benchmarks/driver_overhead.py --steps {steps}` on this 2-core machine: 4 role",
        "groups, a chain of 4 empty calls per step; per-call time is the step time / 4; idle CPU",
        f"is each actor's CPU use over {IDLE_S:g} s with no step running.",
        "",
        "| actors per group | executor | ms per call (mean) | ms per call (p50) "
        "| idle CPU per actor |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['ranks_per_group']} | {r['executor']} | {r['ms_per_call']:.2f} | "
            f"{r['ms_per_call_p50']:.2f} | {r['idle_cpu_pct_per_actor']:.0f}% |"
        )
    lines += ["", "Two 2-second calls (one per role group) in one step:", "",
              "| executor | meshes | step seconds |", "| --- | --- | --- |"]  # fmt: skip
    for c in conc:
        lines.append(f"| {c['executor']} | {c['meshes']} | {c['seconds']:.2f} |")
    write_results(
        "driver_overhead", "\n".join(lines) + "\n", {"overhead": rows, "concurrency": conc}
    )
    print("\n".join(lines))


if __name__ == "__main__":
    main()
