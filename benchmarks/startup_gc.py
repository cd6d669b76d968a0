"""What pausing and freezing the garbage collector at import saves (``rayhf.startup``).

    python benchmarks/startup_gc.py [--runs 4] [--rounds 2]

Two-step PPO runs of examples/ppo_tiny.yaml (4 actors on 2 emulated devices), one Ray cluster
per setting and round started by a fresh process, with ``RAYHF_GC_FREEZE`` 1 (the default) and 0
(the collector left alone) in turn: each run's wall seconds and the CPU seconds the whole
machine spent meanwhile (the driver, Ray, the actors: ``/proc/stat``), the first run of each
cluster left out (it finds Ray's workers started); the medians, and ``import rayhf``'s seconds.
Writes docs/benchmarks/startup_gc.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import described, write_results

REPO = Path(__file__).resolve().parents[1]
SETTINGS = {"1": "paused while importing, then frozen", "0": "left alone"}


def _busy_seconds() -> float:
    """CPU seconds the machine has spent busy (every core, every process)."""
    with open("/proc/stat") as f:
        ticks = [int(v) for v in f.readline().split()[1:]]
    return (sum(ticks[:8]) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def child(runs: int) -> None:
    """In a process of its own: Ray, then ``runs + 1`` runs; one JSON line of their figures."""
    began = time.perf_counter()
    import rayhf

    imported = time.perf_counter() - began
    import ray

    ray.init(num_cpus=2, resources={"rayhf_device": 4.0}, include_dashboard=False,
             configure_logging=False, log_to_driver=False)  # fmt: skip
    quiet = {"metrics.console": False, "metrics.plot": False, "metrics.ray_metrics": False}
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(runs + 1):
            cfg = rayhf.load_config(REPO / "examples" / "ppo_tiny.yaml", ["steps=2"])
            cfg = cfg.with_overrides({**quiet, "run_dir": f"{tmp}/run{i}"})
            cpu, wall = _busy_seconds(), time.perf_counter()
            rayhf.run(cfg)
            out.append((time.perf_counter() - wall, _busy_seconds() - cpu))
    ray.shutdown()
    print(json.dumps({"import_s": imported, "runs": out[1:]}))


def report(res: dict, args: str) -> str:
    lines = [
        "# The garbage collector at import: paused, then frozen, or left alone",
        "",
        f"`python benchmarks/startup_gc.py{args}` on this machine (2 CPU cores). "
        + described(__doc__),
        "",
        "| the collector | runs | wall s a run (median) | CPU s a run (median) "
        "| `import rayhf` s |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for key, name in SETTINGS.items():
        r = res[key]
        lines.append(
            f"| {name} (`RAYHF_GC_FREEZE={key}`) | {len(r['wall'])} | {r['wall_median']:.2f} | "
            f"{r['cpu_median']:.2f} | {r['import_median']:.2f} |"
        )
    on, off = res["1"], res["0"]
    lines += [
        "",
        f"Frozen against left alone: {on['cpu_median'] / off['cpu_median']:.2f}x the CPU a run, "
        f"{on['wall_median'] / off['wall_median']:.2f}x its wall time.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.runs)
        return
    got: dict[str, dict[str, list[float]]] = {
        k: {"wall": [], "cpu": [], "import": []} for k in SETTINGS
    }
    for _ in range(args.rounds):
        for key in SETTINGS:
            env = {**os.environ, "RAYHF_GC_FREEZE": key}
            cmd = [sys.executable, __file__, "--child", "--runs", str(args.runs)]
            text = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
            line = json.loads(text.stdout.strip().splitlines()[-1])
            got[key]["import"].append(line["import_s"])
            got[key]["wall"] += [w for w, _ in line["runs"]]
            got[key]["cpu"] += [c for _, c in line["runs"]]
            print(key, line, flush=True)
    res = {
        key: {**v, **{f"{m}_median": statistics.median(v[m]) for m in ("wall", "cpu", "import")}}
        for key, v in got.items()
    }
    text = report(res, f" --runs {args.runs} --rounds {args.rounds}")
    print(text)
    write_results("startup_gc", text, res)


if __name__ == "__main__":
    main()
