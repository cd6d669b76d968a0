"""The calculator task: multiply two numbers with a tool, over several turns.

A row asks for a product of two 2-3 digit numbers (``{"prompt": "What is 37 * 412?", "answer":
15244}``). The environment (``CalculatorEnv``, named ``rayhf.tasks.calculator:CalculatorEnv``
in a config's ``env.cls``) offers the calculator tool; each model turn is either

- tool calls (Hermes ``<tool_call>`` JSON, or a Llama 3 JSON object): each call's result comes
  back as a ``tool`` message, and the model takes another turn;
- a final answer, ``Answer: <number>``: the trajectory ends with its reward;
- neither: a user message says how to go on, and the model takes another turn.

The reward is 1 only for the right answer that a calculator result in the same trajectory
showed, else 0. So the degenerate behaviours score 0: no call (an answer, however right, that no
tool result showed), the same call repeated (never an answer: the turn budget ends it), an
answer that copies a wrong result, text that is neither call nor answer.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import Any

from rayhf.data.datasets import write_rows
from rayhf.envs.env import Step
from rayhf.envs.tools import CALCULATOR, ToolCall, ToolRegistry, parse_tool_calls
from rayhf.models.tokenizer import CHAT_FORMATS, train_bpe_tokenizer

ANSWER = re.compile(r"answer:\s*(-?\d+)", re.IGNORECASE)
NUDGE = "Call the calculator, or reply with Answer: <number>."
MAX_TURNS = 3  # the agent's own budget (an environment's is env.max_turns)


def make_rows(n: int, seed: int) -> list[dict[str, Any]]:
    """``n`` rows ``{"prompt", "answer"}``, a pure function of ``seed``."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(100, 999), rng.randint(100, 999)
        rows.append({"prompt": f"What is {a} * {b}?", "answer": a * b})
    return rows


def tool_call(question: str) -> str:
    """The call that answers ``question``: its expression, as a Hermes ``<tool_call>``."""
    call = {"name": CALCULATOR.name, "arguments": {"expression": question[8:-1]}}
    return f"<tool_call>{json.dumps(call)}</tool_call>"


def build_tokenizer(
    out_dir: str | Path | None = None, vocab_size: int = 512, chat_format: str = "chatml"
) -> Any:
    """A byte-level BPE tokenizer (a token per digit) with ``chat_format``'s template (tools
    section included: ``rayhf.models.tokenizer.CHAT_FORMATS``), trained on the task's own
    conversations as the template renders them: the tools section, questions, calls, results,
    answers, the nudge."""
    fmt = CHAT_FORMATS[chat_format]
    tok = train_bpe_tokenizer([], 300, chat_format=fmt)  # only to render conversations
    texts = []
    for r in make_rows(256, 1):
        chat = [{"role": "user", "content": r["prompt"]},
                {"role": "assistant", "content": tool_call(r["prompt"])},
                {"role": "tool", "content": str(r["answer"])},
                {"role": "assistant", "content": f"Answer: {r['answer']}"},
                {"role": "user", "content": NUDGE}]  # fmt: skip
        texts.append(
            str(tok.apply_chat_template(chat, tools=[CALCULATOR.schema()], tokenize=False))
        )
    return train_bpe_tokenizer(texts, vocab_size, out_dir, chat_format=fmt, split_digits=True)


def make_dataset(path: str | Path, n: int = 256, seed: int = 0) -> Path:
    """Write ``make_rows(n, seed)`` to ``path`` (.parquet or .jsonl) and return the path."""
    return write_rows(make_rows(n, seed), path)


def make_sft_rows(n: int, seed: int) -> list[dict[str, Any]]:
    """Demonstrations of the tool format for the SFT stage, two rows per question of
    ``make_rows(n, seed)``: the first turn (question -> the calculator call) and the second
    (question, call, the calculator's result -> ``Answer: <result>``). Each row's ``tools``
    column (JSON) puts the calculator in the template's tools section, as the environment does."""
    tools = json.dumps([CALCULATOR.schema()])
    rows = []
    for r in make_rows(n, seed):
        ask = {"role": "user", "content": r["prompt"]}
        call = {"role": "assistant", "content": tool_call(r["prompt"])}
        result = {"role": "tool", "content": str(r["answer"])}
        rows += [{"prompt": [ask], "tools": tools, "response": call["content"]},
                 {"prompt": [ask, call, result], "tools": tools,
                  "response": f"Answer: {r['answer']}"}]  # fmt: skip
    return rows


def make_sft_dataset(path: str | Path, n: int = 512, seed: int = 1) -> Path:
    """Write ``make_sft_rows(n, seed)`` to ``path`` (.parquet or .jsonl) and return the path."""
    return write_rows(make_sft_rows(n, seed), path)


class CalculatorEnv:
    """One trajectory of the calculator task (see the module's docstring)."""

    tools = (CALCULATOR,)
    registry = ToolRegistry(list(tools))

    def __init__(self, row: dict[str, Any]) -> None:
        self.question, self.answer = str(row["prompt"]), int(row["answer"])
        self.shown: set[str] = set()  # what the calculator said back

    async def reset(self) -> list[dict[str, Any]]:
        return [{"role": "user", "content": self.question}]

    async def step(self, turn: str) -> Step:
        calls = parse_tool_calls(turn, "hermes") or parse_tool_calls(turn, "llama3")
        if calls:
            results = [self.registry.call(c) for c in calls]
            self.shown |= {r.content.strip() for r in results if not r.error}
            errors = sum(r.error for r in results)
            return Step([{"role": "tool", "content": r.content} for r in results],
                        info={"tool_calls": len(calls), "tool_errors": errors})  # fmt: skip
        said = ANSWER.search(turn)
        if said is None:
            return Step([{"role": "user", "content": NUDGE}])
        right = int(said.group(1)) == self.answer and said.group(1) in self.shown
        return Step(reward=float(right), done=True)


async def openai_agent(client: Any, row: dict[str, Any]) -> float:
    """The calculator task as an agent written against the OpenAI API (``env.agent:
    rayhf.tasks.calculator:openai_agent``): chat completions with the calculator offered as a
    tool, its calls run here and answered as ``tool`` messages, the same reward and turn budget
    as ``CalculatorEnv``. ``client`` is an ``openai.AsyncOpenAI`` at rayhf's server."""
    answer, shown = int(row["answer"]), set()
    messages: list[Any] = [{"role": "user", "content": str(row["prompt"])}]
    for _ in range(MAX_TURNS):
        reply = await client.chat.completions.create(
            model="policy", messages=messages, tools=[CALCULATOR.schema()]
        )
        message = reply.choices[0].message
        messages.append(message)  # as the client returned it: the server checks the history
        for call in message.tool_calls or []:
            args = json.loads(call.function.arguments)
            result = CalculatorEnv.registry.call(ToolCall(call.function.name, args))
            shown |= {result.content.strip()} if not result.error else set()
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result.content})
        if message.tool_calls:
            continue
        said = ANSWER.search(message.content or "")
        if said is None:
            messages.append({"role": "user", "content": NUDGE})
            continue
        return float(int(said.group(1)) == answer and said.group(1) in shown)
    return 0.0
