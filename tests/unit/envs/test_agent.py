"""The multi-turn generate call (``grpo_agent``) on the calculator task: the trained tokens are
the sampled tokens plus the template's rendering of the environment's messages, the loss mask
covers exactly the sampled ones, the reward holds against its degenerate answers, and the
experiment's env section reaches the call."""

from __future__ import annotations

import asyncio
import json
import re

import pytest
import torch

from rayhf.algorithms.grpo import GRPOConfig
from rayhf.algorithms.interface import CallContext, InterfaceSettings
from rayhf.algorithms.seqs import response_index
from rayhf.data.batch import PackedBatch
from rayhf.envs.agent import ENV_STATS, GRPOAgentInterface
from rayhf.envs.env import EnvConfig
from rayhf.errors import RayhfError
from rayhf.models.tokenizer import CHATML, train_bpe_tokenizer
from rayhf.sampling import GenerateOutput, GenerationConfig
from rayhf.tasks.calculator import CalculatorEnv, make_rows

TOK = train_bpe_tokenizer(["What is 12 * 7? calculator Answer: 84"] * 20, 400, chat_format=CHATML)
ENV = EnvConfig(cls="rayhf.tasks.calculator:CalculatorEnv", max_turns=4)
# the same task as an agent written with the openai client, run against rayhf's server
AGENT = EnvConfig(agent="rayhf.tasks.calculator:openai_agent", max_turns=4)


class ScriptedEngine:
    """A generator that calls the calculator on the question, then answers with its result;
    each sampled token's log-prob is -(its index in the turn + 1) / 100, to be traced."""

    tokenizer = TOK
    eos_id = TOK.eos_token_id
    pad_id = TOK.pad_token_id

    def __init__(self) -> None:
        self.calls: list[int] = []  # prompts per generate call

    def generate(self, prompts: list[list[int]], cfg: GenerationConfig, seed: int):
        self.calls.append(len(prompts))
        out = GenerateOutput()
        for p in prompts:
            seen = TOK.decode(p)
            shown = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", seen)
            if shown:
                text = f"Answer: {shown[-1]}"
            else:
                a, b = re.findall(r"What is (\d+) \* (\d+)", seen)[-1]
                call = {"name": "calculator", "arguments": {"expression": f"{a} * {b}"}}
                text = f"<tool_call>{json.dumps(call)}</tool_call>"
            ids = [*TOK.encode(text, add_special_tokens=False), TOK.eos_token_id]
            out.tokens.append(ids)
            out.logprobs.append([-(i + 1) / 100 for i in range(len(ids))])
            out.finished.append(True)
        return out

    def all_reduce_mean(self, values: dict[str, float]) -> dict[str, float]:
        return values


def _prompts(rows: list[dict]) -> PackedBatch:
    batch = PackedBatch(list(range(len(rows))))
    ids = [TOK.encode(r["prompt"], add_special_tokens=False) for r in rows]
    batch.add("prompts", torch.tensor([t for p in ids for t in p]), [len(p) for p in ids])
    batch.add_extra("answer", [r["answer"] for r in rows])
    return batch


def _generate(env: EnvConfig | None = ENV, rows: list[dict] | None = None):
    settings = InterfaceSettings(GRPOConfig(group_size=2), GenerationConfig(), env=env)
    engine = ScriptedEngine()
    out = GRPOAgentInterface(settings).generate(
        engine, _prompts(rows or make_rows(3, 0)), CallContext(0, 0, 1, 0)
    )
    return out, engine


