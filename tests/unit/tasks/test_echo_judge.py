"""The demo task's judge data (``rayhf.tasks.echo_judge``): the verdict reasons place by place,
its marks score the share of places right, a lower bound of the task's reward that is 1 exactly
when the reward is; and a row's prompt is exactly what the judge interface will show the judge."""

from __future__ import annotations

import pytest

from rayhf.algorithms.judge import JudgeConfig, parse_verdict, render_prompt
from rayhf.tasks.demo import ALPHABET, echo_score
from rayhf.tasks.echo_judge import (
    JUDGE_TEMPLATE,
    MARKS,
    judge_verdict,
    make_judge_rows,
    places_right,
)

ROWS = make_judge_rows(2000, seed=3)
CFG = JudgeConfig(template=JUDGE_TEMPLATE, verdict="marks", choices=MARKS)


def _split(row: dict[str, str]) -> tuple[str, str]:
    """(prompt, answer) of a row's filled template ``"<prompt><answer> ="``."""
    prompt, _, answer = row["prompt"].partition("=")
    return prompt + "=", answer.removesuffix(" =")


@pytest.mark.parametrize(
    ("answer", "verdict"),
    [
        ("3 1 4 1 5", "331 111 441 111 551"),
        ("3 1 4 1 9", "331 111 441 111 590"),
        ("31415", "331 111 441 111 551"),  # spaces do not count
        ("3 4 1 5", "331 140 410 150 5=0"),  # a shift costs every later place
        ("3 1 4 1 5 3", "331 111 441 111 551 =30"),
        ("a b", "3a0 1b0 4=0 1=0 5=0"),
        ("", "==0"),
    ],
)
def test_the_verdict_copies_both_sides_of_each_place_and_marks_it(answer, verdict):
    assert judge_verdict("3 1 4 1 5 =", answer) == verdict
    assert parse_verdict(verdict, CFG) == pytest.approx(places_right("3 1 4 1 5 =", answer))


def test_places_right_bounds_the_reward_from_below_and_is_1_where_it_is():
    for row in ROWS:
        prompt, answer = _split(row)
        score, places = echo_score(prompt, answer), places_right(prompt, answer)
        assert places <= score + 1e-9, (prompt, answer)
        assert (places == 1.0) == (score == 1.0), (prompt, answer)


def test_rows_are_what_the_judge_is_shown_and_what_it_should_answer():
    for row in ROWS[:200]:
        prompt, answer = _split(row)
        assert render_prompt(JUDGE_TEMPLATE, prompt, answer, {}) == row["prompt"]
        assert parse_verdict(row["response"], CFG) == pytest.approx(places_right(prompt, answer))
    assert set("".join(r["prompt"] + r["response"] for r in ROWS)) <= set(ALPHABET)


def test_rows_span_the_scores_and_hold_answers_only_the_prompt_tells_apart():
    scores = [parse_verdict(r["response"], CFG) for r in ROWS]
    assert all(s is not None for s in scores)
    tenths = {round(10 * s) for s in scores if s is not None}
    assert tenths == set(range(11)), sorted(tenths)
    assert sum(s == 1.0 for s in scores) > 0.05 * len(ROWS)
    # same length and format as the echo, some places wrong: a judge must compare to score them
    alike = [r for r in ROWS if len(_split(r)[1]) == len(_split(r)[0]) - 2]
    assert len(alike) > 0.2 * len(ROWS)
