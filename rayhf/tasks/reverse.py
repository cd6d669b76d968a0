"""The main job's task, "reverse the digits": an answer no shortcut can fake.

A prompt is 4-8 random digits separated by spaces and closed by ``=`` (the same prompts as
``rayhf.tasks.demo``, e.g. ``"3 1 4 1 5 ="``); the ideal response is the digits in reverse
order, ``"5 1 4 1 3"``, then EOS.

The reward (``reward``, scored by ``reverse_score``) counts the response's digits that stand in
their place: spaces removed, position ``i`` of the response against position ``i`` of the
reversed digits, over the longer of the two lengths, and 0 when the response did not end with
EOS. Every digit must be right and in order, with nothing missing or added. What the obvious
shortcuts earn on 2,000 prompts (``tests/unit/tasks/test_reverse.py`` holds them under 0.3):

* the prompt repeated (``"3 1 4 1 5 ="``) about 0.13, its digits in prompt order 0.16;
* one digit 0.02, the prompt's last digit 0.18, a constant (``"5 5 5 5"``) 0.07, empty 0;
* the digits sorted 0.26.

(The echo task's reward, in ``rayhf.tasks.demo``, gives the repeated prompt 0.85: there the
answer is the prompt. A demo whose best shortcut scores that cannot show learning.)

The main job first fine-tunes a from-scratch Llama on ``make_sft_dataset`` rows (prompt and the
reversed digits), then runs PPO from it against ``reward`` (``scripts/demo.sh``).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from statistics import mean

from rayhf.data.datasets import write_rows
from rayhf.tasks.demo import make_dataset, make_prompts

__all__ = ["make_dataset", "make_sft_dataset", "reverse", "reverse_score", "reward"]


def digits(prompt: str) -> list[str]:
    return [c for c in prompt.split() if c.isdigit()]


def reverse(prompt: str) -> str:
    """The ideal response: the prompt's digits in reverse order, space-separated."""
    return " ".join(reversed(digits(prompt)))


def reverse_score(prompt: str, response: str) -> float:
    """Share of places holding the right digit: the response's characters (spaces removed)
    against the reversed digits, position by position, over the longer length; empty is 0."""
    target = reverse(prompt).replace(" ", "")
    given = "".join(response.split())
    if not given or not target:
        return 0.0
    return sum(a == b for a, b in zip(given, target, strict=False)) / max(len(given), len(target))


def reward(
    prompts: list[str], responses: list[str], finished: list[bool] | None = None
) -> list[float]:
    """One score in [0, 1] per sample: ``reverse_score``, or 0 where the response did not end
    with EOS (``finished``; called without it, every response counts as finished)."""
    done = [True] * len(prompts) if finished is None else finished
    return [
        reverse_score(p, r) if end else 0.0
        for p, r, end in zip(prompts, responses, done, strict=True)
    ]


def make_sft_rows(n: int, seed: int) -> list[dict[str, str]]:
    """``make_prompts(n, seed)`` with ``"response"``, the reversed digits of each prompt."""
    rows = make_prompts(n, seed)
    return [{"prompt": r["prompt"], "response": reverse(r["prompt"])} for r in rows]


def make_sft_dataset(path: str | Path, n: int = 2048, seed: int = 1) -> Path:
    """Write ``make_sft_rows(n, seed)`` to ``path`` (.parquet or .jsonl) and return the path
    (seed 1: other prompts than the PPO file's, ``make_dataset``'s seed 0)."""
    return write_rows(make_sft_rows(n, seed), path)


# Answers a policy could settle on without reversing anything (each a function of the prompt).
SHORTCUTS: dict[str, Callable[[str], str]] = {
    "empty": lambda p: "",
    "the prompt repeated": lambda p: p,
    "its digits in order": lambda p: " ".join(digits(p)),
    "the prompt twice": lambda p: f"{p} {p}",
    "its last digit": lambda p: digits(p)[-1],
    "its last digit, prompt-long": lambda p: " ".join(digits(p)[-1] * len(digits(p))),
    "its first digit, prompt-long": lambda p: " ".join(digits(p)[0] * len(digits(p))),
    "a constant, 5 5 5 5": lambda p: "5 5 5 5",
    "a constant, 0 to 9": lambda p: "0 1 2 3 4 5 6 7 8 9",
}


def shortcut_scores(n: int = 2000, seed: int = 0) -> dict[str, float]:
    """The mean reward of each ``SHORTCUTS`` answer over ``make_prompts(n, seed)``."""
    prompts = [r["prompt"] for r in make_prompts(n, seed)]
    return {k: mean(reward(prompts, [f(p) for p in prompts])) for k, f in SHORTCUTS.items()}


def summary(run_dir: str | Path) -> str:
    """What the main job's PPO run learned, from its ``metrics.jsonl``, beside the shortcuts."""
    rows = [json.loads(line) for line in Path(run_dir, "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "task_reward" in r]
    last = rows[-10:]
    scores = shortcut_scores()
    worst = max(scores, key=scores.__getitem__)
    return (
        f"reward {rows[0]['task_reward']:.3f} at PPO step 1 (the SFT policy) -> "
        f"{mean(r['task_reward'] for r in last):.3f}, the mean of the last {len(last)} steps; "
        f"KL to the reference {mean(r['kl'] for r in last):.2f} (last {len(last)})\n"
        f"shortcut answers score at most {scores[worst]:.3f} ({worst}): "
        + ", ".join(f"{k} {v:.2f}" for k, v in scores.items())
    )


if __name__ == "__main__":  # python -m rayhf.tasks.reverse RUN_DIR (scripts/demo.sh)
    print(summary(sys.argv[1]))