@pytest.mark.parametrize("env", [ENV, AGENT], ids=["environment", "openai_agent"])
def test_trajectories_are_sampled_tokens_plus_rendered_messages(env):
    out, engine = _generate(env)
    assert out.n_samples == 6 and out.tensors["scores"].tolist() == [1.0] * 6
    assert sum(engine.calls) == 12  # two turns each
    if env is ENV:
        assert engine.calls[0] == 6  # every trajectory's first turn in one batch
    _, mask = response_index(out)
    for i in range(out.n_samples):
        seq = out.sample("seq", i).tolist()
        first = int(out.tensors["prompt_lens"][i])
        flags = out.sample("loss_mask", i).tolist()
        logprobs = out.sample("logprobs", i).tolist()
        assert len(flags) == len(logprobs) == len(seq) - first
        # the whole conversation, rendered at once, is the trajectory's token list
        sampled = [t for t, f in zip(seq[first:], flags, strict=True) if f]
        turns = TOK.decode(sampled).split(TOK.eos_token)[:-1]
        assert len(turns) == 2 and "<tool_call>" in turns[0] and turns[1].startswith("Answer:")
        q = out.extras["answer"][i]
        question = re.findall(r"What is \d+ \* \d+\?", TOK.decode(seq))[0]
        messages = [{"role": "user", "content": question},
                    {"role": "assistant", "content": turns[0]},
                    {"role": "tool", "content": str(q)},
                    {"role": "assistant", "content": turns[1]}]  # fmt: skip
        whole = TOK.apply_chat_template(
            messages, tools=[t.schema() for t in CalculatorEnv.tools], tokenize=False
        )
        assert TOK.decode(seq) + "\n" == whole
        # the log-probs are the generator's, in place, and 0 on the environment's tokens
        runs = [lp for lp, f in zip(logprobs, flags, strict=True) if f]
        expected = [-(j + 1) / 100 for t in turns for j in range(len(TOK.encode(t)) + 1)]
        assert runs == pytest.approx(expected)
        assert all(lp == 0.0 for lp, f in zip(logprobs, flags, strict=True) if not f)
        assert mask[i].sum() == sum(flags) < len(flags)
    stats = dict(zip(ENV_STATS, out.tensors["env_stats"].mean(0).tolist(), strict=True))
    assert stats["turns"] == 2 and stats["tool_calls"] == 1 and stats["ended_done"] == 1


class Degenerate(ScriptedEngine):
    """Answers a fixed behaviour each turn instead of the scripted agent's."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text

    def generate(self, prompts, cfg, seed):
        ids = [*TOK.encode(self.text, add_special_tokens=False), TOK.eos_token_id]
        return GenerateOutput([ids] * len(prompts), [[-0.5] * len(ids)] * len(prompts))


@pytest.mark.parametrize(
    "text",
    [
        "Answer: {answer}",  # right, but no tool showed it
        '<tool_call>{{"name": "calculator", "arguments": {{"expression": "1 + 1"}}}}</tool_call>',
        "I think it is {answer}",  # neither a call nor an answer
        "Answer: 2",
    ],
)
@pytest.mark.parametrize("env", [ENV, AGENT], ids=["environment", "openai_agent"])
def test_degenerate_behaviours_score_nothing(text, env):
    rows = make_rows(4, 1)
    settings = InterfaceSettings(GRPOConfig(group_size=2), GenerationConfig(), env=env)
    scores = []
    for row in rows:
        engine = Degenerate(text.format(answer=row["answer"]))
        out = GRPOAgentInterface(settings).generate(
            engine, _prompts([row]), CallContext(0, 0, 1, 0)
        )
        scores += out.tensors["scores"].tolist()
    assert max(scores) <= 0.3


def test_a_call_without_an_env_section_is_one_line():
    with pytest.raises(RayhfError, match="env:"):
        _generate(env=None)


def test_the_calculator_environment_alone():
    env = CalculatorEnv({"prompt": "What is 3 * 4?", "answer": 12})
    first = asyncio.run(env.reset())
    assert first == [{"role": "user", "content": "What is 3 * 4?"}]
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "3 * 4"}}</tool_call>'
    step = asyncio.run(env.step(call))
    assert step.messages == [{"role": "tool", "content": "12"}] and not step.done
    assert asyncio.run(env.step("Answer: 12")).reward == 1.0
