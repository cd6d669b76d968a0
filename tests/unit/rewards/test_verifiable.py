"""Built-in verifiable rewards (``rayhf.rewards.verifiable``): answers found where they are
given, compared by value, and nothing earned by answers that only look right."""

from __future__ import annotations

from fractions import Fraction

import pytest

from rayhf.rewards import (
    equivalent,
    exact_match,
    exact_match_reward,
    extract_answer,
    extract_boxed,
    format_reward,
    has_answer,
    math_reward,
    math_score,
    normalize,
    to_number,
)


@pytest.mark.parametrize(
    ("text", "boxed"),
    [
        (r"so \boxed{42}.", "42"),
        (r"\boxed{\frac{1}{\sqrt{2}}}", r"\frac{1}{\sqrt{2}}"),  # nested braces
        (r"first \boxed{1}, then \boxed{2}", "2"),  # the last one counts
        (r"\fbox{7}", "7"),
        (r"\boxed{3", None),  # unclosed
        ("no box here", None),
    ],
)
def test_the_last_box_is_the_answer(text, boxed):
    assert extract_boxed(text) == boxed


def test_a_gsm8k_answer_follows_the_last_marker_and_a_box_wins():
    assert extract_answer("Half of 10 is 5.\n#### 5\n") == "5"
    assert extract_answer("#### 3\nwait\n#### 4") == "4"
    assert extract_answer(r"#### 3 and \boxed{4}") == "4"
    assert extract_answer("####   \n") is None
    assert extract_answer("the answer is 12") is None  # a bare number is not an answer


@pytest.mark.parametrize(
    ("answer", "value"),
    [
        ("42", Fraction(42)),
        ("-3.50", Fraction(-7, 2)),
        ("1,000", Fraction(1000)),
        ("1,234,567.5", Fraction(2469135, 2)),
        (r"\frac{3}{4}", Fraction(3, 4)),
        (r"\dfrac{3}{4}", Fraction(3, 4)),
        (r"-\frac{1}{2}", Fraction(-1, 2)),
        ("3/4", Fraction(3, 4)),
        ("2.5e3", Fraction(2500)),
        ("$12", Fraction(12)),
        (r"50\%", Fraction(50)),
        ("18 dollars", Fraction(18)),
        (r"5\text{ cm}", Fraction(5)),
        (r"90^\circ", Fraction(90)),
        ("7.", Fraction(7)),
        (r"\frac{1}{0}", None),
        (r"\sqrt{2}", None),
        ("x+1", None),
        ("", None),
    ],
)
def test_numbers_read_as_exact_values(answer, value):
    assert to_number(answer) == value


@pytest.mark.parametrize(
    ("answer", "truth", "same"),
    [
        ("0.5", r"\frac{1}{2}", True),
        ("1000", "1,000", True),
        ("18", "18.00", True),
        ("0.333", r"\frac{1}{3}", False),  # exact, not rounded
        (r"\sqrt{2}", r"\sqrt{2}", True),  # not a number: compared as normalized text
        (r"\left(1, 2\right)", "(1,2)", True),
        ("x+1", "x+2", False),
        ("x+1", "1+x", True),  # as expressions (math_verify)
        (r"\frac{1}{\sqrt{2}}", r"\frac{\sqrt{2}}{2}", True),
        ("2+2", "4", True),
        ("4, 5", "4", False),  # hedging between answers is wrong
        (r"\{4, 5\}", "4", False),
        ("x", "5", False),
        ("", "", False),  # nothing is never an answer
        ("12", "21", False),
    ],
)
def test_answers_compare_by_value(answer, truth, same):
    assert equivalent(answer, truth) is same


def test_the_math_score_rewards_only_the_right_final_answer():
    assert math_score(r"2+2 is \boxed{4}", "4") == 1.0
    assert math_score("Natalia sold 48 + 24 = 72.\n#### 72", "She sold ... #### 72") == 1.0
    assert math_score("#### 1,440", "1440") == 1.0
    assert math_score(r"\boxed{\dfrac{6}{8}}", "0.75") == 1.0
    assert math_score("4", "4") == 0.0  # no marked answer: no reward
    assert math_score(r"\boxed{5}", "4") == 0.0
    # listing every candidate earns nothing: only the last marked answer counts
    assert math_score("#### 1 2 3 4 5", "4") == 0.0
    assert math_score(r"\boxed{4} no, \boxed{5}", "4") == 0.0


def test_format_and_exact_match():
    assert has_answer(r"\boxed{x}") == 1.0
    assert has_answer("#### 3") == 1.0
    assert has_answer("3") == 0.0
    assert exact_match(" yes\n", "yes") == 1.0
    assert exact_match("yes.", "yes") == 0.0


def test_normalize_keeps_what_changes_the_value():
    assert normalize(r"$\dfrac{1}{2}$") == r"\frac{1}{2}"
    assert normalize("-1,000") == "-1000"
    assert normalize("(1, 2)") == "(1,2)"
    assert normalize("10^{2}") == "10^{2}"


def test_reward_functions_score_each_response_against_its_own_row():
    responses = ["so \\boxed{1,000}", "#### 3/4", "the answer is 7", "#### 5", "8"]
    answers: list[object] = ["1000", "\\frac{3}{4}", 7, "Janet... #### 5", None]
    prompts = [""] * len(responses)
    assert math_reward(prompts, responses, answers) == [1.0, 1.0, 0.0, 1.0, 0.0]
    assert format_reward(prompts, responses) == [1.0, 1.0, 0.0, 1.0, 0.0]
    assert exact_match_reward(prompts, [" 7 ", "7.0", "8"], [7, "7", None]) == [1.0, 0.0, 0.0]
    with pytest.raises(ValueError):  # one answer per response, or the rows are misaligned
        math_reward(["", ""], ["#### 1", "#### 2"], ["1"])
