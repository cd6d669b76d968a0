"""The arrival batcher: concurrent requests share a batch, each gets its own row back, and a
failing generator fails the requests of its batch only."""

from __future__ import annotations

import asyncio

import pytest

from rayhf.envs.batcher import ArrivalBatcher
from rayhf.sampling import GenerateOutput, GenerationConfig


class Echo:
    """Answers each prompt with its length and last token; records batch sizes."""

    def __init__(self, fail_on: int | None = None) -> None:
        self.sizes: list[int] = []
        self.fail_on = fail_on

    def generate(self, prompts, cfg, seed) -> GenerateOutput:
        self.sizes.append(len(prompts))
        if self.fail_on is not None and any(p[-1] == self.fail_on for p in prompts):
            raise RuntimeError("decode failed")
        return GenerateOutput(
            [[len(p), p[-1]] for p in prompts],
            [[-1.0, -2.0] for _ in prompts],
            [True] * len(prompts),
        )


def test_concurrent_requests_share_a_batch_and_get_their_own_rows():
    gen = Echo()

    async def go():
        async with ArrivalBatcher(gen, GenerationConfig(), version=4) as b:
            first = await asyncio.gather(*(b([7] * n + [n]) for n in range(1, 6)))
            second = await b([1, 2, 3])
            return first, second, b

    first, second, b = asyncio.run(go())
    assert first == [([n + 1, n], [-1.0, -2.0], 4) for n in range(1, 6)]
    assert second == ([3, 3], [-1.0, -2.0], 4)
    assert gen.sizes[0] >= 3 and sum(gen.sizes) == 6 and b.batches == len(gen.sizes)
    assert b.busy_seconds > 0


def test_a_failing_generator_fails_only_its_batch_s_requests():
    gen = Echo(fail_on=9)

    async def go():
        async with ArrivalBatcher(gen, GenerationConfig(), max_batch=1) as b:
            bad, good = await asyncio.gather(b([9]), b([5]), return_exceptions=True)
            return bad, good

    bad, good = asyncio.run(go())
    assert isinstance(bad, RuntimeError) and good == ([1, 5], [-1.0, -2.0], 0)


def test_the_batcher_is_used_inside_async_with():
    with pytest.raises(AssertionError, match="async with"):
        asyncio.run(ArrivalBatcher(Echo(), GenerationConfig())([1]))
