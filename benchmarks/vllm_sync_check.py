"""What checking a vLLM weight sync costs: ``VllmGenerator.sync()`` unchecked vs checked.

    python benchmarks/vllm_sync_check.py [--processes 4] [--syncs 11] [--hidden 768] [--layers 12]

A random fp32 Llama (99.3M parameters at the defaults, vocabulary 8192) on vLLM's CPU build. The
two modes run in fresh processes, alternating (the allocator's state shifts timings between modes
in one process), with ``OMP_NUM_THREADS=1`` (with torch's default two threads an unchecked sync
here takes 0.13 s in some processes and 0.9 s in others). Each process loads once, then times
``--syncs`` syncs, each after ``model.changed()`` (as after a train step). Reports the median
over all syncs of each mode. Each process starts once the machine has been idle for 2 s, and the
CPU time other processes took while it ran is recorded (this machine's two cores are shared).
Writes docs/benchmarks/vllm_sync_check.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import write_results

MODES = ("unchecked", "checked")


def child(mode: str, syncs: int, hidden: int, layers: int, vocab: int) -> None:
    """Time ``syncs`` syncs in one mode and print them as one JSON line."""
    from rayhf.engines.rank_model import RankModel
    from rayhf.engines.vllm_generator import VllmGenerator
    from rayhf.models.hf import ModelInit, build_model, hf_config
    from rayhf.models.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer("0123456789abc", Path(tempfile.mkdtemp()) / "tok")
    init = ModelInit(family="llama", hidden_size=hidden, n_layers=layers, n_heads=hidden // 64)
    config = hf_config(init, vocab, tok.pad_token_id, tok.bos_token_id, tok.eos_token_id)
    model = RankModel.from_hf(build_model(config, value_head=False, seed=0), tok, False)
    n_params = sum(t.numel() for t in model.full_state().values())
    checked_by = ("gen",) if mode == "checked" else ()
    gen = VllmGenerator(model, seed=0, sleeps=False, checked_by=checked_by)
    gen.sync()  # the first load
    times = []
    for _ in range(syncs):
        model.changed()
        times.append(gen.sync())
    print("RESULT", json.dumps({"mode": mode, "n_params": n_params, "seconds": times}))


def _busy_cpu_s() -> float:
    """CPU-seconds this machine has spent busy since boot (Linux)."""
    ticks = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")  # less idle, iowait


def _wait_idle(limit_s: float = 600.0) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        began = _busy_cpu_s()
        time.sleep(2)
        if _busy_cpu_s() - began < 0.2:
            return


def run(mode: str, args: argparse.Namespace) -> dict:
    """One fresh process in ``mode``: its syncs' seconds and the CPU-seconds others took."""
    _wait_idle()
    sizes = {"--syncs": args.syncs, "--hidden": args.hidden, "--layers": args.layers,
             "--vocab": args.vocab}  # fmt: skip
    cmd = [sys.executable, __file__, "--child", mode, *(str(x) for kv in sizes.items() for x in kv)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    busy, before = _busy_cpu_s(), resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    own = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    line = next(line for line in out.splitlines() if line.startswith("RESULT "))
    result = json.loads(line.removeprefix("RESULT "))
    result["others_cpu_s"] = round(_busy_cpu_s() - busy - own, 2)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=4, help="fresh processes per mode")
    parser.add_argument("--syncs", type=int, default=11, help="timed syncs per process")
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.syncs, args.hidden, args.layers, args.vocab)
        return
    runs = [run(mode, args) for _ in range(args.processes) for mode in MODES]
    for r in runs:
        print(f"{r['mode']:9s} median {statistics.median(r['seconds']):.4f} s "
              f"(others' CPU {r['others_cpu_s']} s)", flush=True)  # fmt: skip
    _write(runs, args)


def _write(runs: list[dict], args: argparse.Namespace) -> None:
    median = {m: statistics.median(t for r in runs if r["mode"] == m for t in r["seconds"])
              for m in MODES}  # fmt: skip
    cost = median["checked"] / median["unchecked"] - 1
    n_params = runs[0]["n_params"]
    lines = [
        "# What checking a vLLM weight sync costs",
        "",
        f"`python benchmarks/vllm_sync_check.py --processes {args.processes} --syncs "
        f"{args.syncs} --hidden {args.hidden} --layers {args.layers}` on this 2-core machine "
        f"(`OMP_NUM_THREADS=1`): `VllmGenerator.sync()` of a random fp32 Llama of "
        f"{n_params / 1e6:.1f}M parameters (vocabulary {args.vocab}) into vLLM's CPU build, "
        f"{args.syncs} syncs in each of {args.processes} fresh processes per mode, alternating.",
        "",
        "| mode | median s | syncs | per-process medians (s) |",
        "| --- | --- | --- | --- |",
    ]
    for m in MODES:
        per = [statistics.median(r["seconds"]) for r in runs if r["mode"] == m]
        n = sum(len(r["seconds"]) for r in runs if r["mode"] == m)
        lines.append(f"| {m} | {median[m]:.4f} | {n} | {', '.join(f'{s:.3f}' for s in per)} |")
    others = max(r["others_cpu_s"] for r in runs)
    lines += [
        "",
        f"The check costs {median['checked'] - median['unchecked']:+.4f} s per sync "
        f"({100 * cost:+.1f}%). Other processes took at most {others} CPU-seconds while one of "
        "these ran.",
    ]
    data = {"median_seconds": median, "cost": cost, "runs": runs, "args": vars(args)}
    write_results("vllm_sync_check", "\n".join(lines) + "\n", data)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
