"""The demo task, "echo the digits": small enough that a ~1M-parameter Llama learns it from scratch.

A prompt is 4-8 random digits separated by spaces and closed by ``=``, e.g. ``"3 1 4 1 5 ="``;
the ideal response repeats them, ``"3 1 4 1 5"``, then ends (EOS).

The reward (``reward``, scored by ``echo_score``) is verifiable and grades the whole answer:
the response's characters with spaces removed, against the prompt's digits in order, as
``1 - edit distance / length of the longer`` (Levenshtein over characters), and 0 when the
response did not end with EOS. So every digit must be right, in its place, with nothing
missing or added:

* the echo scores 1.0; one digit wrong, missing or extra out of 5 scores 0.8;
* one prompt digit (``"9"``) scores at most 1/4 (prompts hold 4-8 digits), ``"9 9 9 9"`` only
  what its matches in place earn, a run of letters 0, an answer cut off at the length limit 0;
* a random policy over ``ALPHABET`` scores about 0.02 (most of its answers never end).

``digit_share`` is the task's older, softer score (the share of the response's characters that
are digits of the prompt, in any order): it labels the preference pairs below, where a graded
difference between two answers is what matters, and is not the reward.

Reward contract: a reward function referenced as ``module:function`` in a config (this one is
``rayhf.tasks.demo:reward``) takes ``(prompts, responses)``, two equally long lists of
strings (prompt text without bos; decoded response with the eos removed), and returns one float
per sample, in the same order; it may also name ``finished`` (one bool per sample: the response
ended with EOS) and dataset columns (``rayhf.algorithms.reward``).

The same prompts (``make_prompts(n, seed)``) back three more datasets:

* ``make_sft_dataset``: rows ``{"prompt", "response"}``, the response being the ideal echo
  (``"3 1 4 ="`` -> ``"3 1 4"``), for supervised fine-tuning;
* ``make_preference_dataset``: rows ``{"prompt", "chosen", "rejected"}`` for DPO and reward
  models: two answers whose digit shares differ by at least 0.25, the better one chosen. Half
  are equally long runs of prompt digits with more or fewer swapped for absent digits (only the
  prompt tells them apart); half are free candidates: the echo or a random run of the prompt's
  digits with a random share swapped for absent digits or letters. So the pairs span
  what a policy may emit (repeats, wrong digits, letters, short and long answers), and a reward
  model that ranks them must learn the task's own score, not a quirk of one kind of pair: PPO
  against a model trained on echo-vs-corrupted-echo pairs alone was measured to raise the
  learned reward while the true score fell. A prompt has at most 8 of the 10 digits, so absent
  digits always exist.
* ``make_policy_preference_dataset``: the same rows, but the two answers are the best and the
  worst of a policy checkpoint's own samples (what the pipeline's reward model trains on).

Every character of all three datasets (digits, letters, space, ``=``) is in ``ALPHABET``.
"""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import TYPE_CHECKING

from rapidfuzz.distance import Levenshtein

from rayhf.data.datasets import write_rows
from rayhf.models.tokenizer import build_char_tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

ALPHABET = "0123456789abcdefghij ="  # letters are distractors the policy must learn to avoid
MIN_DIGITS, MAX_DIGITS = 4, 8


def build_tokenizer(out_dir: str | Path | None = None) -> PreTrainedTokenizerFast:
    """The character tokenizer over ``ALPHABET`` (26 ids: 4 specials + 22 characters)."""
    return build_char_tokenizer(ALPHABET, out_dir)


def make_prompts(n: int, seed: int) -> list[dict[str, str]]:
    """``n`` rows ``{"prompt": "d d ... d ="}``, a pure function of ``seed``."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        digits = [str(rng.randrange(10)) for _ in range(rng.randint(MIN_DIGITS, MAX_DIGITS))]
        rows.append({"prompt": " ".join([*digits, "="])})
    return rows


def make_dataset(path: str | Path, n: int = 512, seed: int = 0) -> Path:
    """Write ``make_prompts(n, seed)`` to ``path`` (.parquet or .jsonl) and return the path."""
    return write_rows(make_prompts(n, seed), path)


def echo(prompt: str) -> str:
    """The ideal response: the prompt's digits, space-separated, without the closing ``=``."""
    return " ".join(c for c in prompt.split() if c.isdigit())


