"""Multi-turn rollouts: trajectories that advance on their own against a turn-synchronous loop,
with environment latency drawn from a heavy-tailed distribution.

    python benchmarks/multiturn.py [--trajectories 32] [--turns 3] [--rounds 3] [--no-write]

Both drive the same native generator (a tiny Llama built here, sampling ``--new-tokens`` tokens a
turn) and the same environments: each model turn is answered after a latency drawn per
(trajectory, turn) from a log-normal distribution (median ``--median-ms``, sigma 1.5: most steps
are quick, a few are 20x slower, like tools and sandboxes), then a tool message, until the last
turn ends the trajectory.

- rayhf: ``rayhf.envs.env.rollouts`` over an ``ArrivalBatcher``: every trajectory steps its
  environment as soon as its turn is sampled, and a decode batch takes whatever turns wait.
- turn-synchronous: each turn, one decode batch of every trajectory's prompt, then every
  environment step; the next turn starts when the slowest step has answered.

Reported: trajectories per second (median over rounds, the same draws in both), and the
generator's idle share (1 - decoding time / wall time). Writes docs/benchmarks/multiturn.{md,json}.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import time
from typing import Any

import torch
from _common import write_results

from rayhf.engines.build import standalone_engine
from rayhf.envs.batcher import ArrivalBatcher
from rayhf.envs.env import EnvConfig, Step, rollouts
from rayhf.envs.trajectory import add_messages, add_model_turn, start
from rayhf.models.hf import ModelInit, build_model, hf_config
from rayhf.models.tokenizer import CHATML, train_bpe_tokenizer
from rayhf.sampling import GenerationConfig

SIGMA = 1.5  # log-normal spread of an environment step's latency
SETTINGS: dict[str, Any] = {}  # the run's draws, read by LatencyEnv (made by rollouts per row)


def latency(row: int, turn: int) -> float:
    rng = random.Random(SETTINGS["seed"] * 1_000_003 + row * 1009 + turn)
    return SETTINGS["median_s"] * rng.lognormvariate(0.0, SIGMA)


class LatencyEnv:
    """Answers each turn after its drawn latency; ends after ``turns`` model turns."""

    def __init__(self, row: dict[str, Any]) -> None:
        self.row, self.turn = row["i"], 0

    async def reset(self) -> list[dict[str, Any]]:
        return [{"role": "user", "content": f"Task {self.row}: count the tools."}]

    async def step(self, turn: str) -> Step:
        await asyncio.sleep(latency(self.row, self.turn))
        self.turn += 1
        if self.turn >= SETTINGS["turns"]:
            return Step(reward=1.0, done=True)
        return Step([{"role": "tool", "content": f"tool answer {self.turn}"}])


async def independent(generator: Any, tok: Any, gen: GenerationConfig, n: int) -> float:
    cfg = EnvConfig(cls=f"{__name__}:LatencyEnv", max_turns=SETTINGS["turns"],
                    max_tokens=4096, concurrency=n)  # fmt: skip
    async with ArrivalBatcher(generator, gen) as batcher:
        outs = await rollouts([{"i": i} for i in range(n)], batcher, tok, cfg)
    assert all(o.ended == "done" for o in outs), [o.ended for o in outs]
    return batcher.busy_seconds


async def turn_synchronous(generator: Any, tok: Any, gen: GenerationConfig, n: int) -> float:
    envs = [LatencyEnv({"i": i}) for i in range(n)]
    trajs = [start(tok, await e.reset()) for e in envs]
    busy = 0.0
    for k in range(SETTINGS["turns"]):
        t0 = time.monotonic()
        out = await asyncio.to_thread(generator.generate, [t.tokens for t in trajs], gen, k)
        busy += time.monotonic() - t0
        texts = [
            add_model_turn(t, tok, out.tokens[i], out.logprobs[i]) for i, t in enumerate(trajs)
        ]
        steps = await asyncio.gather(*(e.step(x) for e, x in zip(envs, texts, strict=True)))
        for t, s in zip(trajs, steps, strict=True):
            if not s.done:
                add_messages(t, tok, s.messages)
    return busy


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trajectories", type=int, default=32)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--median-ms", type=float, default=50.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    tok = train_bpe_tokenizer(["count the tools task answer"] * 50, 400, chat_format=CHATML)
    init = ModelInit(family="llama", n_layers=2, hidden_size=64, n_heads=4, n_kv_heads=2)
    model = build_model(
        hf_config(init, len(tok), tok.pad_token_id, tok.bos_token_id, tok.eos_token_id), False
    )
    engine = standalone_engine(model, tok, False)
    generator = engine.generator
    assert generator is not None
    gen = GenerationConfig(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens)
    SETTINGS.update(turns=args.turns, median_s=args.median_ms / 1000)
    ways = {"rayhf (independent)": independent, "turn-synchronous": turn_synchronous}
    rows: dict[str, list[tuple[float, float]]] = {w: [] for w in ways}
    for r in range(args.rounds + 1):  # one warm-up round
        SETTINGS["seed"] = r
        for name, way in ways.items() if r % 2 else reversed(list(ways.items())):
            t0 = time.monotonic()
            busy = asyncio.run(way(generator, tok, gen, args.trajectories))
            wall = time.monotonic() - t0
            if r:
                rows[name].append((args.trajectories / wall, 1 - busy / wall))
    med = {w: (statistics.median(x[0] for x in v), statistics.median(x[1] for x in v))
           for w, v in rows.items()}  # fmt: skip
    ours, sync = med["rayhf (independent)"][0], med["turn-synchronous"][0]
    text = "\n".join([
        "# Multi-turn rollouts: independent trajectories vs a turn-synchronous loop",
        "",
        f"Command: `python benchmarks/multiturn.py --trajectories {args.trajectories} --turns "
        f"{args.turns} --new-tokens {args.new_tokens} --median-ms {args.median_ms:g} --rounds "
        f"{args.rounds}` on {os.cpu_count()} CPU cores: the native generator on a tiny Llama "
        f"(one thread), environment steps log-normal (median {args.median_ms:g} ms, sigma "
        f"{SIGMA}), the same draws for both; medians over {args.rounds} rounds.",
        "",
        "| loop | trajectories/s | generator idle share |",
        "| --- | ---: | ---: |",
        *(f"| {w} | {v[0]:.2f} | {v[1]:.0%} |" for w, v in med.items()),
        "",
        f"Independent over turn-synchronous: {ours / sync:.2f}x trajectories/s.",
    ])  # fmt: skip
    print(text)
    if not args.no_write:
        write_results("multiturn", text, {"args": vars(args), "rounds": rows, "median": med})


if __name__ == "__main__":
    main()
