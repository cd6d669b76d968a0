"""Tools a model may call: Python functions with JSON-schema arguments, the calls parsed out of
a model turn, and what each call says back.

A ``Tool``'s ``schema()`` is what chat templates take as ``tools=`` (OpenAI's function format).
``parse_tool_calls`` reads the two formats the supported template families train on:

- ``hermes`` (Qwen2/2.5/3, Hermes, ChatML templates): one or more
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks anywhere in the turn;
- ``llama3``: the turn is one JSON object ``{"name": ..., "parameters": {...}}``, optionally
  after ``<|python_tag|>``.

A call that does not parse, names no known tool or has arguments its schema refuses is not an
exception: it comes back as an error the model reads (``ToolResult.error``), and is counted.
"""

from __future__ import annotations

import ast
import asyncio
import json
import math
import operator
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from rayhf.envs.sandbox import SandboxLimits, SandboxUnavailable, run_python
from rayhf.errors import RayhfError

CallStyle = Literal["hermes", "llama3"]
HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
PYTHON_TAG = "<|python_tag|>"


@dataclass(frozen=True)
class ToolCall:
    """One call parsed from a model turn (``error``: why it could not be, then no name)."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


@dataclass(frozen=True)
class ToolResult:
    """What a call says back, as the content of a ``tool`` message."""

    name: str
    content: str
    error: bool = False


@dataclass(frozen=True)
class Tool:
    """A function the model may call: ``fn(**arguments) -> str``."""

    name: str
    description: str
    parameters: dict[str, Any]  # JSON schema of the arguments, an object
    fn: Callable[..., str]
    sandboxed: bool = False  # runs the model's code: a run that offers it checks the sandbox

    def __post_init__(self) -> None:
        import jsonschema  # here: its import is a fifth of a second every process would pay

        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_-]{0,63}", self.name):
            raise RayhfError(f"tool name {self.name!r}: letters, digits, _ and - only, 1-64")
        try:
            jsonschema.Draft202012Validator.check_schema(self.parameters)
        except jsonschema.SchemaError as e:
            msg = f"tool {self.name}: parameters is not a JSON schema: {e.message}"
            raise RayhfError(msg) from None
        if self.parameters.get("type") != "object":
            raise RayhfError(f'tool {self.name}: parameters must be a schema of "type": "object"')

    def schema(self) -> dict[str, Any]:
        """The tool as chat templates and the OpenAI API describe it."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.parameters,
            },
        }


class ToolRegistry:
    """The tools of an environment, by name."""

    def __init__(self, tools: list[Tool]) -> None:
        self.tools: dict[str, Tool] = {}
        for t in tools:
            if t.name in self.tools:
                raise RayhfError(f"tool {t.name} is registered twice")
            self.tools[t.name] = t

    def schemas(self) -> list[dict[str, Any]]:
        return [t.schema() for t in self.tools.values()]

    def call(self, call: ToolCall) -> ToolResult:
        """Run ``call``; a bad call or a tool that raises comes back as an error result, except
        ``SandboxUnavailable``: a code tool that cannot isolate stops the run (fail closed)."""
        if call.error is not None:
            return ToolResult(call.name, f"error: {call.error}", error=True)
        tool = self.tools.get(call.name)
        if tool is None:
            known = ", ".join(sorted(self.tools))
            return ToolResult(call.name, f"error: no tool {call.name!r} (tools: {known})", True)
        import jsonschema

        try:
            jsonschema.validate(call.arguments, tool.parameters)
        except jsonschema.ValidationError as e:
            return ToolResult(call.name, f"error: bad arguments: {e.message}", error=True)
        try:
            return ToolResult(call.name, str(tool.fn(**call.arguments)))
        except SandboxUnavailable:  # fail closed: the run stops, the program does not run
            raise
        except Exception as e:  # the tool's failure is the model's observation, not the run's
            return ToolResult(call.name, f"error: {type(e).__name__}: {e}", error=True)

    async def acall(self, call: ToolCall) -> ToolResult:
        """``call`` in a worker thread, for an environment's async ``step``: a program the code
        tool runs for seconds then holds up only its own trajectory (the thread keeps this
        context, so the run's ``env.sandbox`` too)."""
        return await asyncio.to_thread(self.call, call)


def parse_tool_calls(text: str, style: CallStyle) -> list[ToolCall]:
    """The tool calls in a model turn (none: the turn is an answer)."""
    if style == "hermes":
        return [_call(body, "arguments") for body in HERMES_CALL.findall(text)]
    body = text.strip().removeprefix(PYTHON_TAG).strip()
    if not body.startswith("{"):
        return []
    return [_call(body, "parameters")]


def _call(body: str, key: str) -> ToolCall:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        return ToolCall("", error=f"the tool call is not JSON ({e.msg})")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return ToolCall("", error='a tool call is a JSON object with a "name"')
    args = obj.get(key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return ToolCall(obj["name"], error=f"{key} is not a JSON object")
    if not isinstance(args, dict):
        return ToolCall(obj["name"], error=f"{key} is not a JSON object")
    return ToolCall(obj["name"], args)


# The calculator: arithmetic on numbers, nothing else (no names, calls or attributes).
_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.USub: operator.neg, ast.UAdd: operator.pos}
MAX_EXPONENT = 1000  # a ** b with |b| above this is refused (9 ** 9 ** 9 would never end)
MAX_EXPRESSION = 500  # characters


def calculate(expression: str) -> str:
    """The value of an arithmetic expression: numbers, + - * / // % ** and parentheses."""
    if len(expression) > MAX_EXPRESSION:
        raise ValueError(f"an expression of at most {MAX_EXPRESSION} characters")
    value = _eval(ast.parse(expression.strip(), mode="eval").body)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError("the result is not a finite number")
        if value.is_integer() and abs(value) < 2**53:
            return str(int(value))
        return repr(round(value, 12))
    return str(value)


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        value: int | float = node.value  # type: ignore[assignment]
        return value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"an exponent of at most {MAX_EXPONENT}")
        return _BINARY[type(node.op)](left, right)
    raise ValueError(f"not arithmetic: {ast.unparse(node)!r}")


CALCULATOR = Tool(
    "calculator",
    "Evaluate an arithmetic expression (numbers, + - * / // % ** and parentheses).",
    {
        "type": "object",
        "properties": {"expression": {"type": "string", "description": "e.g. (12 + 7) * 3"}},
        "required": ["expression"],
        "additionalProperties": False,
    },
    calculate,
)


def run_code(code: str, limits: SandboxLimits | None = None) -> str:
    """A Python program's run in the sandbox, as the model reads it."""
    r = run_python(code, limits)
    lines = [f"exit code: {r.exit_code}"]
    if r.limit is not None:
        lines.append(f"stopped: the {r.limit} limit")
    lines += ["stdout:", r.stdout.rstrip("\n"), "stderr:", r.stderr.rstrip("\n")]
    return "\n".join(lines)


CODE_RUNNER = Tool(
    "python",
    "Run a Python program (standard library only) in a sandbox: its own empty directory, no "
    "network, limited time and memory; returns its exit code, stdout and stderr.",
    {
        "type": "object",
        "properties": {"code": {"type": "string", "description": "the program's source"}},
        "required": ["code"],
        "additionalProperties": False,
    },
    run_code,
    sandboxed=True,
)
