"""Verifiable rewards. Math: the final answer pulled out of a response and compared with the row's
ground truth, as numbers where both read as numbers, else as normalized LaTeX.

Where the answer is taken from (``extract_answer``): the last ``\\boxed{...}`` (or ``\\fbox``), else
the text after the last GSM8K marker ``####``. Nothing else counts: a bare number at the end of a
response is not an answer, so listing many numbers earns nothing.

How two answers are compared (``equivalent``): both normalized (``normalize``: ``$``, ``\\left``,
``\\!``, ``\\dfrac``, thousands separators, a trailing unit word or ``\\text{...}``, ``%`` and
``^\\circ`` removed); equal as exact fractions when both parse as numbers (``42``, ``-3.50``,
``1,000``, ``\\frac{3}{4}``, ``3/4``, ``2.5e3``), else equal as normalized text or, failing that,
as expressions by ``math_verify`` (Hugging Face's symbolic checker over SymPy).
"""

from __future__ import annotations

import re
import threading
from fractions import Fraction

GSM8K_MARK = "####"
_BOX = re.compile(r"\\(?:boxed|fbox)\s*\{")
_FRAC = re.compile(r"^(-?)\\frac\{(-?[\d.]+)\}\{(-?[\d.]+)\}$")
_SLASH = re.compile(r"^(-?[\d.]+)/(-?[\d.]+)$")
_NUMBER = re.compile(r"^-?(\d+(\.\d*)?|\.\d+)(e-?\d+)?$")
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(\D|$))")
_UNIT = re.compile(r"(?<=\d)\s*[a-zA-Z][a-zA-Z.]*(\s+[a-zA-Z][a-zA-Z.]*)*$")


def extract_boxed(text: str) -> str | None:
    """The contents of the last ``\\boxed{...}`` in ``text`` (braces matched), or None."""
    starts = [m.end() for m in _BOX.finditer(text)]
    if not starts:
        return None
    depth, begin = 1, starts[-1]
    for i in range(begin, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[begin:i].strip()
    return None  # unclosed


def extract_gsm8k(text: str) -> str | None:
    """What follows the last ``####`` up to the end of its line, or None."""
    at = text.rfind(GSM8K_MARK)
    if at < 0:
        return None
    answer = text[at + len(GSM8K_MARK) :].strip().split("\n", 1)[0].strip()
    return answer or None


def extract_answer(text: str) -> str | None:
    """The response's final answer: the last ``\\boxed{}``, else the GSM8K ``####`` answer."""
    boxed = extract_boxed(text)
    return boxed if boxed is not None else extract_gsm8k(text)


def normalize(answer: str) -> str:
    """``answer`` without what does not change its value (see the module docstring)."""
    s = answer.strip().strip("$").strip()
    s = re.sub(r"\\text\{[^{}]*\}\s*$", "", s).strip()  # a trailing \text{unit}
    s = re.sub(r"\\(?:text|mathrm|textbf)\{([^{}]*)\}", r"\1", s)
    for old, new in (("\\left", ""), ("\\right", ""), ("\\!", ""), ("\\,", ""), ("\\;", ""),
                     ("dfrac", "frac"), ("tfrac", "frac"), ("^\\circ", ""), ("^{\\circ}", ""),
                     ("\\%", ""), ("%", ""), ("\\$", "")):  # fmt: skip
        s = s.replace(old, new)
    s = _THOUSANDS.sub("", s)
    s = _UNIT.sub("", s).strip()
    s = s.rstrip(".").strip()
    return re.sub(r"\s+", "", s)


def to_number(answer: str) -> Fraction | None:
    """``answer`` (normalized) as an exact fraction, or None where it is not a plain number."""
    s = normalize(answer)
    try:
        if _NUMBER.match(s):
            return Fraction(s)
        frac = _FRAC.match(s)
        if frac:
            sign = -1 if frac.group(1) else 1
            return sign * Fraction(frac.group(2)) / Fraction(frac.group(3))
        slash = _SLASH.match(s)
        if slash:
            return Fraction(slash.group(1)) / Fraction(slash.group(2))
    except (ValueError, ZeroDivisionError):
        return None
    return None


def equivalent(answer: str, truth: str) -> bool:
    """Whether ``answer`` and ``truth`` name the same value (see the module docstring)."""
    a, b = to_number(answer), to_number(truth)
    if a is not None and b is not None:
        return a == b
    a_text, b_text = normalize(answer), normalize(truth)
    if not a_text or not b_text:
        return False
    return a_text == b_text or _symbolic_equal(a_text, b_text)


MAX_SYMBOLIC_CHARS = 200  # longer answers are compared as text only (sympy can take long)


def _symbolic_equal(answer: str, truth: str) -> bool:
    """``math_verify``'s verdict on two LaTeX answers (``1/\\sqrt{2}`` = ``\\sqrt{2}/2``, ``x+1``
    = ``1+x``). Its time limit is a SIGALRM, which only the main thread may set; elsewhere the
    length bound is the only limit."""
    if max(len(answer), len(truth)) > MAX_SYMBOLIC_CHARS:
        return False
    from math_verify import parse, verify

    limit = 5 if threading.current_thread() is threading.main_thread() else None
    gold = parse(f"${truth}$", parsing_timeout=limit)  # type: ignore[arg-type]
    given = parse(f"${answer}$", parsing_timeout=limit)  # type: ignore[arg-type]
    return bool(gold and given and verify(gold, given, timeout_seconds=limit))


def math_score(response: str, truth: str) -> float:
    """1.0 when the response's final answer equals ``truth``, else 0.0 (no answer: 0.0).
    ``truth`` may itself be a GSM8K solution (``... #### 72``): its answer is used."""
    answer = extract_answer(response)
    if answer is None:
        return 0.0
    truth = extract_gsm8k(truth) or truth
    return 1.0 if equivalent(answer, truth) else 0.0


def has_answer(response: str) -> float:
    """A format check: 1.0 when the response gives a final answer where ``extract_answer``
    looks for one, else 0.0."""
    return 0.0 if extract_answer(response) is None else 1.0


def exact_match(response: str, truth: str) -> float:
    """1.0 when the whole response, stripped, equals ``truth`` stripped, else 0.0."""
    return 1.0 if response.strip() == truth.strip() else 0.0


# Reward functions (``models.<role>.function: rayhf.rewards:<name>``): one score per sample, the
# ground truth from the dataset row's ``answer`` column (a number, an expression, or a GSM8K
# solution ending in ``#### value``); a row whose answer is empty scores 0.


def math_reward(prompts: list[str], responses: list[str], answer: list[object]) -> list[float]:
    """``math_score`` of every response against its row's ``answer``."""
    del prompts
    return [
        math_score(r, str(a)) if a is not None else 0.0
        for r, a in zip(responses, answer, strict=True)
    ]


def exact_match_reward(
    prompts: list[str], responses: list[str], answer: list[object]
) -> list[float]:
    """``exact_match`` of every whole response against its row's ``answer``."""
    del prompts
    return [
        exact_match(r, str(a)) if a is not None else 0.0
        for r, a in zip(responses, answer, strict=True)
    ]


def format_reward(prompts: list[str], responses: list[str]) -> list[float]:
    """``has_answer`` of every response: a boxed or ``####`` final answer, whatever its value."""
    del prompts
    return [has_answer(r) for r in responses]
