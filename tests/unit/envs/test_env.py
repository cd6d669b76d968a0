"""The multi-turn rollout loop: a tool-using trajectory ends with its environment's reward, a
raising or hanging environment ends only its own trajectory (flagged), budgets stop a
trajectory, trajectories never wait for each other's turns, a round batcher must serve one
trajectory per row, and bad environment config is one line."""

from __future__ import annotations

import asyncio
import json
import re

import pytest
from pydantic import ValidationError

from rayhf.envs.batcher import RoundBatcher
from rayhf.envs.env import EnvConfig, Step, load_env_class, metrics, rollouts
from rayhf.envs.tools import CALCULATOR, ToolRegistry, parse_tool_calls
from rayhf.errors import RayhfError
from rayhf.models.tokenizer import CHATML, train_bpe_tokenizer
from rayhf.sampling import GenerationConfig

TOK = train_bpe_tokenizer(["What is 12 * 7? calculator answer"] * 20, 400, chat_format=CHATML)
TOOLS = ToolRegistry([CALCULATOR])


class CalcEnv:
    """Asks for a product; a calculator call gets its result, an answer ends it (1 if right)."""

    def __init__(self, row: dict) -> None:
        self.a, self.b = row["a"], row["b"]

    async def reset(self) -> list[dict]:
        return [{"role": "user", "content": f"What is {self.a} * {self.b}?"}]

    async def step(self, turn: str) -> Step:
        calls = parse_tool_calls(turn, "hermes")
        if calls:
            results = [TOOLS.call(c) for c in calls]
            return Step([{"role": "tool", "content": r.content} for r in results])
        right = re.search(r"-?\d+", turn)
        return Step(reward=float(bool(right) and int(right.group()) == self.a * self.b), done=True)


class RaisingEnv(CalcEnv):
    async def step(self, turn: str) -> Step:
        raise RuntimeError("the environment broke")


class HangingEnv(CalcEnv):
    async def step(self, turn: str) -> Step:
        await asyncio.sleep(3600)
        return Step()


class SyncEnv:
    def __init__(self, row: dict) -> None: ...

    def reset(self) -> list[dict]:
        return []

    def step(self, turn: str) -> Step:
        return Step()


async def _agent(tokens: list[int]) -> tuple[list[int], list[float], int]:
    """Calls the calculator on the question, then answers with what it said back."""
    seen = TOK.decode(tokens)
    result = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", seen)
    if result:
        text = f"The answer is {result[-1]}."
    else:
        a, b = re.findall(r"What is (\d+) \* (\d+)", seen)[0]
        args = json.dumps({"name": "calculator", "arguments": {"expression": f"{a} * {b}"}})
        text = f"<tool_call>{args}</tool_call>"
    await asyncio.sleep(0)
    ids = [*TOK.encode(text, add_special_tokens=False), TOK.eos_token_id]
    return ids, [-0.1] * len(ids), 5


def _run(cls: type, rows: list[dict], **cfg) -> list:
    config = EnvConfig(cls=f"{__name__}:{cls.__name__}", **cfg)
    return asyncio.run(rollouts(rows, _agent, TOK, config, [CALCULATOR.schema()]))


def test_a_tool_using_trajectory_ends_with_its_environment_s_reward():
    (out,) = _run(CalcEnv, [{"a": 12, "b": 7}])
    assert (out.ended, out.reward, out.trajectory.turns) == ("done", 1.0, 2)
    traj = out.trajectory
    assert traj.messages[-1]["content"] == "The answer is 84."
    assert "84" in [m["content"] for m in traj.messages if m["role"] == "tool"]
    assert sum(traj.trained) == sum(v == 5 for v in traj.versions)  # model tokens, version 5


