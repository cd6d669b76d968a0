"""Token-exact multi-turn trajectories over three chat templates built here (ChatML/Qwen,
Llama 3, Gemma): the model's tokens stay exactly as sampled, the environment's are the
template's own, the loss mask marks the model's tokens only, and a template that rewrites
earlier turns is caught."""

from __future__ import annotations

import json

import pytest

from rayhf.envs.tools import CALCULATOR, parse_tool_calls
from rayhf.envs.trajectory import (
    TemplateMismatch,
    add_messages,
    add_model_turn,
    check_template,
    start,
)
from rayhf.models.tokenizer import CHAT_FORMATS, ChatFormat, train_bpe_tokenizer

TOOLS = [CALCULATOR.schema()]
TEXTS = ["What is 12 * 7? Let me use the calculator.", '{"expression": "12 * 7"} 84 The answer']


def _call(fmt: str, expression: str) -> str:
    if fmt == "llama3":
        return json.dumps({"name": "calculator", "parameters": {"expression": expression}})
    args = json.dumps({"name": "calculator", "arguments": {"expression": expression}})
    return f"I will compute it.\n<tool_call>{args}</tool_call>"


@pytest.fixture(scope="module", params=sorted(CHAT_FORMATS))
def fmt(request):
    chat = CHAT_FORMATS[request.param]
    return request.param, train_bpe_tokenizer(TEXTS * 20, vocab_size=400, chat_format=chat)


def test_three_turns_with_tool_calls_render_as_the_whole_conversation(fmt):
    name, tok = fmt
    turns = [(_call(name, "12 * 7"), "84"), (_call(name, "84 + 1"), "85"), ("It is 85.", "ok")]
    check_template(tok, TOOLS, turns)  # raises where incremental tokens differ


def test_sampled_tokens_stay_as_sampled_and_only_they_are_trained(fmt):
    name, tok = fmt
    traj = start(tok, [{"role": "user", "content": "What is 12 * 7?"}], TOOLS)
    n_prompt = len(traj.tokens)
    text = _call(name, "12 * 7")
    # one token per character: not how the tokenizer would encode the text (a re-encode would
    # change them), but what a model may sample
    sampled = [tok.convert_tokens_to_ids(t) for t in tok.tokenize(text[0])]
    sampled += [i for ch in text[1:] for i in tok.encode(ch, add_special_tokens=False)]
    sampled.append(tok.eos_token_id)
    assert sampled[:-1] != tok.encode(text, add_special_tokens=False)
    assert add_model_turn(traj, tok, sampled, [-0.5] * len(sampled), version=3) == text
    (call,) = parse_tool_calls(text, "llama3" if name == "llama3" else "hermes")
    assert call.arguments == {"expression": "12 * 7"}
    reply = add_messages(traj, tok, [{"role": "tool", "content": "84"}])
    turn = slice(n_prompt, n_prompt + len(sampled))
    assert traj.tokens[turn] == sampled  # never decoded and encoded again
    assert traj.trained == [False] * n_prompt + [True] * len(sampled) + [False] * len(reply)
    assert traj.logprobs[turn] == [-0.5] * len(sampled) and set(traj.versions[turn]) == {3}
    whole = tok.apply_chat_template(traj.messages, tools=TOOLS, add_generation_prompt=True,
                                    tokenize=False)  # fmt: skip
    assert tok.decode(traj.tokens, skip_special_tokens=False) == whole


def test_a_turn_cut_short_gets_its_end_from_the_template(fmt):
    _, tok = fmt
    traj = start(tok, [{"role": "user", "content": "Hi"}], None)
    sampled = tok.encode("I will", add_special_tokens=False)  # max_new_tokens hit: no eos
    add_model_turn(traj, tok, sampled, [0.0] * len(sampled))
    added = add_messages(traj, tok, [{"role": "user", "content": "Go on"}])
    assert tok.eos_token_id in added  # the turn's end, written by the template, not trained
    whole = tok.apply_chat_template(traj.messages, add_generation_prompt=True, tokenize=False)
    assert tok.decode(traj.tokens, skip_special_tokens=False) == whole


def test_a_template_that_rewrites_earlier_turns_is_refused():
    # like templates that drop earlier turns' reasoning: only the last assistant turn is whole
    template = (
        "{% for m in messages %}{% set c = m['content'] if loop.last or m['role'] != "
        "'assistant' else '...' %}{{ '<|im_start|>' + m['role'] + '\\n' + c + '<|im_end|>\\n' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    chat = ChatFormat("drops", template, CHAT_FORMATS["chatml"].specials, "<|im_end|>")
    tok = train_bpe_tokenizer(TEXTS * 20, vocab_size=400, chat_format=chat)
    with pytest.raises(TemplateMismatch, match="renders earlier turns differently"):
        check_template(tok, [], [("Thinking hard. 84", "ok")])
