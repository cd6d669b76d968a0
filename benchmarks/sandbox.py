"""The code tool's cost per program: the runner before kernel isolation against the bubblewrap
sandbox (and the weaker mode that remains by name).

    python benchmarks/sandbox.py [--programs 128] [--concurrency 1 8 64] [--startups 40]
                                 [--rounds 3] [--before e4536dd]

Each runner runs the same small program (a sum of squares, printed: a code-RL answer's size)
``--startups`` times one after another (per-program latency: median and p90), then
``--programs`` of them from C threads at once for each C in ``--concurrency`` (programs/s, the
median of ``--rounds``; the runners' programs and rounds interleaved;
64 is ``env.concurrency``'s default, the trajectories a multi-turn generate call keeps inside
their environments). "before" is ``rayhf/envs/sandbox.py`` as it was at ``--before`` (an audit
hook in the program's own interpreter), loaded from git. Writes docs/benchmarks/sandbox.{md,json}.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from _common import REPO, write_results

from rayhf.envs import sandbox

PROGRAM = "print(sum(i * i for i in range(10_000)))"
EXPECTED = str(sum(i * i for i in range(10_000)))


def old_runner(commit: str) -> Callable[[str], object]:
    """``run_python`` of the sandbox module at ``commit``."""
    source = subprocess.run(
        ["git", "show", f"{commit}:rayhf/envs/sandbox.py"],
        cwd=REPO, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    path = Path(tempfile.mkdtemp()) / "old_sandbox.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("old_sandbox", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["old_sandbox"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module.run_python  # type: ignore[no-any-return]


def runners(before: str) -> dict[str, Callable[[str], object]]:
    weak = sandbox.SandboxConfig(isolation="unsafe-process-only")
    kernel = sandbox.SandboxConfig()
    return {
        f"before ({before}: audit hook)": old_runner(before),
        "unsafe-process-only": lambda code: sandbox.run_python(code, cfg=weak),
        "kernel (bubblewrap)": lambda code: sandbox.run_python(code, cfg=kernel),
    }


def _once(run: Callable[[str], object]) -> float:
    start = time.perf_counter()
    r = run(PROGRAM)
    took = time.perf_counter() - start
    assert getattr(r, "stdout", "").strip() == EXPECTED, r
    return took


def measure(
    runs: dict[str, Callable[[str], object]],
    startups: int,
    programs: int,
    levels: list[int],
    rounds: int,
) -> dict[str, dict[str, float]]:
    """Per-program latency and programs/s of every runner, their runs interleaved (a program of
    each runner in turn; a round of each at every level) so the machine's drift hits all alike."""
    for run in runs.values():
        _once(run)  # warm: the kernel mode's first run finds bwrap and compiles the filter
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(startups):
        for name, run in runs.items():
            times[name].append(_once(run))
    rates: dict[str, dict[int, list[float]]] = {name: {c: [] for c in levels} for name in runs}
    for c in levels:
        for _ in range(rounds):
            for name, run in runs.items():
                start = time.perf_counter()
                with ThreadPoolExecutor(c) as pool:
                    list(pool.map(_once, [run] * programs))
                rates[name][c].append(programs / (time.perf_counter() - start))
    rows = {}
    for name, t in times.items():
        t = sorted(t)
        rows[name] = {
            "median_ms": 1000 * statistics.median(t),
            "p90_ms": 1000 * t[int(0.9 * len(t))],
        }
        rows[name] |= {f"per_s_c{c}": statistics.median(rates[name][c]) for c in levels}
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--programs", type=int, default=128)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--startups", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--before", default="e4536dd")
    args = ap.parse_args()
    kernel = sandbox.kernel_isolation(None, None, sandbox.NOBODY)
    rows = measure(
        runners(args.before), args.startups, args.programs, args.concurrency, args.rounds
    )
    for name, row in rows.items():
        print(name, {k: round(v, 1) for k, v in row.items()}, flush=True)
    levels = " | ".join(f"programs/s, {c} at once" for c in args.concurrency)
    lines = [
        "# The code tool's sandbox: cost per program",
        "",
        f"`python benchmarks/sandbox.py --programs {args.programs} --concurrency "
        f"{' '.join(map(str, args.concurrency))} --startups {args.startups} --rounds "
        f"{args.rounds} --before {args.before}`, on {platform.machine()} with 2 cores. The "
        f"program: `{PROGRAM}`. Kernel mode here: {kernel.describe()}; its programs run "
        f"`{kernel.python}`, the other runners' `{os.path.realpath(sys.executable)}` (the "
        "worker's own, where the sandbox's uid can reach it).",
        "",
        f"| runner | per program, median ms | p90 ms | {levels} |",
        "| --- | ---: | ---: |" + " ---: |" * len(args.concurrency),
    ]
    for name, r in rows.items():
        rates = " | ".join(f"{r[f'per_s_c{c}']:.1f}" for c in args.concurrency)
        lines.append(f"| {name} | {r['median_ms']:.1f} | {r['p90_ms']:.1f} | {rates} |")
    write_results("sandbox", "\n".join(lines) + "\n", {"rows": rows, "args": vars(args)})


if __name__ == "__main__":
    main()
