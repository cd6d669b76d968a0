"""How long the README's test command takes on a clean clone, and where the time goes.

    python benchmarks/suite_time.py                 # clone HEAD, run scripts/test.sh there
    python benchmarks/suite_time.py --from-log LOG --wall 3900 --commit abc1234
                                                    # read a run already made
        [--beside LOG2 --beside-commit def5678 --beside-when "..."]
                                                    # and another commit's run the same day

The run is ``bash scripts/test.sh --durations=0`` on a fresh ``git clone`` of HEAD, as CI runs
it: set-up from nothing, lint, type check, then pytest three times (the quick tests on both cores;
the slow ones on both cores, a file to a worker; the slow ones marked ``alone`` one at a time; a
log of an older scripts/test.sh holds one or two pytest runs). pytest's own ``--durations=0``
lines give each test's set-up, call and tear-down; this script sums them per test and per file
(a test's own seconds: where two ran at once, their sum exceeds the run's) and writes
``docs/benchmarks/suite_time.{md,json}``. How fast the machine was that day shows in a run of
another commit beside it (``--beside``), e.g. the one issue 64 measured. The goal (issue 64):
pytest in at most 25 minutes on a good day of the 2-core machine, and ``pytest -m "not slow"``
under 8.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from _common import REPO, git_commit, write_results

DURATION = re.compile(r"^\s*([\d.]+)s (setup|call|teardown)\s+(\S+)")
SUMMARY = re.compile(r"^[= ]*(\d+ (?:passed|failed|skipped|deselected|errors?)\b.*?) in ([\d.]+)s")
TOP = 25


def parse(log: str) -> tuple[dict[str, float], list[tuple[str, float]]]:
    """Seconds per test (set-up + call + tear-down), and each pytest's outcome line and total,
    from the text of ``pytest --durations=0`` runs."""
    per_test: dict[str, float] = defaultdict(float)
    runs = []
    for line in log.splitlines():
        if m := DURATION.match(line):
            per_test[m.group(3)] += float(m.group(1))
        elif m := SUMMARY.search(line):
            runs.append((m.group(1), float(m.group(2))))
    return dict(per_test), runs


def per_file(per_test: dict[str, float]) -> dict[str, float]:
    files: dict[str, float] = defaultdict(float)
    for test, seconds in per_test.items():
        files[test.split("::")[0]] += seconds
    return dict(sorted(files.items(), key=lambda kv: -kv[1]))


def _run(cmd: list[str], cwd: Path, log: Path) -> float:
    """Run ``cmd`` in ``cwd`` as CI would (``CI=true``), its output to ``log``; its seconds."""
    start = time.monotonic()
    with log.open("w") as out:
        # CI's clone sits beside ../shared (the KubeRay CRDs); a clone in a temporary
        # directory finds it through the variable, or its k8s tests error under CI=true
        shared = os.environ.get("RAYHF_SHARED_DIR", str(REPO.parent / "shared"))
        env = {**os.environ, "CI": "true", "RAYHF_SHARED_DIR": shared}
        subprocess.run(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, check=False)
    return time.monotonic() - start


def measure(work: Path) -> tuple[float, str]:
    """Clone HEAD into ``work`` and run the test command there: its seconds and its log."""
    clone = work / "clone"
    subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True)
    log = work / "suite.log"
    wall = _run(["bash", "scripts/test.sh", "--durations=0"], clone, log)
    return wall, log.read_text()


# scripts/test.sh's pytest runs, in its order, by how many it made (2: before 2 December 2026)
QUICK = "the quick tests, both cores"
PHASES = {
    2: (QUICK, "the slow tests, one at a time"),
    3: (QUICK, "the slow tests, both cores, a file to a worker", "the `alone` ones, one at a time"),
}


def report(log: str, wall: float | None, commit: str) -> tuple[str, dict]:
    per_test, runs = parse(log)
    files = per_file(per_test)
    lines = [
        "# The suite's time: the README's test command on a clean clone",
        "",
        "`python benchmarks/suite_time.py`: `bash scripts/test.sh --durations=0` on a fresh clone"
        " (what CI runs), 2 cores. Goal (issue 64): pytest in at most 25 minutes on a good day,"
        ' `pytest -m "not slow"` under 8.',
        "",
        "| what | seconds | minutes |",
        "| --- | ---: | ---: |",
    ]
    rows: list[tuple[str, float | None]] = [
        ("the whole command (set-up, lint, types, pytest)", wall)
    ]
    if len(runs) in PHASES:
        phases = PHASES[len(runs)]
        rows += [(f"pytest, {p}: {o}", s) for p, (o, s) in zip(phases, runs, strict=True)]
    rows += [(f"pytest: {'; '.join(o for o, _ in runs)}", sum(s for _, s in runs) or None)]
    lines += [f"| {what} | {s:.0f} | {s / 60:.1f} |" for what, s in rows if s is not None]
    lines += [
        "",
        "Per file, the largest (set-up, call and tear-down of its tests; where two"
        " tests ran at once each counts its own seconds):",
        "",
    ]
    lines += ["| file | seconds | share |", "| --- | ---: | ---: |"]
    whole = sum(files.values()) or 1.0
    for name, seconds in list(files.items())[:TOP]:
        lines.append(f"| `{name}` | {seconds:.0f} | {seconds / whole:.0%} |")
    lines += ["", f"The {TOP} largest tests:", "", "| test | seconds |", "| --- | ---: |"]
    for name, seconds in sorted(per_test.items(), key=lambda kv: -kv[1])[:TOP]:
        lines.append(f"| `{name}` | {seconds:.1f} |")
    data = {
        "wall_s": wall, "pytest_runs": [{"outcome": o, "s": s} for o, s in runs],
        "pytest_s": sum(s for _, s in runs) or None, "per_file_s": files, "per_test_s": per_test,
    }  # fmt: skip
    return "\n".join(lines) + f"\n\nMeasured on commit {commit}.\n", data


def beside(
    log: str, commit: str, when: str, pytest_s: float | None, then_min: float | None = None
) -> tuple[str, dict]:
    """A paragraph on another commit's run of its own test command the same day: its pytest
    seconds, this run's over them, and (``then_min``: that commit's minutes on another day) this
    run scaled to that day."""
    _, runs = parse(log)
    theirs = sum(s for _, s in runs)
    outcome = "; ".join(o for o, _ in runs)
    text = (
        f"\nThe same day ({when}), a clean clone of {commit} ran its own `scripts/test.sh`: "
        f"pytest {theirs:.0f} s ({theirs / 60:.1f} min; {outcome})."
    )
    if pytest_s:
        text += f" This run's pytest over it: {pytest_s / theirs:.2f}x."
        if then_min:
            text += (
                f" On a day when {commit}'s took {then_min:g} min, this suite would take about "
                f"{pytest_s / theirs * then_min:.1f}."
            )
    return text + "\n", {"commit": commit, "when": when, "pytest_s": theirs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--from-log", type=Path, help="a `scripts/test.sh --durations=0` log to read")
    ap.add_argument("--wall", type=float, help="the whole command's seconds, with --from-log")
    ap.add_argument("--commit", help="the commit the log measured (default: HEAD)")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--beside", type=Path, help="another commit's log from the same day")
    ap.add_argument("--beside-commit", default="?", help="the commit --beside measured")
    ap.add_argument("--beside-when", default="the same day", help="when it ran, in words")
    ap.add_argument("--beside-then", type=float, help="--beside's minutes on a reference day")
    args = ap.parse_args()
    commit = args.commit or git_commit()
    if args.from_log:
        text, data = report(args.from_log.read_text(), args.wall, commit)
    else:
        with tempfile.TemporaryDirectory(prefix="rayhf-suite-") as work:
            wall, log = measure(Path(work))
        text, data = report(log, wall, commit)
    if args.beside:
        more, data["beside"] = beside(
            args.beside.read_text(), args.beside_commit, args.beside_when, data["pytest_s"],
            args.beside_then,
        )  # fmt: skip
        text = text.replace("\n\nPer file,", f"\n{more}\nPer file,", 1)
    print(text)
    if not args.no_write:
        write_results("suite_time", text, data, commit=commit)


if __name__ == "__main__":
    main()
