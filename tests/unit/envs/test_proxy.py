"""The agent server (``rayhf.envs.proxy``) as agents that misbehave meet it: an edited history,
a hang, an exception, a run past the turn budget, a reward that is not a number. Each ends its
own trajectory, flagged, and the others go on; the one that behaves is recorded exactly."""

from __future__ import annotations

import asyncio
import json
import re
import time

import pytest

from rayhf.envs.env import EnvConfig, check_env
from rayhf.envs.proxy import agent_rollouts
from rayhf.envs.tools import CALCULATOR
from rayhf.errors import RayhfError
from rayhf.models.tokenizer import CHAT_FORMATS, CHATML, train_bpe_tokenizer

TOK = train_bpe_tokenizer(["Hello there, agent. Done."] * 20, 300, chat_format=CHATML)
TOOLS = [CALCULATOR.schema()]
TEXTS = ["What is 12 * 7? It is 84.", '{"name": "calculator", "expression": "12 * 7"}']
REPLY = [*TOK.encode("Hello", add_special_tokens=False), TOK.eos_token_id]
ASK = [{"role": "user", "content": "Hi"}]


async def _generate(prompt: list[int]) -> tuple[list[int], list[float], int]:
    await asyncio.sleep(0)
    return REPLY, [-0.25] * len(REPLY), 3


async def _ask(client, messages):
    return await client.chat.completions.create(model="m", messages=messages)


async def behaves(client, row):
    reply = await _ask(client, ASK)
    await _ask(client, [*ASK, reply.choices[0].message, {"role": "user", "content": "Done."}])
    return 1.0


async def edits_history(client, row):
    reply = await _ask(client, ASK)
    edited = {"role": "assistant", "content": reply.choices[0].message.content + " there"}
    await _ask(client, [*ASK, edited, {"role": "user", "content": "Done."}])
    return 1.0


async def hangs(client, row):
    await _ask(client, ASK)
    await asyncio.sleep(60)
    return 1.0


async def raises(client, row):
    await _ask(client, ASK)
    raise ValueError("the agent's own bug")


async def loops(client, row):
    messages = list(ASK)
    while True:
        reply = await _ask(client, messages)
        messages += [reply.choices[0].message, {"role": "user", "content": "Again."}]


async def says_high(client, row):
    await _ask(client, ASK)
    return "high"


async def calls_a_tool(client, row):
    messages = [{"role": "user", "content": "What is 12 * 7?"}]
    reply = await client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
    (call,) = reply.choices[0].message.tool_calls
    assert reply.choices[0].finish_reason == "tool_calls"
    messages += [reply.choices[0].message, {"role": "tool", "tool_call_id": call.id,
                                            "content": "84"}]  # fmt: skip
    reply = await client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
    right = json.loads(call.function.arguments) == {"expression": "12 * 7"}
    return float(right and reply.choices[0].message.content == "It is 84.")


def _run(agent: str, generate=_generate, tok=TOK, **kw):
    cfg = EnvConfig(agent=f"{__name__}:{agent}", max_turns=3, step_timeout_s=0.5, **kw)
    return asyncio.run(agent_rollouts([{"prompt": "Hi"}], generate, tok, cfg))[0]


@pytest.mark.parametrize("fmt", sorted(CHAT_FORMATS))
def test_tool_calls_in_each_template_come_back_parsed_and_recorded_exactly(fmt):
    tok = train_bpe_tokenizer(TEXTS * 20, 400, chat_format=CHAT_FORMATS[fmt])
    parser = "llama3" if fmt == "llama3" else "hermes"
    args = {"expression": "12 * 7"}
    if parser == "llama3":
        call = json.dumps({"name": "calculator", "parameters": args})
    else:
        call = f"<tool_call>{json.dumps({'name': 'calculator', 'arguments': args})}</tool_call>"

    sampled = []

    async def generate(prompt):
        text = "It is 84." if "84" in tok.decode(prompt) else call
        sampled.append([*tok.encode(text, add_special_tokens=False), tok.eos_token_id])
        return sampled[-1], [-0.5] * len(sampled[-1]), 0

    out = _run("calls_a_tool", generate, tok, tool_parser=parser)
    assert (out.ended, out.reward, out.tool_calls) == ("done", 1.0, 1)
    t = out.trajectory
    chat = [
        {"role": "user", "content": "What is 12 * 7?"},
        {"role": "assistant", "content": call},
        {"role": "tool", "content": "84"},
        {"role": "assistant", "content": "It is 84."},
    ]
    whole = tok.apply_chat_template(chat, tools=TOOLS, tokenize=False)
    recorded = tok.decode(t.tokens, skip_special_tokens=False)
    assert whole.startswith(recorded) and not whole[len(recorded) :].strip()
    trained = [x for x, f in zip(t.tokens, t.trained, strict=True) if f]
    assert trained == [x for ids in sampled for x in ids]  # as sampled, and only they


def test_a_behaving_agent_is_recorded_token_for_token():
    out = _run("behaves")
    t = out.trajectory
    assert (out.ended, out.reward, t.turns) == ("done", 1.0, 2)
    sampled = [tok for tok, f in zip(t.tokens, t.trained, strict=True) if f]
    assert sampled == REPLY * 2 and t.versions.count(3) == len(sampled)
    chat = [*ASK, {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Done."},
            {"role": "assistant", "content": "Hello"}]  # fmt: skip
    assert TOK.decode(t.tokens) + "\n" == TOK.apply_chat_template(chat, tokenize=False)


def test_misbehaving_agents_end_their_own_trajectory_flagged():
    edited = _run("edits_history")
    assert edited.ended == "error" and "history differs" in edited.info["error"]
    began = time.monotonic()
    hung = _run("hangs", error_reward=-1.0)
    assert (hung.ended, hung.reward) == ("timeout", -1.0) and time.monotonic() - began < 5
    assert hung.env_seconds >= 0.5
    raised = _run("raises")
    assert raised.ended == "error" and "the agent's own bug" in raised.info["error"]
    looped = _run("loops")
    assert (looped.ended, looped.reward, looped.trajectory.turns) == ("turns", 0.0, 3)
    assert "not a reward" in _run("says_high").info["error"]


def test_the_agent_must_be_an_async_function():
    check_env(EnvConfig(agent=f"{__name__}:behaves"))
    with pytest.raises(RayhfError, match=re.escape("async def agent(client, row) -> reward")):
        check_env(EnvConfig(agent=f"{__name__}:_run"))


async def asks_for_logprobs(client, row):
    import openai

    reply = await client.chat.completions.create(model="m", messages=ASK, logprobs=True)
    content = reply.choices[0].logprobs.content
    got = [(t.token, t.logprob, t.top_logprobs) for t in content]
    want = [(TOK.decode([t]), -0.25, []) for t in REPLY]  # as the turn was recorded
    refused = []
    for extra in ({"n": 2}, {"n": 0}, {"logprobs": True, "top_logprobs": 2}):
        try:
            await client.chat.completions.create(model="m", messages=ASK, **extra)
        except openai.BadRequestError as e:
            refused.append(e.body["param"])
    return float(got == want and refused == ["n", "n", "top_logprobs"])


def test_logprobs_are_the_recorded_ones_and_n_or_top_logprobs_are_refused_by_name():
    """n=0 too is refused by name, as ``rayhf serve`` refuses it."""
    out = _run("asks_for_logprobs")
    assert (out.ended, out.reward, out.trajectory.turns) == ("done", 1.0, 1), out.info
