"""A judge for the demo task ("echo the digits", ``rayhf.tasks.demo``), trained here by SFT.

The judge reads ``JUDGE_TEMPLATE`` filled with a prompt and an answer, e.g.
``"3 1 4 =3 1 9 ="``, and reasons place by place before it scores (``judge_verdict``): for each
place of the answer (spaces removed) it writes the prompt's digit there, the answer's character
there and a mark, 1 where the two agree: ``"331 111 490"``. The run's ``judge:`` section reads
it as a ``marks`` verdict, the mean of the marks (``places_right``): a lower bound of the task's
reward that is 1 exactly when the reward is (a wrong place costs at most one edit). Each token
of that verdict is a copy (the prompt's digit, the answer's character: what the echo itself
asks of a model) or a comparison of the two tokens before it, so a judge of the policy's size
learns it in a few hundred steps; a judge asked for the grade alone, as one digit, had not
learned to compare the places after 1,000 (``docs/decisions/0087-*``).

The judge does not see whether an answer ended: an answer cut off at the length limit is graded
on its places, where the reward scores it 0.

``make_judge_rows`` pairs the demo's prompts with answers of the kinds a policy writes: answers
of the echo's length with a random share of places given another digit (only the prompt tells
them apart), echoes with a few edits, random characters, ``demo.candidate`` answers, runs of
digits, and optionally a policy checkpoint's own samples. ``DEGENERATE`` lists answers a policy
might find to fool a judge; the judge example reports the judge's score of each beside the true
reward.
"""

from __future__ import annotations

import random
from pathlib import Path

from rayhf.data.datasets import write_rows
from rayhf.tasks.demo import ALPHABET, candidate, echo, make_prompts, policy_answers

JUDGE_TEMPLATE = "{prompt}{response} ="  # the answer right after "=", as the policy writes it
MARKS = {"1": 1.0, "0": 0.0}  # the run's ``judge.choices`` under ``verdict: marks``
MISSING = "="  # stands for the side of a place that one of prompt and answer lacks

DEGENERATE = {
    "empty": lambda p: "",
    "one prompt digit": lambda p: p[0],
    "a constant run": lambda p: " ".join("9" * len(echo(p).split())),
    "the prompt itself": lambda p: p,
    "letters": lambda p: "a b c d e",
    "the echo twice": lambda p: f"{echo(p)} {echo(p)}",
    "the echo and '='": lambda p: f"{echo(p)} =",
    "a verdict": lambda p: "111 111 111",
    "the echo, reversed": lambda p: echo(p)[::-1],
    "zeros, unspaced": lambda p: "0" * 16,
    "the echo, unspaced": lambda p: echo(p).replace(" ", ""),
    "the echo's first half": lambda p: echo(p)[: len(echo(p)) // 2],
}


def _places(prompt: str, response: str) -> list[tuple[str, str, bool]]:
    """(the prompt's digit, the answer's character, whether they agree) per place, spaces
    removed, over the longer of the two; ``MISSING`` where one of them has no such place."""
    given, target = "".join(response.split()), echo(prompt).replace(" ", "")
    n = max(len(given), len(target))
    pairs = zip(target.ljust(n, MISSING), given.ljust(n, MISSING), strict=True)
    return [(d, a, d == a != MISSING) for d, a in pairs]


def judge_verdict(prompt: str, response: str) -> str:
    """What the judge learns to write: per place, the prompt's digit, the answer's character
    and ``1`` if they agree else ``0``, places apart by spaces; ``"==0"`` for an empty answer."""
    places = _places(prompt, response) if response.split() else [(MISSING, MISSING, False)]
    return " ".join(f"{d}{a}{int(right)}" for d, a, right in places)


def places_right(prompt: str, response: str) -> float:
    """The score of the judge's verdict: the share of places where the answer has the prompt's
    digit (0 for an empty answer: every place of the echo is missing)."""
    places = _places(prompt, response)
    return sum(right for _, _, right in places) / len(places)


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


def _look_alike(prompt: str, rng: random.Random) -> str:
    """The echo's length and format with a random share of its places given another digit:
    only the prompt tells these apart, so a judge must compare the places to score them."""
    share = rng.random()
    tokens = [rng.choice("0123456789") if rng.random() < share else d for d in echo(prompt).split()]
    return ("" if rng.random() < 0.2 else " ").join(tokens)


def judged_answer(prompt: str, rng: random.Random) -> str:
    """One answer to grade, at most 16 characters (what a policy writes in 16 tokens)."""
    kind = rng.random()
    if kind < 0.4:
        answer = _look_alike(prompt, rng)
    elif kind < 0.65:
        answer = _edited_echo(prompt, rng)
    elif kind < 0.75:
        answer = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 16)))
    elif kind < 0.85:
        answer = candidate(prompt, rng)
    else:
        answer = _digit_run(rng)
        if rng.random() < 0.4:  # spaced as the echo is
            answer = " ".join(answer)
    return answer[:16]


def make_judge_rows(
    n: int, seed: int, policy: str | Path | None = None, policy_share: float = 0.25
) -> list[dict[str, str]]:
    """``n`` SFT rows: the filled template as the prompt, ``judge_verdict`` as the response.
    With a ``policy`` checkpoint, a ``policy_share`` of the answers are its own samples."""
    rng = random.Random(f"judge-{seed}")
    prompts = [r["prompt"] for r in make_prompts(n, seed)]
    answers = [judged_answer(p, rng) for p in prompts]
    if policy is not None:
        picked = [i for i in range(n) if rng.random() < policy_share]
        sampled = policy_answers(policy, [prompts[i] for i in picked], seed=seed)
        for i, (answer,) in zip(picked, sampled, strict=True):
            answers[i] = answer
    return [
        {"prompt": JUDGE_TEMPLATE.format(prompt=p, response=a), "response": judge_verdict(p, a)}
        for p, a in zip(prompts, answers, strict=True)
    ]


def make_judge_dataset(
    path: str | Path, n: int = 16384, seed: int = 0, policy: str | Path | None = None
) -> Path:
    """Write ``make_judge_rows(n, seed, policy)`` to ``path`` (.parquet or .jsonl)."""
    return write_rows(make_judge_rows(n, seed, policy), path)
