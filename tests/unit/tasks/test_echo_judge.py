"""The demo task's judge data (``rayhf.tasks.echo_judge``): grades are the task's reward in ten
steps, and a row's prompt is exactly what the judge interface will show the judge."""

from __future__ import annotations

from collections import Counter

from rayhf.algorithms.judge import JudgeConfig, parse_verdict, render_prompt
from rayhf.tasks.demo import ALPHABET, echo, reward
from rayhf.tasks.echo_judge import (
    GRADES,
    JUDGE_TEMPLATE,
    MAX_ANSWER_CHARS,
    judge_grade,
    make_judge_rows,
)

ROWS = make_judge_rows(2000, seed=3)


def test_grades_are_the_reward_in_ten_steps():
    prompt = "3 1 4 1 5 ="
    assert judge_grade(prompt, "3 1 4 1 5") == 9
    assert judge_grade(prompt, "3 1 4 1 9") == round(9 * 0.8) == 7
    assert judge_grade(prompt, "31415") == 9, "spaces do not count"
    assert judge_grade(prompt, "") == 0 and judge_grade(prompt, "a b c") == 0
    long = "3 1 4 1 5 3 1 4 1"  # 17 characters: a 16-token answer that never ended
    assert len(long) > MAX_ANSWER_CHARS and judge_grade(prompt, long) == 0
    eight = "1 2 3 4 5 6 7 8 ="
    assert len(echo(eight)) == MAX_ANSWER_CHARS and judge_grade(eight, echo(eight)) == 9


def test_rows_are_what_the_judge_is_shown_and_what_it_should_answer():
    cfg = JudgeConfig(template=JUDGE_TEMPLATE, verdict="number", scale=GRADES)
    for row in ROWS[:200]:
        prompt, _, answer = row["prompt"].partition(" = ")
        prompt, answer = prompt + " =", answer.removesuffix(" =")
        assert render_prompt(JUDGE_TEMPLATE, prompt, answer, {}) == row["prompt"]
        true = reward([prompt], [answer], [len(answer) <= MAX_ANSWER_CHARS])[0]
        assert parse_verdict(row["response"], cfg) == round(9 * true) / 9
    assert set("".join(r["prompt"] + r["response"] for r in ROWS)) <= set(ALPHABET)


def test_rows_span_every_grade():
    counts = Counter(r["response"] for r in ROWS)
    assert sorted(counts) == [str(g) for g in range(10)]
    assert min(counts.values()) > 0.02 * len(ROWS), counts