def make_sft_rows(n: int, seed: int) -> list[dict[str, str]]:
    """``make_prompts(n, seed)`` with ``"response"``, the ideal echo of each prompt."""
    return [{"prompt": r["prompt"], "response": echo(r["prompt"])} for r in make_prompts(n, seed)]


MIN_SCORE_GAP = 0.25  # a pair's digit shares differ at least this much


def candidate(prompt: str, rng: random.Random) -> str:
    """A response a policy might give: the echo or a run of prompt digits, partly corrupted."""
    digits = echo(prompt).split()
    if rng.random() < 0.3:
        tokens = list(digits)
    else:
        tokens = [rng.choice(digits) for _ in range(rng.randint(1, MAX_DIGITS))]
    absent = [d for d in "0123456789" if d not in prompt]
    share = rng.choice([0.0, rng.random(), 1.0])
    for i in range(len(tokens)):
        if rng.random() < share:
            tokens[i] = rng.choice(absent) if rng.random() < 0.5 else rng.choice("abcdefghij")
    return " ".join(tokens)


def digit_pair(prompt: str, rng: random.Random) -> tuple[str, str]:
    """(better, worse): one run of prompt digits with fewer / more digits swapped for absent ones.

    Both are digits only and equally long, so only the prompt tells them apart.
    """
    digits = echo(prompt).split()
    absent = [d for d in "0123456789" if d not in prompt]
    n, gap = len(digits), math.ceil(MIN_SCORE_GAP * len(digits))
    base = [rng.choice(digits) for _ in range(n)]
    k_better = rng.randint(0, n - gap)
    k_worse = rng.randint(k_better + gap, n)
    order = rng.sample(range(n), n)
    better, worse = list(base), list(base)
    for i, pos in enumerate(order[:k_worse]):
        worse[pos] = rng.choice(absent)
        if i < k_better:
            better[pos] = worse[pos]
    return " ".join(better), " ".join(worse)


def make_preference_rows(n: int, seed: int) -> list[dict[str, str]]:
    """``make_prompts(n, seed)`` with two answers each, the higher-scoring one ``chosen``.

    Half the pairs are ``digit_pair``s (only the prompt separates them); half are two free
    ``candidate``s (repeats, letters, lengths: what a policy may emit).
    """
    rng = random.Random(f"pairs-{seed}")  # apart from the prompts' stream, which stays shared
    rows = []
    for row in make_prompts(n, seed):
        prompt = row["prompt"]
        if rng.random() < 0.5:
            chosen, rejected = digit_pair(prompt, rng)
        else:
            while True:
                a, b = candidate(prompt, rng), candidate(prompt, rng)
                if abs(digit_share(prompt, a) - digit_share(prompt, b)) >= MIN_SCORE_GAP:
                    break
            chosen, rejected = (a, b) if digit_share(prompt, a) > digit_share(prompt, b) else (b, a)
        rows.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
    return rows