def test_raising_and_hanging_environments_end_only_their_trajectories():
    broken = _run(RaisingEnv, [{"a": 2, "b": 3}] * 2, error_reward=-1.0)
    assert [(o.ended, o.reward) for o in broken] == [("error", -1.0)] * 2
    assert "the environment broke" in broken[0].info["error"]
    hung = _run(HangingEnv, [{"a": 2, "b": 3}], step_timeout_s=0.2)
    assert hung[0].ended == "timeout" and hung[0].trajectory.turns == 1
    stats = metrics(broken + hung + _run(CalcEnv, [{"a": 2, "b": 3}]))
    assert (stats["ended_error"], stats["ended_timeout"], stats["ended_done"]) == (2, 1, 1)


def test_budgets_stop_a_trajectory():
    assert _run(CalcEnv, [{"a": 4, "b": 5}], max_turns=1)[0].ended == "turns"
    (out,) = _run(CalcEnv, [{"a": 4, "b": 5}], max_tokens=60)
    assert out.ended == "tokens" and len(out.trajectory.tokens) >= 60


class WaitsForOthers(CalcEnv):
    """Row 0's first step returns only once every other trajectory has finished: a loop that
    advanced all trajectories a turn at a time would never get there."""

    finished: asyncio.Event | None = None
    left = 0

    async def step(self, turn: str) -> Step:
        if self.a == 0:
            assert WaitsForOthers.finished is not None
            await WaitsForOthers.finished.wait()
            return Step(done=True, reward=1.0)
        out = await super().step(turn)
        if out.done:
            WaitsForOthers.left -= 1
            if WaitsForOthers.left == 0:
                assert WaitsForOthers.finished is not None
                WaitsForOthers.finished.set()
        return out


def test_trajectories_advance_without_waiting_for_each_other():
    rows = [{"a": 0, "b": 1}] + [{"a": i, "b": 3} for i in range(1, 5)]

    async def go() -> list:
        WaitsForOthers.finished, WaitsForOthers.left = asyncio.Event(), len(rows) - 1
        cfg = EnvConfig(cls=f"{__name__}:WaitsForOthers", step_timeout_s=5)
        return await rollouts(rows, _agent, TOK, cfg, [CALCULATOR.schema()])

    outs = asyncio.run(go())
    assert [o.ended for o in outs] == ["done"] * 5 and [o.reward for o in outs] == [1.0] * 5
    assert [o.trajectory.turns for o in outs] == [1, 2, 2, 2, 2]


def test_a_round_batcher_serves_one_trajectory_per_row():
    class Never:
        def generate(self, prompts, cfg, seed):
            raise AssertionError("not called")

    async def go() -> None:
        cfg = EnvConfig(cls=f"{__name__}:CalcEnv")
        async with RoundBatcher(Never(), GenerationConfig(), trajectories=3) as b:
            await rollouts([{"a": 1, "b": 2}] * 2, b, TOK, cfg)  # rounds would wait for a third

    with pytest.raises(AssertionError, match=r"\(3, 2\)"):
        asyncio.run(go())


@pytest.mark.parametrize(
    ("cls", "says"),
    [
        ("no_such_module_xyz:Env", "cannot import 'no_such_module_xyz:Env'"),
        (f"{__name__}:Missing", "has no attribute 'Missing'"),
        (f"{__name__}:_agent", "not a class"),
        (f"{__name__}:SyncEnv", "SyncEnv.reset must be an async method"),
    ],
)
def test_a_bad_environment_class_is_one_line(cls, says):
    with pytest.raises(RayhfError, match=says):
        load_env_class(cls)


def test_bad_environment_settings_are_refused():
    with pytest.raises(ValidationError, match="module:Name"):
        EnvConfig(cls="just_a_name")
    with pytest.raises(ValidationError, match=r"exactly one of env\.cls"):
        EnvConfig(cls="m:C", agent="m:f")
    with pytest.raises(ValidationError, match=r"exactly one of env\.cls"):
        EnvConfig()
    with pytest.raises(ValidationError, match="max_turns"):
        EnvConfig(cls="m:C", max_turns=0)
