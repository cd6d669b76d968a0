"""Environments and the multi-turn rollout loop: each trajectory advances on its own through its
environment; its model turns share the generator as ``env.joining`` says (``rayhf.envs.batcher``).
In ``rounds`` (the default, reproducible) a turn is decoded once every live trajectory has asked
for its next one, so a round waits for its slowest environment; by ``arrival`` a turn is decoded
as soon as it is asked, so a call's time is set by the work, not by the slowest environment.

An environment is a plain Python class named ``module:Class`` in the config, made once per
trajectory from the dataset row (its columns reach it as they reach reward functions)::

    class Env:
        def __init__(self, row: dict): ...
        async def reset(self) -> list[dict]            # the first messages
        async def step(self, turn: str) -> Step        # the model's turn (text) -> what follows

``rollout`` drives one trajectory: generate a turn (``Generate``: prompt ids -> sampled ids and
their log-probs), hand its text to ``step`` under a timeout, append what comes back as the chat
template renders it (``rayhf.envs.trajectory``), until the environment says done or a budget
(turns, tokens) runs out. A ``step`` that raises or times out ends its trajectory with a flag and
``EnvConfig.error_reward``; the run goes on. ``rollouts`` runs many at once, at most
``concurrency`` of them inside their environment at a time.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from rayhf.algorithms.reward import resolve_function
from rayhf.envs import sandbox
from rayhf.envs.batcher import Batcher, RoundBatcher
from rayhf.envs.sandbox import SandboxConfig
from rayhf.envs.tools import CallStyle
from rayhf.envs.trajectory import Trajectory, add_messages, add_model_turn, start
from rayhf.errors import RayhfError

log = logging.getLogger(__name__)

# prompt ids -> (sampled ids, their log-probs, the policy version that sampled them)
Generate = Callable[[list[int]], Awaitable[tuple[list[int], list[float], int]]]


@dataclass(frozen=True)
class Step:
    """What an environment returns for a model turn."""

    messages: list[dict[str, Any]] = field(default_factory=list)  # appended before the next turn
    reward: float = 0.0
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)


class Environment(Protocol):
    async def reset(self) -> list[dict[str, Any]]: ...

    async def step(self, turn: str) -> Step: ...


class EnvConfig(BaseModel):
    """The environment of a multi-turn generate call."""

    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid")

    cls: str | None = None
    """The environment class, ``module:Class``; made from each dataset row."""
    agent: str | None = None
    """Instead of ``cls``: an agent written against the OpenAI API, ``module:function``, an
    ``async def agent(client: openai.AsyncOpenAI, row: dict) -> float`` returning the reward;
    rayhf serves the policy to it and records its trajectory (``rayhf.envs.proxy``)."""
    tool_parser: CallStyle = "hermes"
    """How the agent server reads tool calls from the model's text: ``hermes``
    (``<tool_call>`` JSON: Qwen, ChatML) or ``llama3`` (a JSON object)."""
    max_turns: int = Field(4, gt=0)
    """Model turns a trajectory may take."""
    max_tokens: int = Field(1024, gt=0)
    """Tokens a trajectory may hold (prompt, turns and environment messages)."""
    step_timeout_s: float = Field(30.0, gt=0)
    """Seconds one ``step`` (or ``reset``), or an agent between two model turns, may take
    before its trajectory ends, flagged."""
    error_reward: float = 0.0
    """The reward of a trajectory whose environment raised or timed out."""
    concurrency: int = Field(64, gt=0)
    """Trajectories inside their environment at once."""
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig)
    """How the code tool (``rayhf.envs.tools.CODE_RUNNER``) isolates the programs it runs;
    checked at start-up when the environment offers it."""
    joining: Literal["rounds", "arrival"] = "rounds"
    """How the trajectories' model turns share the generator (``rayhf.envs.batcher``):
    ``rounds`` decodes every live trajectory's next turn together, in trajectory order, so a
    seeded run samples the same trajectories however fast its environments answer;
    ``arrival`` decodes each turn as soon as it is asked (joining a running decode), faster when
    environments take long and unevenly but not reproducible. ``env.agent`` runs join by
    arrival."""

    @field_validator("cls", "agent")
    @classmethod
    def _module_and_name(cls, v: str | None) -> str | None:
        if v is not None and (v.count(":") != 1 or not all(v.split(":"))):
            raise ValueError(f"{v!r}: write it as module:Name")
        return v

    @model_validator(mode="after")
    def _one_source(self) -> EnvConfig:
        if (self.cls is None) == (self.agent is None):
            raise ValueError("set exactly one of env.cls (an environment class) and env.agent")
        return self


def load_env_class(path: str) -> type:
    """The class ``module:Class`` names; a one-line error naming what is missing."""
    env_cls = resolve_function(path, "env.cls")  # imports it, errors naming the field
    if not isinstance(env_cls, type):
        raise RayhfError(f"env.cls {path!r}: not a class")
    name = env_cls.__name__
    for method in ("reset", "step"):
        if not asyncio.iscoroutinefunction(getattr(env_cls, method, None)):
            raise RayhfError(f"env.cls {path!r}: {name}.{method} must be an async method")
    return env_cls


def load_agent(path: str) -> Callable[..., Awaitable[float]]:
    """The agent function ``module:function`` names; a one-line error naming what is wrong."""
    fn = resolve_function(path, "env.agent")
    if not asyncio.iscoroutinefunction(fn):
        raise RayhfError(f"env.agent {path!r}: write it as async def agent(client, row) -> reward")
    return fn


def check_env(cfg: EnvConfig) -> None:
    """The environment class or the agent function imports and has the right shape; where the
    environment offers the code tool (or the config sets ``env.sandbox``), the sandbox runs a
    program as the run's will, or the run refuses to start (``rayhf.envs.sandbox.check``)."""
    tools: tuple[Any, ...] = ()
    if cfg.cls is not None:
        tools = getattr(load_env_class(cfg.cls), "tools", ())
    if cfg.agent is not None:
        load_agent(cfg.agent)
    if "sandbox" in cfg.model_fields_set or any(getattr(t, "sandboxed", False) for t in tools):
        log.info("the code tool's sandbox: %s", sandbox.check(cfg.sandbox))


