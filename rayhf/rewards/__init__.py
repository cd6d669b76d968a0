"""Built-in rewards: verifiable scores of a response against the row's ground truth."""

from rayhf.rewards.verifiable import (
    equivalent,
    exact_match,
    extract_answer,
    extract_boxed,
    extract_gsm8k,
    has_answer,
    math_score,
    normalize,
    to_number,
)

__all__ = [
    "equivalent",
    "exact_match",
    "extract_answer",
    "extract_boxed",
    "extract_gsm8k",
    "has_answer",
    "math_score",
    "normalize",
    "to_number",
]
