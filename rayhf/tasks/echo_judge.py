"""A judge for the demo task ("echo the digits", ``rayhf.tasks.demo``), trained here by SFT.

The judge reads ``JUDGE_TEMPLATE`` filled with a prompt and an answer, e.g.
``"3 1 4 = 3 1 9 ="``, and writes one digit, the grade: ``round(9 * reward)``, the task's own
reward (``demo.reward``) in ten steps, so the run's ``judge:`` section reads it as a number over
``scale: 9``. An answer longer than ``MAX_ANSWER_CHARS`` cannot be a finished echo (the longest
echo is 8 digits and 7 spaces; a policy writing 16 tokens was cut off) and grades 0, as the
reward scores an answer that never ended.

``make_judge_rows`` pairs the demo's prompts with answers of the kinds a policy writes while it
learns the task from scratch: random characters (often cut off), ``demo.candidate`` answers
(runs of prompt digits, partly corrupted), echoes with a few edits (with or without spaces),
and runs of digits, random or mostly one digit repeated, with or without spaces: GRPO against a
judge trained without those runs learned to write unspaced runs of zeros, which that judge
graded about 0.78 and the task 0 (docs/benchmarks/judge_demo.md). ``DEGENERATE`` lists answers a
policy might find to fool a judge; the judge example reports the judge's grade of each beside
the true one.
"""

from __future__ import annotations

import random
from pathlib import Path

from rayhf.data.datasets import write_rows
from rayhf.tasks.demo import ALPHABET, candidate, echo, make_prompts, reward

JUDGE_TEMPLATE = "{prompt} {response} ="
MAX_ANSWER_CHARS = 15  # the longest echo; a policy's 16-character answer never ended
GRADES = 9  # a grade is 0-9: one character, read back over ``judge.scale: 9``

DEGENERATE = {
    "empty": lambda p: "",
    "one prompt digit": lambda p: p[0],
    "a constant run": lambda p: " ".join("9" * len(echo(p).split())),
    "the prompt itself": lambda p: p,
    "letters": lambda p: "a b c d e",
    "the echo twice": lambda p: f"{echo(p)} {echo(p)}",
    "the echo and '='": lambda p: f"{echo(p)} =",
    "'=' and a grade": lambda p: "= 9",
    "the echo, reversed": lambda p: echo(p)[::-1],
    "zeros, unspaced": lambda p: "0" * 16,
}


def judge_grade(prompt: str, response: str) -> int:
    """The grade the judge learns: ``round(9 * reward)``; 0 past ``MAX_ANSWER_CHARS``."""
    finished = len(response) <= MAX_ANSWER_CHARS
    return round(GRADES * reward([prompt], [response], [finished])[0])


def _edited_echo(prompt: str, rng: random.Random) -> str:
    """The echo with 0-3 digits substituted, inserted or deleted; a fifth without spaces."""
    tokens = echo(prompt).split()
    for _ in range(rng.randint(0, 3)):
        at = rng.randrange(len(tokens) + 1)
        what = rng.random()
        if what < 0.4 and at < len(tokens):
            tokens[at] = rng.choice("0123456789")
        elif what < 0.7 or not tokens:
            tokens.insert(at, rng.choice("0123456789"))
        elif at < len(tokens):
            del tokens[at]
    return ("" if rng.random() < 0.2 else " ").join(tokens)


def _digit_run(rng: random.Random) -> str:
    """1-16 digits: random ones, or mostly one digit repeated (a policy's cheap answer)."""
    n = rng.randint(1, 16)
    if rng.random() < 0.5:
        return "".join(rng.choice("0123456789") for _ in range(n))
    digit = rng.choice("0123456789")
    return "".join(digit if rng.random() < 0.8 else rng.choice(ALPHABET[:-1]) for _ in range(n))


def judged_answer(prompt: str, rng: random.Random) -> str:
    """One answer to grade, at most 16 characters (what a policy writes in 16 tokens)."""
    kind = rng.random()
    if kind < 0.2:
        answer = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 16)))
    elif kind < 0.35:
        answer = candidate(prompt, rng)
    elif kind < 0.65:
        answer = _edited_echo(prompt, rng)
    else:
        answer = _digit_run(rng)
        if rng.random() < 0.4:  # spaced as the echo is
            answer = " ".join(answer)
    return answer[:16]


def make_judge_rows(n: int, seed: int) -> list[dict[str, str]]:
    """``n`` SFT rows: the filled template as the prompt, the grade as the response."""
    rng = random.Random(f"judge-{seed}")
    rows = []
    for row in make_prompts(n, seed):
        answer = judged_answer(row["prompt"], rng)
        text = JUDGE_TEMPLATE.format(prompt=row["prompt"], response=answer)
        rows.append({"prompt": text, "response": str(judge_grade(row["prompt"], answer))})
    return rows


def make_judge_dataset(path: str | Path, n: int = 16384, seed: int = 0) -> Path:
    """Write ``make_judge_rows(n, seed)`` to ``path`` (.parquet or .jsonl); return the path."""
    return write_rows(make_judge_rows(n, seed), path)
