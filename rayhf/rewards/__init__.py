"""Built-in rewards: verifiable scores of a response against the row's ground truth.

Reward functions for a config (``models.reward.function``): ``rayhf.rewards:math_reward``
(the final answer equals the row's ``answer``), ``rayhf.rewards:exact_match_reward`` (the whole
response does) and ``rayhf.rewards:format_reward`` (a final answer is given at all).
"""

from rayhf.rewards.verifiable import (
    equivalent,
    exact_match,
    exact_match_reward,
    extract_answer,
    extract_boxed,
    extract_gsm8k,
    format_reward,
    has_answer,
    math_reward,
    math_score,
    normalize,
    to_number,
)

__all__ = [
    "equivalent",
    "exact_match",
    "exact_match_reward",
    "extract_answer",
    "extract_boxed",
    "extract_gsm8k",
    "format_reward",
    "has_answer",
    "math_reward",
    "math_score",
    "normalize",
    "to_number",
]
