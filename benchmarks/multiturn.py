"""Multi-turn rollouts: trajectories that advance on their own (joined by arrival, or in
reproducible rounds) against a turn-synchronous loop, with environment latency drawn from a
heavy-tailed distribution.

    python benchmarks/multiturn.py [--calls 32x3 64x4 128x4] [--rounds 5] [--no-write]

Both drive the same native generator (a tiny Llama built here, sampling ``--new-tokens`` tokens a
turn) and the same environments: each model turn is answered after a latency drawn per
(trajectory, turn) from a log-normal distribution (median ``--median-ms``, sigma 1.5: most steps
are quick, a few are 20x slower, like tools and sandboxes), then a tool message, until the last
turn ends the trajectory.

- arrival (``env.joining: arrival``): ``rayhf.envs.env.rollouts`` over an ``ArrivalBatcher``:
  every trajectory steps its environment as soon as its turn is sampled, and a decode batch
  takes whatever turns wait.
- rounds (``env.joining: rounds``, the default): ``rollouts`` over a ``RoundBatcher``: a decode
  batch of every live trajectory's next turn once all have asked, in trajectory order.
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
from rayhf.envs.batcher import ArrivalBatcher, RoundBatcher
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


async def arrival(generator: Any, tok: Any, gen: GenerationConfig, n: int) -> float:
    batcher = ArrivalBatcher(generator, gen, rows=n, longest=4096)
    return await _rollouts(batcher, tok, n)


async def joined_in_rounds(generator: Any, tok: Any, gen: GenerationConfig, n: int) -> float:
    return await _rollouts(RoundBatcher(generator, gen, trajectories=n), tok, n)


async def _rollouts(batcher: ArrivalBatcher | RoundBatcher, tok: Any, n: int) -> float:
    cfg = EnvConfig(cls=f"{__name__}:LatencyEnv", max_turns=SETTINGS["turns"],
                    max_tokens=4096, concurrency=n)  # fmt: skip
    async with batcher:
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
    ways = {"arrival": arrival, "rounds": joined_in_rounds, "sync": turn_synchronous}
    out: dict[str, list[Any]] = {"arrival": [], "rounds": [], "sync": [], "ideal": []}
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
    results, lines = {}, []
    ratios: dict[str, list[float]] = {"sync": [], "rounds": []}  # arrival over each
    for call in args.calls:
        n, turns = map(int, call.split("x"))
        SETTINGS.update(turns=turns, median_s=args.median_ms / 1000)
        res = results[call] = measure(generator, tok, gen, n, args.rounds)
        lines.append(_row(n, turns, res, ratios))
        print(lines[-1], flush=True)
    text = _page(args, lines, ratios)
    print(text)
    if not args.no_write:
        write_results("multiturn", text, {"args": vars(args), "results": results})


def _row(n: int, turns: int, res: dict, ratios: dict[str, list[float]]) -> str:
    """One call shape's table row; its per-round ratios added to ``ratios``."""
    ways = ("arrival", "rounds", "sync")
    med = {w: statistics.median(x[0] for x in res[w]) for w in ways}
    idle = {w: statistics.median(x[1] for x in res[w]) for w in ways}
    over = {
        w: [a[0] / b[0] for a, b in zip(res["arrival"], res[w], strict=True)]
        for w in ("sync", "rounds")
    }
    for w in over:
        ratios[w] += over[w]
    sync, rounds = over["sync"], over["rounds"]
    return (
        f"| {n} x {turns} | {med['arrival']:.2f} | {med['rounds']:.2f} | {med['sync']:.2f} | "
        f"{statistics.median(sync):.2f}x | {_geomean(sync):.2f}x | {min(sync):.2f}x | "
        f"{_geomean(res['ideal']):.2f}x | {statistics.median(rounds):.2f}x | "
        f"{_geomean(rounds):.2f}x | {idle['arrival']:.0%} | {idle['rounds']:.0%} | "
        f"{idle['sync']:.0%} |"
    )


def _page(args: argparse.Namespace, lines: list[str], ratios: dict[str, list[float]]) -> str:
    sync, rounds = ratios["sync"], ratios["rounds"]
    return "\n".join([
        "# Multi-turn rollouts: joined by arrival, in rounds, and a turn-synchronous loop",
        "",
        f"Command: `python benchmarks/multiturn.py --calls {' '.join(args.calls)} --new-tokens "
        f"{args.new_tokens} --median-ms {args.median_ms:g} --rounds {args.rounds}` on "
        f"{os.cpu_count()} CPU cores: the native generator on a tiny Llama (one thread), "
        f"environment steps log-normal (median {args.median_ms:g} ms, sigma {SIGMA}), the same "
        f"draws for every loop in a round, {args.rounds} rounds of new draws per call shape. "
        "*Arrival* is `env.joining: arrival` (a decode batch takes whatever turns wait, and "
        "turns join a running decode); *rounds* is `env.joining: rounds`, the default (a decode "
        "batch of every live trajectory's next turn, in trajectory order: reproducible); "
        "*turn-sync* decodes every trajectory's turn, then steps every environment. "
        "Trajectories/s are medians over the rounds; the ratios are per round (arrival over "
        "the other). *Ideal* is arrival over turn-sync if decoding took no time (the sum over "
        "turns of each turn's slowest step, over the slowest trajectory's own sum): what the "
        "draws allow. Idle: 1 - decoding time / wall time.",
        "",
        "| trajectories x turns | arrival traj/s | rounds traj/s | turn-sync traj/s | "
        "arrival / turn-sync, median | geomean | lowest | ideal, geomean | "
        "arrival / rounds, median | geomean | arrival idle | rounds idle | turn-sync idle |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
        "| ---: |",
        *lines,
        "",
        f"Arrival over turn-sync, all {len(sync)} rounds: geometric mean {_geomean(sync):.2f}x, "
        f"median {statistics.median(sync):.2f}x, lowest {min(sync):.2f}x; rounds under 1.5x: "
        f"{sum(r < 1.5 for r in sync)}. Arrival over rounds: geometric mean "
        f"{_geomean(rounds):.2f}x, median {statistics.median(rounds):.2f}x, lowest "
        f"{min(rounds):.2f}x.",
    ])  # fmt: skip


if __name__ == "__main__":
    main()
