"""The batchers: concurrent requests share a batch, each gets its own row back, and a failing
generator fails the requests of its batch only; rounds give the same trajectories whatever the
environments' delays."""

from __future__ import annotations

import asyncio
import random

import pytest

from rayhf.envs.batcher import ArrivalBatcher, RoundBatcher
from rayhf.envs.env import EnvConfig, Step, rollouts
from rayhf.models.tokenizer import CHATML, train_bpe_tokenizer
from rayhf.sampling import GenerateOutput, GenerationConfig

TOK = train_bpe_tokenizer(["go ok the model said"] * 20, 300, chat_format=CHATML)


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


class Drawn:
    """Samples as an index-keyed engine does: each row's ids are a hash of (seed, its index in
    the call, its prompt), so a row's answer depends on its batch-mates and the call's seed."""

    def __init__(self) -> None:
        self.calls: list[int] = []

    def generate(self, prompts, cfg, seed) -> GenerateOutput:
        self.calls.append(len(prompts))
        rows = [random.Random(hash((seed, i, tuple(p)))) for i, p in enumerate(prompts)]
        ids = [[r.randrange(3, 40) for _ in range(r.randrange(1, 4))] for r in rows]
        return GenerateOutput(ids, [[-0.5] * len(x) for x in ids], [False] * len(ids))


class SlowEnv:
    """Ends after a number of turns set by its row; each step takes a random delay (``DELAYS``'s
    draws), and its reward is a hash of what the model said."""

    def __init__(self, row: dict) -> None:
        self.turns, self.said = row["turns"], []

    async def reset(self) -> list[dict]:
        await asyncio.sleep(DELAYS.random() * 0.01)
        return [{"role": "user", "content": "go"}]

    async def step(self, turn: str) -> Step:
        await asyncio.sleep(DELAYS.random() * 0.01)
        self.said.append(turn)
        if len(self.said) == self.turns:
            return Step(reward=float(hash(tuple(self.said)) % 1000), done=True)
        return Step([{"role": "tool", "content": "ok"}])


DELAYS = random.Random(0)


def _rounds_run(delay_seed: int, seed: int = 3) -> tuple[list, Drawn]:
    DELAYS.seed(delay_seed)
    gen = Drawn()
    cfg = EnvConfig(cls=f"{__name__}:SlowEnv", max_turns=5, max_tokens=4096, concurrency=3)
    rows = [{"turns": 1 + i % 4} for i in range(10)]

    async def go():
        async with RoundBatcher(gen, GenerationConfig(), seed=seed, trajectories=10) as b:
            return await rollouts(rows, b, TOK, cfg)

    outs = asyncio.run(go())
    return [(o.trajectory.tokens, o.trajectory.logprobs, o.reward, o.ended) for o in outs], gen


def test_rounds_give_the_same_trajectories_whatever_the_environments_delays():
    first, gen = _rounds_run(delay_seed=1)
    assert gen.calls == [10, 7, 4, 2]  # every live trajectory, each round: 1-4 turns
    for delay_seed in (2, 3):
        again, _ = _rounds_run(delay_seed)
        assert again == first
    other, _ = _rounds_run(delay_seed=1, seed=4)
    assert other != first  # the seed, not the timing, decides


def test_a_round_waits_for_every_live_trajectory_and_none_that_ended():
    gen = Echo()

    async def go():
        async with RoundBatcher(gen, GenerationConfig(), version=2, trajectories=3) as b:
            b.finish(1)
            late = asyncio.create_task(b.bind(2)([9, 9]))
            await asyncio.sleep(0.02)
            assert not late.done() and gen.sizes == []  # trajectory 0 has not asked yet
            first = await b.bind(0)([5])
            return first, await late

    assert asyncio.run(go()) == (([1, 5], [-1.0, -2.0], 2), ([2, 9], [-1.0, -2.0], 2))
    assert gen.sizes == [2]
