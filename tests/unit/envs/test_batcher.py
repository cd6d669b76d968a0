"""The batchers: concurrent requests share a batch, each gets its own row back, and a failing
generator fails the requests of its batch only; rounds give the same trajectories whatever the
environments' delays, and a trajectory that ends or is cancelled while others wait leaves its
round."""

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


async def _until(condition) -> None:
    """Steps the event loop until ``condition()`` holds (no clock: a count of loop steps)."""
    for _ in range(1000):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError("the condition never held")


async def _looked(b: RoundBatcher) -> None:
    """Until the batcher has taken its last wake-up, and so decided whether a round starts."""
    assert b._wake is not None
    await _until(lambda: not b._wake.is_set())


def test_a_round_waits_for_every_live_trajectory_and_none_that_ended():
    gen = Echo()

    async def go():
        async with RoundBatcher(gen, GenerationConfig(), version=2, trajectories=3) as b:
            b.finish(1)
            late = asyncio.create_task(b.bind(2)([9, 9]))
            await _until(lambda: 2 in b.waiting)
            await _looked(b)
            assert not late.done() and gen.sizes == []  # trajectory 0 has not asked yet
            first = await b.bind(0)([5])
            return first, await late

    assert asyncio.run(go()) == (([1, 5], [-1.0, -2.0], 2), ([2, 9], [-1.0, -2.0], 2))
    assert gen.sizes == [2]


def test_a_request_cancelled_while_it_waits_leaves_its_round():
    gen = Echo()

    async def go():
        async with RoundBatcher(gen, GenerationConfig(), trajectories=4) as b:
            asks = [asyncio.create_task(b.bind(t)([t] * (t + 1))) for t in (0, 1, 2)]
            await _until(lambda: len(b.waiting) == 3)
            asks[1].cancel()  # as ``rollouts`` does when a trajectory's task is cancelled:
            with pytest.raises(asyncio.CancelledError):
                await asks[1]
            b.finish(1)  # ... it then tells the batcher the trajectory has ended
            b.finish(2)  # ended while its request waited: the request leaves too
            with pytest.raises(asyncio.CancelledError):
                await asks[2]
            await _looked(b)
            assert b.waiting.keys() == {0} and gen.sizes == []  # trajectory 3 is still live
            last = await b.bind(3)([3, 3, 3, 3])
            return await asks[0], last

    assert asyncio.run(go()) == (([1, 0], [-1.0, -2.0], 0), ([4, 3], [-1.0, -2.0], 0))
    assert gen.sizes == [2]  # trajectories 0 and 3 only, in one round


class Flaky(SlowEnv):
    """Row ``fails`` ends its trajectory in its second step (hangs past the timeout, or
    raises) while the other trajectories' next turns wait in a round."""

    def __init__(self, row: dict) -> None:
        super().__init__(row)
        self.fails = row.get("fails")

    async def step(self, turn: str) -> Step:
        if len(self.said) == 1 and self.fails == "hangs":
            await asyncio.sleep(3600)
        if len(self.said) == 1 and self.fails == "raises":
            raise RuntimeError("the environment broke")
        return await super().step(turn)


@pytest.mark.parametrize(("fails", "ended"), [("hangs", "timeout"), ("raises", "error")])
def test_a_trajectory_whose_environment_fails_mid_round_lets_the_others_go_on(fails, ended):
    gen = Drawn()
    cfg = EnvConfig(cls=f"{__name__}:Flaky", max_turns=5, max_tokens=4096, step_timeout_s=0.2)
    rows = [{"turns": 3}, {"turns": 3, "fails": fails}, {"turns": 3}]

    async def go():
        async with RoundBatcher(gen, GenerationConfig(), trajectories=3) as b:
            return await asyncio.wait_for(rollouts(rows, b, TOK, cfg), 30)

    outs = asyncio.run(go())
    assert [o.ended for o in outs] == ["done", ended, "done"]
    assert [o.trajectory.turns for o in outs] == [3, 2, 3]
    assert gen.calls == [3, 3, 2]  # the third round without the failed trajectory
