"""Tools: schemas as chat templates take them, calls parsed from Hermes/Qwen and Llama 3 turns,
bad calls and failing tools as error observations, and the calculator's arithmetic only."""

from __future__ import annotations

import pytest

from rayhf.envs.tools import (
    CALCULATOR,
    CODE_RUNNER,
    Tool,
    ToolCall,
    ToolRegistry,
    calculate,
    parse_tool_calls,
)
from rayhf.errors import RayhfError

REGISTRY = ToolRegistry([CALCULATOR, CODE_RUNNER])


def test_hermes_turns_hold_any_number_of_calls():
    turn = (
        "Let me compute.\n<tool_call>\n"
        '{"name": "calculator", "arguments": {"expression": "2 * 21"}}\n</tool_call>'
        '<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}</tool_call>'
    )
    calls = parse_tool_calls(turn, "hermes")
    assert calls == [
        ToolCall("calculator", {"expression": "2 * 21"}),
        ToolCall("python", {"code": "print(1)"}),  # arguments as a JSON string, too
    ]
    assert parse_tool_calls("The answer is 42.", "hermes") == []


def test_llama3_turns_are_one_json_object():
    turn = '<|python_tag|>{"name": "calculator", "parameters": {"expression": "6 * 7"}}'
    assert parse_tool_calls(turn, "llama3") == [ToolCall("calculator", {"expression": "6 * 7"})]
    assert parse_tool_calls("42", "llama3") == []


@pytest.mark.parametrize(
    ("turn", "says"),
    [
        ("<tool_call>{not json}</tool_call>", "not JSON"),
        ('<tool_call>{"arguments": {}}</tool_call>', '"name"'),
        ('<tool_call>{"name": "calculator", "arguments": [1]}</tool_call>', "not a JSON object"),
        ('<tool_call>{"name": "search", "arguments": {}}</tool_call>', "no tool 'search'"),
        ('<tool_call>{"name": "calculator", "arguments": {"expr": "1"}}</tool_call>', "bad arg"),
        (
            '<tool_call>{"name": "calculator", "arguments": {"expression": "x"}}</tool_call>',
            "not arithmetic",
        ),
    ],
)
def test_a_bad_call_is_an_error_the_model_reads(turn, says):
    (call,) = parse_tool_calls(turn, "hermes")
    result = REGISTRY.call(call)
    assert result.error and result.content.startswith("error: ") and says in result.content


def test_the_calculator_does_arithmetic_and_nothing_else():
    assert REGISTRY.call(ToolCall("calculator", {"expression": "(12 + 7) * 3"})).content == "57"
    assert calculate("7 / 2") == "3.5" and calculate("2 ** 10 // 3 % 100") == "41"
    assert calculate("-4 / 2") == "-2" and calculate("1 / 3") == "0.333333333333"
    for bad in ("__import__('os')", "abs(-1)", "(1).real", "9 ** 9 ** 9", "1 / 0", "[1]"):
        with pytest.raises((ValueError, ZeroDivisionError, SyntaxError)):
            calculate(bad)


def test_the_code_runner_says_what_the_program_did():
    ok = REGISTRY.call(ToolCall("python", {"code": "print(6 * 7)"}))
    assert not ok.error and ok.content.startswith("exit code: 0\nstdout:\n42")
    code = "import socket; socket.create_connection(('127.0.0.1', 9))"
    bad = REGISTRY.call(ToolCall("python", {"code": code}))
    assert "exit code: 1" in bad.content and "ConnectionRefusedError" in bad.content  # its own
    assert not bad.error  # loopback, nobody listening: an observation, not a failed call


def test_schemas_are_what_chat_templates_take_and_bad_tools_are_refused():
    (schema, _) = REGISTRY.schemas()
    assert schema["type"] == "function" and schema["function"]["name"] == "calculator"
    assert schema["function"]["parameters"]["required"] == ["expression"]
    with pytest.raises(RayhfError, match="not a JSON schema"):
        Tool("t", "", {"type": "object", "properties": {"a": {"type": "nonsense"}}}, str)
    with pytest.raises(RayhfError, match='"type": "object"'):
        Tool("t", "", {"type": "string"}, str)
    with pytest.raises(RayhfError, match="tool name"):
        Tool("bad name", "", {"type": "object"}, str)
    with pytest.raises(RayhfError, match="registered twice"):
        ToolRegistry([CALCULATOR, CALCULATOR])
