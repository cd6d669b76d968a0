"""The multi-turn generate call: GRPO's and PPO's actors (interfaces ``grpo_agent`` and
``ppo_agent``) whose samples are trajectories through the experiment's environment (``env:``),
kept as tokens.

    prompts --(group_size rows each: the dataset row's columns + "prompt", the prompt's text)-->
    rollouts (one environment per sample; the call's generator shared by ``env.joining``)
      --> seq:        the trajectory's tokens, first prompt included
          prompt_lens: the first prompt's length (start's rendering)
          logprobs:   per response token, the generator's where the model sampled it, else 0
          loss_mask:  per response token, 1 where the model sampled it (what trains)
          scores:     the environment's reward
          env_stats:  per sample, ``ENV_STATS`` (the run's multi-turn metrics)

Everything after the first prompt is the "response" the PPO-family math already handles; the
loss mask (``rayhf.algorithms.seqs.response_index``) keeps the environment's tokens out of the
loss, the KL and ``logprob_mismatch``. GRPO's advantage stays one per trajectory; PPO's
rewards and GAE run over the model's tokens, the environment's skipped.

The environment class may carry ``tools`` (``rayhf.envs.tools.Tool``s): their schemas go into
the chat template's tools section of every trajectory's first prompt. With ``env.agent``
instead, each trajectory is an OpenAI-API agent's run, recorded by ``rayhf.envs.proxy``.
"""

from __future__ import annotations

import asyncio
import time

import torch

from rayhf.algorithms.grpo import GRPOActorInterface
from rayhf.algorithms.interface import CallContext, CallEngine, InterfaceSettings
from rayhf.algorithms.lm import generation_config
from rayhf.algorithms.ppo import PPOActorInterface
from rayhf.data.batch import PackedBatch
from rayhf.envs import sandbox
from rayhf.envs.batcher import ArrivalBatcher, RoundBatcher
from rayhf.envs.env import EnvConfig, Outcome, load_env_class, rollouts
from rayhf.errors import RayhfError
from rayhf.sampling import GenerationConfig

ENDINGS = ("done", "turns", "tokens", "error", "timeout")
# columns of ``env_stats``: model turns, tool calls and errors (as the environment counts them),
# environment seconds, the call's generator idle share, then one flag per ending
ENV_STATS = ("turns", "tool_calls", "tool_errors", "env_seconds", "generator_idle",
             *(f"ended_{e}" for e in ENDINGS))  # fmt: skip


def agent_batch(
    engine: CallEngine,
    batch: PackedBatch,
    cfg: GenerationConfig,
    ctx: CallContext,
    n_samples: int,
    env: EnvConfig,
) -> PackedBatch:
    """``n_samples`` trajectories per prompt (see the module's docstring for the keys)."""
    tok = engine.tokenizer
    prompts = [batch.sample("prompts", i).tolist() for i in range(batch.n_samples)]
    rows = []
    for i, p in enumerate(prompts):
        row = {k: v[i] for k, v in batch.extras.items()}
        row.setdefault("prompt", tok.decode(p, skip_special_tokens=True))
        rows += [row] * n_samples
    seed = ctx.seed * 100_003 + ctx.step * 101 + ctx.dp_rank

    async def run() -> tuple[list[Outcome], float]:
        if env.cls is None:  # the agent server (FastAPI, uvicorn): imported when used,
            from rayhf.envs.proxy import agent_rollouts  # not by every worker

            arrival = ArrivalBatcher(engine, cfg, ctx.step, seed=seed, rows=len(rows),
                                     longest=env.max_tokens)  # fmt: skip
            async with arrival:
                return await agent_rollouts(rows, arrival, tok, env), arrival.busy_seconds
        batcher = _batcher(engine, cfg, ctx.step, seed, len(rows), env)
        tools = [t.schema() for t in getattr(load_env_class(env.cls), "tools", ())]
        async with batcher:
            return await rollouts(rows, batcher, tok, env, tools or None), batcher.busy_seconds

    began = time.monotonic()
    with sandbox.using(env.sandbox):  # the code tool's programs run as the config says
        outcomes, busy = asyncio.run(run())
    idle = 1.0 - busy / max(time.monotonic() - began, 1e-9)
    expanded = [p for p in prompts for _ in range(n_samples)]
    return _pack(batch, outcomes, expanded, n_samples, engine.eos_id, idle)


