"""The judge's prompt and verdict parsing, and the settings it refuses."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from rayhf.algorithms.judge import JudgeConfig, parse_verdict, render_prompt
from rayhf.errors import RayhfError


@pytest.mark.parametrize(
    ("text", "score"),
    [
        ("Yes.", 1.0),
        ("  no, it is wrong", 0.0),
        ("The answer is YES", 1.0),  # the first word that is a choice
        ("maybe", None),
        ("", None),
    ],
)
def test_a_choice_verdict(text, score):
    assert parse_verdict(text, JudgeConfig()) == score


@pytest.mark.parametrize(
    ("text", "score"),
    [("7", 0.7), ("score: 10/10", 1.0), ("-2 points", -0.2), ("2.5", 0.25), ("none", None)],
)
def test_a_number_verdict_over_its_scale(text, score):
    got = parse_verdict(text, JudgeConfig(verdict="number", scale=10))
    assert got == (None if score is None else pytest.approx(score))


MARKS = {"1": 1.0, "0": 0.0}


@pytest.mark.parametrize(
    ("text", "score"),
    [("331 111 490", 2 / 3), ("1", 1.0), ("  0 0 1 1\n", 0.5), ("331 11x", None), ("", None)],
)
def test_a_marks_verdict_is_the_mean_of_its_steps_last_characters(text, score):
    got = parse_verdict(text, JudgeConfig(verdict="marks", choices=MARKS))
    assert got == (None if score is None else pytest.approx(score))


def test_the_prompt_shows_the_sample_and_its_row():
    template = "Q: {prompt}\nA: {response}\nKey: {answer}\nRight?"
    text = render_prompt(template, "2+2", "4", {"answer": "4", "source": "x"})
    assert text == "Q: 2+2\nA: 4\nKey: 4\nRight?"
    with pytest.raises(RayhfError, match=r"judge.template names \{gold\}.*have: answer"):
        render_prompt("{response} {gold}", "p", "r", {"answer": "4"})


def test_settings_the_judge_refuses():
    with pytest.raises(ValidationError, match=r"judge\.template: it must show the judge"):
        JudgeConfig(template="{prompt} only")
    with pytest.raises(ValidationError, match=r"judge\.choices"):
        JudgeConfig(choices={})
    with pytest.raises(ValidationError, match=r"judge\.choices: a marks verdict's keys are char"):
        JudgeConfig(verdict="marks", choices={"yes": 1.0, "n": 0.0})
    with pytest.raises(ValidationError, match="scale"):
        JudgeConfig(scale=0)
