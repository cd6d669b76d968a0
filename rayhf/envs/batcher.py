"""One generator serving many trajectories, joined one of two ways (``env.joining``):

- ``RoundBatcher`` (``rounds``, reproducible): a round's batch is the next request of every
  live trajectory, taken once each of them has sent it or ended, ordered by trajectory, split
  into generate calls of at most ``max_batch`` prompts; the batcher's ``k``-th call samples
  with the call's seed + ``k``. What a trajectory samples depends on the seed and the
  trajectories' own contents, never on which environment answered first.
- ``ArrivalBatcher`` (``arrival``, faster under slow environments): every request waiting when
  a batch starts joins it, so no trajectory waits for another's environment; a request that
  arrives while a batch decodes joins that call at its next look at the rows when the generator
  streams (the native one: continuous batching), else the next call. Which rows share a batch,
  and so which draws a row gets, follows the timing.

    async with RoundBatcher(generator, cfg, trajectories=len(rows)) as batcher:
        outcomes = await rollouts(rows, batcher, tok, env_cfg)

The generator's ``generate`` blocks (it decodes), so it runs in a worker thread while the event
loop keeps stepping environments. ``busy_seconds`` is the time spent decoding, for the call's
generator idle share.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar, runtime_checkable

from rayhf.sampling import GenerateOutput, GenerationConfig


class Generator(Protocol):
    def generate(
        self, prompts: list[list[int]], cfg: GenerationConfig, seed: int
    ) -> GenerateOutput: ...


Answer = tuple[list[int], list[float], int]  # sampled ids, their log-probs, policy version


@runtime_checkable
class Batcher(Protocol):
    """What ``rollouts`` asks a batcher: a ``Generate`` per trajectory (``bind``), and word when
    a trajectory has ended and will ask no more (``finish``)."""

    def bind(self, trajectory: int) -> Callable[[list[int]], Awaitable[Answer]]: ...

    def finish(self, trajectory: int) -> None: ...


S = TypeVar("S", bound="_Served")


class _Served:
    """A batcher's lifetime: ``async with`` starts its ``_serve`` loop, woken by ``_wake``,
    and cancels it at the end."""

    _wake: asyncio.Event | None = None
    _task: asyncio.Task[None] | None = None

    async def _serve(self) -> None:
        raise NotImplementedError

    async def __aenter__(self: S) -> S:
        self._wake = asyncio.Event()
        self._task = asyncio.create_task(self._serve())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


class RoundBatcher(_Served):
    """Rounds of one request per live trajectory (``bind(i)(prompt) -> (ids, logprobs,
    version)``): a round starts once each of the ``trajectories`` has asked or ``finish``-ed,
    its prompts ordered by trajectory, at most ``max_batch`` to a generate call; call ``k`` of
    the batcher samples with ``seed + k``. The same prompts in the same order with the same
    seeds: a seeded call's trajectories do not depend on the environments' timing."""

    def __init__(
        self,
        generator: Generator,
        cfg: GenerationConfig,
        version: int = 0,
        max_batch: int = 256,
        seed: int = 0,
        trajectories: int = 1,
    ) -> None:
        self.generator, self.cfg, self.version = generator, cfg, version
        self.max_batch, self.seed = max_batch, seed
        self.trajectories = trajectories  # ``rollouts`` checks it is one per row
        self.live = set(range(trajectories))
        self.waiting: dict[int, tuple[list[int], asyncio.Future[Answer]]] = {}
        self.busy_seconds, self.batches = 0.0, 0

    def bind(self, trajectory: int) -> Callable[[list[int]], Awaitable[Answer]]:
        async def generate(prompt: list[int]) -> Answer:
            return await self._ask(trajectory, prompt)

        return generate

    def finish(self, trajectory: int) -> None:
        """``trajectory`` asks no more: rounds stop waiting for it, and a request it still has
        waiting leaves the round (cancelled)."""
        self.live.discard(trajectory)
        _, future = self.waiting.pop(trajectory, (None, None))
        if future is not None:
            future.cancel()
        if self._wake is not None:
            self._wake.set()

    async def _ask(self, trajectory: int, prompt: list[int]) -> Answer:
        assert self._wake is not None, "use the batcher in `async with`"
        assert trajectory in self.live and trajectory not in self.waiting, trajectory
        future: asyncio.Future[Answer] = asyncio.get_running_loop().create_future()
        self.waiting[trajectory] = (prompt, future)
        self._wake.set()
        try:
            return await future
        finally:  # cancelled before its round began: its request leaves the round
            if self.waiting.get(trajectory, (None, None))[1] is future:
                del self.waiting[trajectory]

    async def _serve(self) -> None:
        assert self._wake is not None
        while True:
            await self._wake.wait()
            self._wake.clear()
            if not self.waiting or self.live - self.waiting.keys():
                continue  # a live trajectory is still in its environment
            round_ = [self.waiting.pop(t) for t in sorted(self.waiting)]
            # a request cancelled since it asked (its task is ending) is not decoded
            round_ = [(p, f) for p, f in round_ if not f.done()]
            for i in range(0, len(round_), self.max_batch):
                await self._call(round_[i : i + self.max_batch])

    async def _call(self, batch: list[tuple[list[int], asyncio.Future[Answer]]]) -> None:
        seed = self.seed + self.batches
        self.batches += 1
        start = time.monotonic()
        try:
            prompts = [p for p, _ in batch]
            out = await asyncio.to_thread(self.generator.generate, prompts, self.cfg, seed)
        except Exception as e:  # every trajectory of the call sees the generator's failure
            for _, f in batch:
                if not f.done():
                    f.set_exception(e)
            return
        finally:
            self.busy_seconds += time.monotonic() - start
        for i, (_, f) in enumerate(batch):
            _resolve(f, (out.tokens[i], out.logprobs[i], self.version))


class ArrivalBatcher(_Served):
    """``await batcher(prompt_ids) -> (ids, logprobs, version)`` over one generator.

    A generator that ``streams`` (the native one) also takes requests that arrive while it
    decodes: they join its call at its next look at the rows (``rayhf.sampling.Feed``), and
    each answer goes back as soon as its row ends. ``rows`` and ``longest`` size such a call
    (the trajectories that may wait at once, the longest prompt one may send)."""

    def __init__(
        self,
        generator: Generator,
        cfg: GenerationConfig,
        version: int = 0,
        max_batch: int = 256,
        seed: int = 0,
        rows: int | None = None,
        longest: int = 0,
    ) -> None:
        self.generator, self.cfg, self.version = generator, cfg, version
        self.max_batch, self.seed = max_batch, seed
        self.rows, self.longest = rows or max_batch, longest
        self.waiting: list[tuple[list[int], asyncio.Future[Any]]] = []
        self.lock = threading.Lock()  # ``waiting`` is also taken from the decoding thread
        self.busy_seconds, self.batches = 0.0, 0

    async def __call__(self, prompt: list[int]) -> tuple[list[int], list[float], int]:
        assert self._wake is not None, "use the batcher in `async with`"
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        with self.lock:
            self.waiting.append((prompt, future))
        self._wake.set()
        result: tuple[list[int], list[float], int] = await future
        return result

    async def _serve(self) -> None:
        assert self._wake is not None
        loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            self._wake.clear()
            while True:
                with self.lock:
                    batch = self.waiting[: self.max_batch]
                    self.waiting = self.waiting[self.max_batch :]
                if not batch:
                    break
                feed = _Feed(self, loop, [f for _, f in batch])
                start = time.monotonic()
                try:
                    out = await asyncio.to_thread(self._generate, [p for p, _ in batch], feed)
                except Exception as e:  # every waiting trajectory sees the generator's failure
                    for f in feed.futures:
                        if not f.done():
                            f.set_exception(e)
                    continue
                finally:
                    self.busy_seconds += time.monotonic() - start
                    self.batches += 1
                for i, f in enumerate(feed.futures):
                    _resolve(f, (out.tokens[i], out.logprobs[i], self.version))

    def _generate(self, prompts: list[list[int]], feed: _Feed) -> GenerateOutput:
        seed = self.seed + self.batches
        if getattr(self.generator, "streams", False):
            return self.generator.generate(prompts, self.cfg, seed, feed)  # type: ignore[call-arg]
        return self.generator.generate(prompts, self.cfg, seed)

    def bind(self, trajectory: int) -> ArrivalBatcher:
        """Every trajectory asks the same way: by arrival."""
        del trajectory
        return self

    def finish(self, trajectory: int) -> None:
        del trajectory


def _resolve(future: asyncio.Future[Any], value: Any) -> None:
    if not future.done():  # cancelled, or answered already as its row ended
        future.set_result(value)


class _Feed:
    """The batcher's waiting requests as a ``rayhf.sampling.Feed`` of one generate call (its
    methods run on the decoding thread)."""

    def __init__(
        self, batcher: ArrivalBatcher, loop: asyncio.AbstractEventLoop, futures: list[Any]
    ) -> None:
        self.batcher, self.loop, self.futures = batcher, loop, futures
        self.rows, self.longest = batcher.rows, batcher.longest

    def more(self, free: int, max_len: int) -> list[list[int]]:
        taken: list[tuple[list[int], Any]] = []
        keep: list[tuple[list[int], Any]] = []
        with self.batcher.lock:
            for p, f in self.batcher.waiting:
                (taken if len(taken) < free and len(p) <= max_len else keep).append((p, f))
            self.batcher.waiting = keep
        self.futures += [f for _, f in taken]
        return [p for p, _ in taken]

    def ended(self, index: int, tokens: list[int], logprobs: list[float], finished: bool):
        del finished
        value = (tokens, logprobs, self.batcher.version)
        self.loop.call_soon_threadsafe(_resolve, self.futures[index], value)