def _batcher(
    engine: CallEngine, cfg: GenerationConfig, version: int, seed: int, n: int, env: EnvConfig
) -> RoundBatcher | ArrivalBatcher:
    """The call's batcher as ``env.joining`` says: rounds (reproducible) or by arrival."""
    if env.joining == "rounds":
        return RoundBatcher(engine, cfg, version, seed=seed, trajectories=n)
    return ArrivalBatcher(engine, cfg, version, seed=seed, rows=n, longest=env.max_tokens)


def _pack(
    batch: PackedBatch,
    outcomes: list[Outcome],
    prompts: list[list[int]],
    n_samples: int,
    eos: int,
    idle: float,
) -> PackedBatch:
    seqs, plens, logprobs, masks, stats = [], [], [], [], []
    for o, prompt in zip(outcomes, prompts, strict=True):
        t = o.trajectory
        first = t.trained.index(True) if any(t.trained) else len(t.tokens)
        if not t.tokens or first == len(t.tokens):  # no model turn (reset failed): one
            tokens, first = (t.tokens or prompt) + [eos], len(t.tokens or prompt)  # inert token
            trained, lps = [False], [0.0]
        else:
            tokens, trained, lps = t.tokens, t.trained[first:], t.logprobs[first:]
        seqs.append(tokens)
        plens.append(first)
        logprobs += lps
        masks.append(trained)
        ended = [float(o.ended == e) for e in ENDINGS]
        counts = [float(t.turns), float(o.tool_calls), float(o.tool_errors)]
        stats.append([*counts, o.env_seconds, idle, *ended])
    ids = [sid * n_samples + j for sid in batch.sample_ids for j in range(n_samples)]
    out = PackedBatch(ids)
    out.add("seq", torch.tensor([x for s in seqs for x in s]), [len(s) for s in seqs])
    out.add("prompt_lens", torch.tensor(plens), [1] * len(seqs))
    resp = [len(m) for m in masks]
    out.add("logprobs", torch.tensor(logprobs, dtype=torch.float32), resp)
    out.add("loss_mask", torch.tensor([x for m in masks for x in m], dtype=torch.bool), resp)
    out.add(
        "scores", torch.tensor([o.reward for o in outcomes], dtype=torch.float32), [1] * len(seqs)
    )
    if n_samples > 1:
        groups = [sid for sid in batch.sample_ids for _ in range(n_samples)]
        out.add("group_ids", torch.tensor(groups), [1] * len(groups))
    out.add("env_stats", torch.tensor(stats, dtype=torch.float32), [1] * len(seqs))
    for key, values in batch.extras.items():
        out.add_extra(key, [v for v in values for _ in range(n_samples)])
    return out


def env_metrics(engine: CallEngine, batch: PackedBatch) -> dict[str, float]:
    """Means over every dp rank's trajectories: turns, tool calls and errors, environment
    seconds, generator idle share, and the share of each ending (``ended_error``,
    ``ended_timeout``, ``ended_tokens``: truncated...)."""
    columns = batch.tensors["env_stats"].float().mean(0).tolist()
    return engine.all_reduce_mean(dict(zip(ENV_STATS, columns, strict=True)))


class _Agent:
    """What makes an actor interface multi-turn: its generate call runs the experiment's
    ``env:`` (``agent_batch``), its train call adds the environment's metrics."""

    needs_env = True
    name: str
    settings: InterfaceSettings

    def samples_per_prompt(self) -> int:
        return 1

    def generate(self, engine: CallEngine, batch: PackedBatch, ctx: CallContext) -> PackedBatch:
        env = self.settings.env
        if env is None:
            raise RayhfError(
                f"interface {self.name}: add an `env:` section (env.cls or env.agent) to the config"
            )
        cfg = generation_config(self.settings.generation, ctx.args)
        return agent_batch(engine, batch, cfg, ctx, self.samples_per_prompt(), env)

    def train_step(
        self, engine: CallEngine, batch: PackedBatch, ctx: CallContext
    ) -> dict[str, float]:
        stats = super().train_step(engine, batch, ctx)  # type: ignore[misc]
        return {**stats, **env_metrics(engine, batch)}


class GRPOAgentInterface(_Agent, GRPOActorInterface):
    """GRPO over multi-turn trajectories: ``group_size`` trajectories per prompt; trains as
    ``grpo_actor`` does, on the model's tokens only (``loss_mask``)."""

    name = "grpo_agent"

    def samples_per_prompt(self) -> int:
        return self.cfg.group_size


class PPOAgentInterface(_Agent, PPOActorInterface):
    """PPO's actor over multi-turn trajectories: one trajectory per prompt; rewards and GAE
    over the model's tokens (``loss_mask``: the environment's tokens between turns are
    skipped), the critic as ``ppo_critic``."""

    name = "ppo_agent"
