"""Long responses on this machine: a GRPO run whose policy samples thousands of tokens, its
train and reference calls with each sequence whole and split over cp ranks.

    python benchmarks/long_responses.py [--steps 2] [--tokens 4096] [--cp 1 2]

``examples/grpo_tiny.yaml`` with a wider policy (256 wide, 4 layers, 8 heads), on 4 emulated
devices: 8 prompts x 4 samples a step, each response between ``--tokens`` / 2 and ``--tokens``
new tokens (``generation.min_new_tokens`` and ``max_new_tokens``; an untrained policy's end of
sequence is drawn at random in between), trained in one minibatch cut into micro-batches of at
most twice the longest sample's tokens (``max_tokens_per_microbatch``). Generation runs data
parallel over the 4 devices, the actor's train call and the reference's inference call on
``dp = 4`` with ``cp`` from ``--cp`` (cp = 2: two shares of the batch, each sequence over 2
ranks, so a device holds half of each micro-batch). Per run, from its ``metrics.jsonl`` after
the first step: each call's peak memory on its fullest device (a process's peak resident set:
interpreter, libraries, weights and whatever the process's allocator kept from its earlier calls
included), its seconds, the mean response length, and the balance of its data-parallel shares
(the largest share's tokens over the mean, as split and as equal counts of rows would split).
Not learning. Writes docs/benchmarks/long_responses.{md,json}.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from _common import described, git_commit, write_results

import rayhf

REPO = Path(__file__).resolve().parents[1]
QUIET = {"metrics.console": False, "metrics.plot": False, "metrics.ray_metrics": False}
POLICY = {"family": "llama", "hidden_size": 256, "n_layers": 4, "n_heads": 8, "n_kv_heads": 4}
CALLS = ("actor_gen", "ref_inf", "actor_train")
PROMPT = 24  # grpo_tiny.yaml's dataset.max_prompt_len


def one_run(tmp: str, cp: int, steps: int, tokens: int) -> list[dict]:
    split = {"dp": 4, "cp": cp}
    # micro-batches of two of the longest samples' tokens: a device holds 1/cp of each
    budget = {"engine": "torch", "max_tokens_per_microbatch": 2 * (tokens + PROMPT)}
    cfg = rayhf.load_config(REPO / "examples" / "grpo_tiny.yaml").with_overrides(
        {
            **QUIET,
            "run_dir": f"{tmp}/cp{cp}",
            "dataset.path": f"{tmp}/prompts.parquet",
            "steps": steps,
            "save_every": 0,
            "batch_size": 8,
            "algorithm.n_minibatches": 1,
            "engines": {"actor_train": budget, "ref_inf": budget},
            "cluster.n_devices": 4,
            "models.actor.init": POLICY,
            "generation.min_new_tokens": tokens // 2,
            "generation.max_new_tokens": tokens,
            "plan": {
                "actor_gen": {"dp": 4},
                "rew_inf": {"dp": 4},
                "ref_inf": split,
                "actor_train": split,
            },
        }
    )
    return rayhf.run(cfg).metrics


def summary(cp: int, rows: list[dict]) -> dict:
    later = [r for r in rows if r.get("step", 0) > 1] or rows  # the first step warms up

    def mean(key: str) -> float | None:
        values = [r[key] for r in later if key in r]
        return statistics.fmean(values) if values else None

    out: dict = {"cp": cp, "response_len": mean("response_len")}
    for call in CALLS:
        out[call] = {
            "peak_gb": mean(f"peak_memory_gb/{call}"),
            "seconds": mean(f"seconds/{call}"),
            "balance": mean(f"dp_tokens_max_over_mean/{call}"),
            "balance_by_rows": mean(f"dp_by_rows_max_over_mean/{call}"),
        }
    return out


def _cell(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def report(rows: list[dict], args: str, commit: str) -> str:
    lines = [
        "# Long responses on this machine: a GRPO run with sequences whole and split",
        "",
        f"`python benchmarks/long_responses.py{args}` on this machine (2 CPU cores), commit "
        f"{commit}. " + described(__doc__),
        "",
        "| cp | mean response | call | peak memory (fullest device) | seconds | shares' "
        "largest over mean: by tokens | by rows |",
        "| ---: | ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        for call in CALLS:
            c = r[call]
            lines.append(
                f"| {r['cp']} | {_cell(r['response_len'], '.0f')} | {call} | "
                f"{_cell(c['peak_gb'], '.2f')} GB | {_cell(c['seconds'], '.1f')} | "
                f"{_cell(c['balance'], '.3f')} | {_cell(c['balance_by_rows'], '.3f')} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--cp", type=int, nargs="+", default=[1, 2])
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for cp in args.cp:
            rows.append(summary(cp, one_run(tmp, cp, args.steps, args.tokens)))
            print(rows[-1], flush=True)
    commit = git_commit()
    text = report(rows, "".join(f" {a}" for a in sys.argv[1:]), commit)
    print(text)
    write_results("long_responses", text, {"rows": rows}, commit)


if __name__ == "__main__":
    main()