@dataclass
class Outcome:
    """A finished trajectory: its tokens and mask, reward and what happened."""

    trajectory: Trajectory
    reward: float
    ended: str  # "done", "turns", "tokens", "error", "timeout"
    env_seconds: float
    tool_calls: int = 0  # as the environment's steps count them (``Step.info["tool_calls"]``)
    tool_errors: int = 0  # ``Step.info["tool_errors"]``
    info: dict[str, Any] = field(default_factory=dict)


async def rollout(
    env: Environment,
    generate: Generate,
    tok: Any,
    cfg: EnvConfig,
    gate: asyncio.Semaphore,
    tools: list[dict[str, Any]] | None = None,
) -> Outcome:
    """One trajectory from ``env.reset`` to done or a budget (see the module's docstring)."""
    env_s = 0.0
    calls = {"tool_calls": 0, "tool_errors": 0}

    async def in_env(aw: Awaitable[Any]) -> Any:
        nonlocal env_s
        t0 = time.monotonic()
        try:
            async with gate:
                return await asyncio.wait_for(aw, cfg.step_timeout_s)
        finally:
            env_s += time.monotonic() - t0

    def end(reward: float, ended: str, info: dict[str, Any] | None = None) -> Outcome:
        return Outcome(traj, reward, ended, env_s, info=info or {}, **calls)

    traj = Trajectory([], [], [], [], [])
    try:
        traj = start(tok, await in_env(env.reset()), tools)
        while True:
            if traj.turns >= cfg.max_turns:
                return end(0.0, "turns")
            if len(traj.tokens) >= cfg.max_tokens:
                return end(0.0, "tokens")
            ids, logprobs, version = await generate(traj.tokens)
            room = cfg.max_tokens - len(traj.tokens)
            text = add_model_turn(traj, tok, ids[:room], logprobs[:room], version)
            result: Step = await in_env(env.step(text))
            for key in calls:
                calls[key] += int(result.info.get(key, 0))
            if result.done:
                return end(result.reward, "done", result.info)
            add_messages(traj, tok, result.messages)
    except (asyncio.TimeoutError, TimeoutError):  # distinct types before Python 3.11
        return end(cfg.error_reward, "timeout")
    except RayhfError:
        raise  # the template: a configuration error, not the environment's
    except Exception as e:  # the environment's failure ends this trajectory, not the run
        return end(cfg.error_reward, "error", {"error": repr(e)})


async def rollouts(
    rows: list[dict[str, Any]],
    generate: Generate | Batcher,
    tok: Any,
    cfg: EnvConfig,
    tools: list[dict[str, Any]] | None = None,
) -> list[Outcome]:
    """A trajectory per row, all advancing independently; in row order. A ``Batcher`` serves
    trajectory ``i`` (row ``i``) through ``bind(i)`` and hears when it has ended, however it
    ends (done, a budget, its environment's error or timeout, an exception, cancelled)."""
    assert cfg.cls is not None, "an environment class (env.agent runs in rayhf.envs.proxy)"
    if isinstance(generate, RoundBatcher):  # a round waits for trajectories that never come
        assert generate.trajectories == len(rows), (generate.trajectories, len(rows))
    env_cls = load_env_class(cfg.cls)
    gate = asyncio.Semaphore(cfg.concurrency)

    async def one(i: int, row: dict[str, Any]) -> Outcome:
        if not isinstance(generate, Batcher):
            return await rollout(env_cls(row), generate, tok, cfg, gate, tools)
        try:
            return await rollout(env_cls(row), generate.bind(i), tok, cfg, gate, tools)
        finally:
            generate.finish(i)

    return list(await asyncio.gather(*(one(i, row) for i, row in enumerate(rows))))


def metrics(outcomes: list[Outcome]) -> dict[str, float]:
    """Counts and means over a call's trajectories, for the run's metrics."""
    n = max(1, len(outcomes))
    out: dict[str, float] = {
        "turns_mean": sum(o.trajectory.turns for o in outcomes) / n,
        "env_seconds_mean": sum(o.env_seconds for o in outcomes) / n,
        "reward_mean": sum(o.reward for o in outcomes) / n,
    }
    for ended in ("done", "turns", "tokens", "error", "timeout"):
        out[f"ended_{ended}"] = float(sum(o.ended == ended for o in outcomes))
    return out