def policy_answers(
    policy: str | Path, prompts: list[str], max_new_tokens: int = 16, greedy: bool = False,
    samples: int = 1, seed: int = 0,
) -> list[list[str]]:  # fmt: skip
    """``samples`` answers per prompt from the ``policy`` checkpoint (its own tokenizer; bos +
    prompt, as the PPO dataset feeds it), decoded without special tokens."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rayhf.sampling import GenerationConfig, generate

    tok = AutoTokenizer.from_pretrained(policy, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(policy, local_files_only=True)
    ids = [[tok.bos_token_id, *tok.encode(p, add_special_tokens=False)] for p in prompts]
    cfg = GenerationConfig(max_new_tokens=max_new_tokens, greedy=greedy)
    answers: list[list[str]] = [[] for _ in prompts]
    for k in range(samples):
        for lo in range(0, len(prompts), 256):
            call_seed = seed * 1_000_003 + k * len(prompts) + lo  # one seed per call
            chunk = ids[lo : lo + 256]
            out = generate(model, chunk, cfg, tok.eos_token_id, tok.pad_token_id, call_seed)
            for i, text in enumerate(tok.batch_decode(out.tokens, skip_special_tokens=True)):
                answers[lo + i].append(text)
    return answers


def make_policy_preference_rows(
    n: int, seed: int, policy: str | Path, samples: int = 4, max_new_tokens: int = 16
) -> list[dict[str, str]]:
    """Pairs as RLHF collects them: ``samples`` answers per prompt sampled from the ``policy``
    checkpoint (the SFT model), the best and the worst by digit share (the labeller) as chosen
    and rejected when they differ by at least ``MIN_SCORE_GAP``; other prompts get a
    ``make_preference_rows`` pair. A reward model trained on these has seen what the policy it
    will judge actually writes."""
    prompts = [r["prompt"] for r in make_prompts(n, seed)]
    answers = policy_answers(policy, prompts, max_new_tokens, samples=samples, seed=seed)
    rows = []
    for prompt, options, other in zip(
        prompts, answers, make_preference_rows(n, seed), strict=True
    ):  # fmt: skip
        best = max(options, key=lambda a: digit_share(prompt, a))
        worst = min(options, key=lambda a: digit_share(prompt, a))
        if digit_share(prompt, best) - digit_share(prompt, worst) >= MIN_SCORE_GAP:
            rows.append({"prompt": prompt, "chosen": best, "rejected": worst})
        else:
            rows.append(other)
    return rows


def make_policy_preference_dataset(
    path: str | Path, policy: str | Path, n: int = 512, seed: int = 0, samples: int = 4
) -> Path:
    """Write ``make_policy_preference_rows`` to ``path`` (.parquet or .jsonl); return the path."""
    return write_rows(make_policy_preference_rows(n, seed, policy, samples), path)


def make_sft_dataset(path: str | Path, n: int = 512, seed: int = 0) -> Path:
    """Write ``make_sft_rows(n, seed)`` to ``path`` (.parquet or .jsonl) and return the path."""
    return write_rows(make_sft_rows(n, seed), path)


def make_preference_dataset(path: str | Path, n: int = 512, seed: int = 0) -> Path:
    """Write ``make_preference_rows(n, seed)`` to ``path`` (.parquet or .jsonl); return the path."""
    return write_rows(make_preference_rows(n, seed), path)


def digit_share(prompt: str, response: str) -> float:
    """Share of the response's non-space characters that are digits of the prompt (labels the
    preference pairs; not the reward)."""
    chars = [c for c in response if not c.isspace()]
    if not chars:
        return 0.0
    allowed = {c for c in prompt if c.isdigit()}
    return sum(c in allowed for c in chars) / len(chars)


def digit_share_reward(prompts: list[str], responses: list[str]) -> list[float]:
    """``digit_share`` per sample: the score the preference pairs were labelled by, which the
    pipeline logs as the true score of a policy trained against a reward model of those pairs."""
    return [digit_share(p, r) for p, r in zip(prompts, responses, strict=True)]


def echo_score(prompt: str, response: str) -> float:
    """The whole answer against the echo: ``1 - edit distance / longer length`` over the
    characters with spaces removed; an empty response scores 0."""
    target = echo(prompt).replace(" ", "")
    given = "".join(response.split())
    if not given or not target:
        return 0.0
    return float(Levenshtein.normalized_similarity(given, target))


def reward(
    prompts: list[str], responses: list[str], finished: list[bool] | None = None
) -> list[float]:
    """One score in [0, 1] per sample: ``echo_score``, or 0 where the response did not end with
    EOS (``finished``; called without it, every response counts as finished)."""
    assert len(prompts) == len(responses), f"{len(prompts)} prompts, {len(responses)} responses"
    done = [True] * len(prompts) if finished is None else finished
    return [
        echo_score(p, r) if end else 0.0 for p, r, end in zip(prompts, responses, done, strict=True)
    ]
