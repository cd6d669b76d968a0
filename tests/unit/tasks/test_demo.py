"""The demo task's building blocks (``rayhf.tasks.demo``): its tokenizer, the ideal answer, and
the answers its preference pairs are made of. (The reward and the dataset files are tested
with the datasets that load them, in tests/unit/data/.)"""

from __future__ import annotations

import random

import pytest

from rayhf.tasks.demo import (
    ALPHABET,
    MAX_DIGITS,
    MIN_SCORE_GAP,
    build_tokenizer,
    candidate,
    digit_pair,
    digit_share,
    echo,
    make_prompts,
)

PROMPTS = [r["prompt"] for r in make_prompts(200, seed=5)]


def test_the_tokenizer_has_one_token_per_alphabet_character(tmp_path):
    tok = build_tokenizer(tmp_path / "tok")
    assert len(tok) == 26 and (tmp_path / "tok" / "tokenizer.json").is_file()
    ids = tok.encode(ALPHABET, add_special_tokens=False)
    assert len(ids) == len(ALPHABET) and tok.unk_token_id not in ids
    assert tok.decode(ids) == ALPHABET
    assert {tok.bos_token_id, tok.eos_token_id, tok.pad_token_id}.isdisjoint(ids)


@pytest.mark.parametrize(
    "prompt,answer", [("3 1 4 =", "3 1 4"), ("7 =", "7"), ("1 a 2 =", "1 2"), ("=", "")]
)
def test_the_ideal_answer_repeats_the_prompt_s_digits(prompt, answer):
    assert echo(prompt) == answer
    assert digit_share(prompt, answer) == (1.0 if answer else 0.0)


def test_digit_pairs_differ_only_in_how_many_digits_are_absent_from_the_prompt():
    rng = random.Random(0)
    for prompt in PROMPTS:
        better, worse = digit_pair(prompt, rng)
        assert len(better.split()) == len(worse.split()) == len(echo(prompt).split())
        assert all(t.isdigit() for t in (better + " " + worse).split())
        assert digit_share(prompt, better) - digit_share(prompt, worse) >= MIN_SCORE_GAP


def test_candidates_are_runs_of_digits_and_letters_of_every_quality():
    rng = random.Random(1)
    scores = []
    for prompt in PROMPTS:
        answer = candidate(prompt, rng)
        tokens = answer.split()
        assert 1 <= len(tokens) <= MAX_DIGITS
        assert all(len(t) == 1 and t in "0123456789abcdefghij" for t in tokens)
        scores.append(digit_share(prompt, answer))
    assert min(scores) == 0.0 and max(scores) == 1.0 and 0.0 < sum(scores) / len(scores) < 1.0


def test_degenerate_answers_score_little():
    """What a policy could game the echo reward with scores far below the echo's 1.0: a
    constant answer, one prompt digit, letters, the echo cut off before its EOS."""
    from rayhf.tasks.demo import echo, make_prompts, reward

    prompts = [r["prompt"] for r in make_prompts(256, 3)]

    def mean(answers: list[str], finished: list[bool] | None = None) -> float:
        return sum(reward(prompts, answers, finished)) / len(prompts)

    for digit in "0123456789":
        for n in (1, 4, 8):
            assert mean([" ".join([digit] * n)] * len(prompts)) <= 0.3
    assert mean([p.split()[0] for p in prompts]) <= 0.25
    assert mean(["a b c d e"] * len(prompts)) == 0.0
    assert mean([echo(p) for p in prompts], [False] * len(prompts)) == 0.0
    assert mean([echo(p) for p in prompts]) == 1.0
