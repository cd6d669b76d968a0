"""One generator serving many trajectories: every ``Generate`` request waiting when a batch
starts joins it, so no trajectory waits for another's environment (a request that arrives
while a batch decodes goes into the next one).

    async with ArrivalBatcher(generator, cfg) as generate:
        outcomes = await rollouts(rows, generate, tok, env_cfg)

The generator's ``generate`` blocks (it decodes), so it runs in a worker thread while the event
loop keeps stepping environments. ``busy_seconds`` is the time spent decoding, for the call's
generator idle share.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any, Protocol

from rayhf.sampling import GenerateOutput, GenerationConfig


class Generator(Protocol):
    def generate(
        self, prompts: list[list[int]], cfg: GenerationConfig, seed: int
    ) -> GenerateOutput: ...


class ArrivalBatcher:
    """``await batcher(prompt_ids) -> (ids, logprobs, version)`` over one generator."""

    def __init__(
        self,
        generator: Generator,
        cfg: GenerationConfig,
        version: int = 0,
        max_batch: int = 256,
        seed: int = 0,
    ) -> None:
        self.generator, self.cfg, self.version = generator, cfg, version
        self.max_batch, self.seed = max_batch, seed
        self.waiting: list[tuple[list[int], asyncio.Future[Any]]] = []
        self.busy_seconds, self.batches = 0.0, 0
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> ArrivalBatcher:
        self._wake = asyncio.Event()
        self._task = asyncio.create_task(self._serve())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task

    async def __call__(self, prompt: list[int]) -> tuple[list[int], list[float], int]:
        assert self._wake is not None, "use the batcher in `async with`"
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.waiting.append((prompt, future))
        self._wake.set()
        result: tuple[list[int], list[float], int] = await future
        return result

    async def _serve(self) -> None:
        assert self._wake is not None
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self.waiting:
                batch, self.waiting = self.waiting[: self.max_batch], self.waiting[self.max_batch :]
                prompts = [p for p, _ in batch]
                start = time.monotonic()
                try:
                    out = await asyncio.to_thread(
                        self.generator.generate, prompts, self.cfg, self.seed + self.batches
                    )
                except Exception as e:  # every waiting trajectory sees the generator's failure
                    for _, f in batch:
                        f.set_exception(e)
                    continue
                finally:
                    self.busy_seconds += time.monotonic() - start
                    self.batches += 1
                for i, (_, f) in enumerate(batch):
                    if not f.cancelled():
                        f.set_result((out.tokens[i], out.logprobs[i], self.version))
