"""The shapes a decode step runs at, and the scoring head's slice: pure arithmetic shared by
the engine (``rayhf.parallel.decode``, ``rayhf.parallel.model``) and the planner, which prices
what it runs.

A step runs over the first ``rows`` slots and attends over the first ``keys`` key slots. An
eager step uses exactly the rows in use and the keys filled; a compiled or captured step rounds
both up (``row_bucket``, ``key_bucket``), so one graph serves many steps.
"""

from __future__ import annotations

import functools

# The scoring head (``ShardedModel.score``) computes the LM head over at most this many logits at
# a time (tokens x vocabulary): 2**24 fp32 logits are 64 MiB, 110 tokens of a 151,936 vocabulary.
LOGIT_CHUNK = 2**24

CHECK_EVERY = 8  # decode steps between looks at which rows ended: one host sync per 8 tokens
DELTA_CHUNK = 64  # a DeltaNet layer's chunk (``rayhf.parallel.delta_net``): Hugging Face's and
# flash-linear-attention's size
KEY_BLOCK = 64  # a bucketed step attends over the filled key slots rounded up to this many
ROW_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)  # captured widths


def row_bucket(n_rows: int, bucketed: bool) -> int:
    """Rows a step runs over: the rows in use, or (bucketed) the next width up."""
    if not bucketed:
        return n_rows
    return next((w for w in ROW_BUCKETS if w >= n_rows), n_rows)


def key_bucket(n_keys: int, capacity: int, bucketed: bool) -> int:
    """Key slots a step attends over: the filled ones, or (bucketed) whole blocks of them."""
    if not bucketed:
        return n_keys
    return min(-(-n_keys // KEY_BLOCK) * KEY_BLOCK, capacity)


def cache_capacity(longest_prompt: int, max_new: int, bucketed: bool) -> int:
    """Key slots a call's cache rows hold: prompt and response, in whole blocks if bucketed."""
    n = longest_prompt + max_new
    return -(-n // KEY_BLOCK) * KEY_BLOCK if bucketed else n


@functools.lru_cache(maxsize=4096)
def mean_keys(prompt_len: int, gen_len: int, bucketed: bool) -> float:
    """Key slots a step attends over, averaged over a call's steps (every row running to
    ``gen_len``): step ``t`` sees the prompt and its first ``t + 1`` tokens."""
    capacity = cache_capacity(prompt_len, gen_len, bucketed)
    steps = range(1, gen_len)  # the prefill chooses token 0; steps feed tokens 0..gen_len-2
    total = sum(key_bucket(prompt_len + t, capacity, bucketed) for t in steps)
    return total / max(1, len(steps))
