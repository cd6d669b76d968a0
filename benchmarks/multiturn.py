"""Multi-turn rollouts: trajectories that advance on their own against a turn-synchronous loop,
with environment latency drawn from a heavy-tailed distribution.

    python benchmarks/multiturn.py [--calls 32x3 64x4 128x4] [--rounds 5] [--no-write]

Both drive the same native generator (a tiny Llama built here, sampling ``--new-tokens`` tokens a
turn) and the same environments: each model turn is answered after a latency drawn per
(trajectory, turn) from a log-normal distribution (median ``--median-ms``, sigma 1.5: most steps
are quick, a few are 20x slower, like tools and sandboxes), then a tool message, until the last
turn ends the trajectory.

- rayhf: ``rayhf.envs.env.rollouts`` over an ``ArrivalBatcher``: every trajectory steps its
  environment as soon as its turn is sampled, and a decode batch takes whatever turns wait.
- turn-synchronous: each turn, one decode batch of every trajectory's prompt, then every
  environment step; the next turn starts when the slowest step has answered.

Reported per call shape (trajectories x turns): trajectories per second (median over rounds,
the same draws in both loops), the per-round ratio, the ratio the draws allow if decoding took
no time, and the generator's idle share (1 - decoding time / wall time). Writes
docs/benchmarks/multiturn.{md,json}.
"""

from __future__ import annotations

import argparse
import asyncio
import math
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
    async with ArrivalBatcher(generator, gen, rows=n, longest=cfg.max_tokens) as batcher:
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


def ideal_ratio(n: int) -> float:
    """Turn-synchronous over independent wall time if decoding took no time: the sum over turns
    of the slowest step, over the slowest trajectory's sum of steps (this round's draws)."""
    turns = range(SETTINGS["turns"])
    sync = sum(max(latency(r, t) for r in range(n)) for t in turns)
    return sync / max(sum(latency(r, t) for t in turns) for r in range(n))


def measure(generator: Any, tok: Any, gen: GenerationConfig, n: int, rounds: int) -> dict:
    """Per round (a warm-up first): each loop's trajectories/s and idle share, and the ideal
    ratio of the round's draws."""
    ways = {"rayhf": independent, "sync": turn_synchronous}
    out: dict[str, list[Any]] = {"rayhf": [], "sync": [], "ideal": []}
    for r in range(rounds + 1):
        SETTINGS["seed"] = r
        for name, way in ways.items() if r % 2 else reversed(list(ways.items())):
            t0 = time.monotonic()
            busy = asyncio.run(way(generator, tok, gen, n))
            wall = time.monotonic() - t0
            if r:
                out[name].append((n / wall, 1 - busy / wall))
        if r:
            out["ideal"].append(ideal_ratio(n))
    return out


def _geomean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", nargs="+", default=["32x3", "64x4", "128x4"],
                    help="trajectories x turns per call")  # fmt: skip
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--median-ms", type=float, default=50.0)
    ap.add_argument("--rounds", type=int, default=5)
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
    results, lines, all_ratios = {}, [], []
    for call in args.calls:
        n, turns = map(int, call.split("x"))
        SETTINGS.update(turns=turns, median_s=args.median_ms / 1000)
        res = results[call] = measure(generator, tok, gen, n, args.rounds)
        ratios = [a[0] / b[0] for a, b in zip(res["rayhf"], res["sync"], strict=True)]
        all_ratios += ratios
        med = {w: statistics.median(x[0] for x in res[w]) for w in ("rayhf", "sync")}
        idle = {w: statistics.median(x[1] for x in res[w]) for w in ("rayhf", "sync")}
        lines.append(
            f"| {n} x {turns} | {med['rayhf']:.2f} | {med['sync']:.2f} | "
            f"{statistics.median(ratios):.2f}x | {_geomean(ratios):.2f}x | {min(ratios):.2f}x | "
            f"{_geomean(res['ideal']):.2f}x | {idle['rayhf']:.0%} | {idle['sync']:.0%} |"
        )
        print(lines[-1], flush=True)
    text = "\n".join([
        "# Multi-turn rollouts: independent trajectories vs a turn-synchronous loop",
        "",
        f"Command: `python benchmarks/multiturn.py --calls {' '.join(args.calls)} --new-tokens "
        f"{args.new_tokens} --median-ms {args.median_ms:g} --rounds {args.rounds}` on "
        f"{os.cpu_count()} CPU cores: the native generator on a tiny Llama (one thread), "
        f"environment steps log-normal (median {args.median_ms:g} ms, sigma {SIGMA}), the same "
        f"draws for both loops in a round, {args.rounds} rounds of new draws per call shape. "
        "Trajectories/s are medians over the rounds; the ratios are per round (rayhf over "
        "turn-synchronous). *Ideal* is the ratio if decoding took no time (the sum over turns "
        "of each turn's slowest step, over the slowest trajectory's own sum): what the draws "
        "allow. Idle: 1 - decoding time / wall time.",
        "",
        "| trajectories x turns | rayhf traj/s | turn-sync traj/s | ratio, median | geomean | "
        "lowest | ideal, geomean | rayhf idle | turn-sync idle |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        *lines,
        "",
        f"Over all {len(all_ratios)} rounds: geometric mean {_geomean(all_ratios):.2f}x, median "
        f"{statistics.median(all_ratios):.2f}x, lowest {min(all_ratios):.2f}x; rounds under "
        f"1.5x: {sum(r < 1.5 for r in all_ratios)}.",
    ])  # fmt: skip
    print(text)
    if not args.no_write:
        write_results("multiturn", text, {"args": vars(args), "results": results})


if __name__ == "__main__":
    main()
