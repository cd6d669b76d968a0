"""What an OpenAI-API agent costs over an environment class, per model turn: the HTTP round trip
through rayhf's agent server (``rayhf.envs.proxy``) and the ``openai`` client, against the same
task's ``CalculatorEnv`` stepped in process.

    python benchmarks/agent_server.py [--trajectories 64] [--rounds 5] [--no-write]

Both drive the calculator task (``rayhf.tasks.calculator``) with a generator that costs nothing
(it answers each turn at once: the call, then the answer), so what is left is the rollout
machinery: template rendering, tool calls, and for the agent the server and client (started
once per round, as once per generate call). Reported: milliseconds per model turn (median over
rounds, after an untimed warm-up round) for each, and the difference. Writes
docs/benchmarks/agent_server.{md,json}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import time
from typing import Any

from _common import write_results

from rayhf.envs.env import EnvConfig, rollouts
from rayhf.envs.proxy import agent_rollouts
from rayhf.tasks.calculator import CalculatorEnv, build_tokenizer, make_rows, tool_call

TOK = build_tokenizer()
ASKED = re.compile(r"What is \d+ \* \d+\?")
SHOWN = re.compile(r"<tool_response>\n(\d+)\n</tool_response>")


async def _generate(prompt: list[int]) -> tuple[list[int], list[float], int]:
    """The scripted turn: a calculator call, or the answer once a result is shown."""
    await asyncio.sleep(0)
    text = TOK.decode(prompt)
    shown = SHOWN.findall(text)
    turn = f"Answer: {shown[-1]}" if shown else tool_call(ASKED.findall(text)[-1])
    ids = [*TOK.encode(turn, add_special_tokens=False), TOK.eos_token_id]
    return ids, [0.0] * len(ids), 0


async def _round(rows: list[dict[str, Any]], agent: bool) -> int:
    if agent:
        cfg = EnvConfig(agent="rayhf.tasks.calculator:openai_agent")
        outcomes = await agent_rollouts(rows, _generate, TOK, cfg)
    else:
        cfg = EnvConfig(cls="rayhf.tasks.calculator:CalculatorEnv")
        tools = [t.schema() for t in CalculatorEnv.tools]
        outcomes = await rollouts(rows, _generate, TOK, cfg, tools)
    assert all(o.reward == 1.0 for o in outcomes), "the scripted turns answer right"
    return sum(o.trajectory.turns for o in outcomes)


def measure(n: int, rounds: int) -> dict[str, Any]:
    rows = make_rows(n, 0)
    out: dict[str, Any] = {"trajectories": n, "rounds": rounds}
    for name, agent in (("environment", False), ("openai_agent", True)):
        asyncio.run(_round(rows, agent))  # warm-up: imports, first connections
        per_turn = []
        for _ in range(rounds):
            began = time.perf_counter()
            turns = asyncio.run(_round(rows, agent))
            per_turn.append((time.perf_counter() - began) * 1e3 / turns)
        out[name] = {"ms_per_turn": statistics.median(per_turn), "rounds_ms": per_turn}
    return out


def report(r: dict[str, Any]) -> str:
    env, agent = r["environment"]["ms_per_turn"], r["openai_agent"]["ms_per_turn"]
    return "\n".join(
        [
            "# Agent server: an OpenAI-API agent's cost per model turn",
            "",
            f"`python benchmarks/agent_server.py --trajectories {r['trajectories']} --rounds "
            f"{r['rounds']}`: the calculator task, {r['trajectories']} trajectories at once, a "
            "generator that answers at once (see the script's docstring). Median over rounds.",
            "",
            "| rollout | ms per model turn |",
            "| --- | ---: |",
            f"| `CalculatorEnv` in process | {env:.2f} |",
            f"| `openai_agent` through the agent server | {agent:.2f} |",
            f"| difference: HTTP, server, client | {agent - env:.2f} |",
        ]
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trajectories", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--no-write", action="store_true")
    a = p.parse_args()
    r = measure(a.trajectories, a.rounds)
    text = report(r)
    print(text)
    if not a.no_write:
        write_results("agent_server", text + "\n", json.loads(json.dumps(r)))


if __name__ == "__main__":
    main()
