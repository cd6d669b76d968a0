"""Agents written against the OpenAI API, run as rollouts: rayhf serves the policy being trained
at a local chat-completions URL, one per trajectory, and records each trajectory token by token
on the server side, so nothing the model sampled is ever decoded and re-encoded.

    agent(client, row) -> reward            the user's code, ``openai.AsyncOpenAI`` at base_url
      POST {base_url}/chat/completions      messages: the conversation so far
        -> the messages that are new since the last reply (tool results, user turns): appended
           as the chat template renders them (``trajectory.add_messages``)
        -> the model's turn: sampled by the call's generator, appended as sampled
        -> the reply: the turn's text, its tool calls parsed (``env.tool_parser``) into
           ``tool_calls``; finish_reason "tool_calls", "stop" or "length"

The server trusts its own record, not the client's copy: the history a request sends must be
the one this session served (the assistant turns as replied), else the request is refused, since
an edited history could not be trained token-exactly. The first request's ``tools`` go into the
template's tools section; sampling follows the call's generation settings, not the request's.
``logprobs: true`` returns the model turn's log-probs as recorded for training (under the
call's temperature, not the raw distribution ``rayhf serve`` reports); ``top_logprobs`` > 0 and
an ``n`` other than 1 are refused naming the field: a session records one trajectory, so a model
turn has one continuation, and the generate call keeps only the sampled tokens' log-probs.
Budgets as for environments: a request past ``env.max_turns`` or ``env.max_tokens`` is refused
(the trajectory ends "turns" or "tokens", reward 0); an agent that raises ends "error", one that
spends more than ``env.step_timeout_s`` between two model turns is cancelled and ends "timeout".
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from rayhf.envs.env import EnvConfig, Generate, Outcome, load_agent
from rayhf.envs.tools import parse_tool_calls
from rayhf.envs.trajectory import Trajectory, add_messages, add_model_turn, start
from rayhf.errors import RayhfError
from rayhf.sampling import chat_token_logprob

Agent = Callable[[Any, dict[str, Any]], Awaitable[float]]


class _Message(BaseModel):
    """A chat message as the OpenAI client sends it (fields the server does not read pass)."""

    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[dict[str, Any]] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):  # content parts: the text ones, joined
            return "".join(str(p.get("text", "")) for p in self.content)
        return self.content or ""

    def key(self) -> tuple[str, str, tuple[tuple[str, str], ...]]:
        """What two copies of one message share: role, text, and tool calls (name, arguments)."""
        calls = []
        for c in self.tool_calls or []:
            fn = c.get("function") or {}
            args = fn.get("arguments", "{}")
            with contextlib.suppress(json.JSONDecodeError, TypeError):
                args = json.dumps(json.loads(args), sort_keys=True)
            calls.append((str(fn.get("name")), str(args)))
        return self.role, self.text().strip(), tuple(calls)

    def for_template(self) -> dict[str, Any]:
        return {"role": "system" if self.role == "developer" else self.role, "content": self.text()}


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")

    messages: list[_Message] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    n: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None

    def refused_field(self) -> tuple[str, str] | None:
        """(field, message) for an option a trajectory cannot honour."""
        if self.n is not None and self.n < 1:
            return "n", f"n={self.n}: a request asks for at least one continuation; send n=1"
        if self.n is not None and self.n > 1:
            why = "a trajectory has one continuation per model turn; run n agents instead"
            return "n", f"n: not served here: {why}"
        if self.top_logprobs:
            why = "the rollout records only the sampled tokens' log-probs"
            return "top_logprobs", f"top_logprobs: not served here: {why}"
        return None


class _Refused(Exception):
    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class _Session:
    """One trajectory's server-side record."""

    traj: Trajectory | None = None
    seen: tuple[tuple[Any, ...], ...] = ()  # message keys of the conversation served so far
    tools: list[dict[str, Any]] | None = None
    ended: str | None = None  # "turns" or "tokens" once a budget refused a request
    tool_calls: int = 0
    tool_errors: int = 0  # calls in the model's text that did not parse
    env_seconds: float = 0.0  # the agent's time between replies and requests
    waiting_since: float | None = None  # monotonic time of the last reply; None while sampling
    failure: RayhfError | None = None  # a template error: the run's, not the agent's


class AgentServer:
    """The sessions of one generate call and the HTTP app that serves them."""

    def __init__(self, generate: Generate, tok: Any, cfg: EnvConfig) -> None:
        self.generate, self.tok, self.cfg = generate, tok, cfg
        self.sessions: dict[int, _Session] = {}
        self.app = FastAPI()
        self.app.post("/sessions/{sid}/v1/chat/completions")(self._route)

    async def _route(self, sid: int, request: Request) -> JSONResponse:
        session = self.sessions.get(sid)
        if session is None:
            return _error(404, f"no session {sid}", "not_found")
        try:
            req = _Request.model_validate(await request.json())
            refused = req.refused_field()
            if refused is not None:
                field, message = refused
                return _error(400, message, "invalid_value", field)
            return JSONResponse(await self._complete(sid, session, req))
        except ValidationError as e:
            return _error(400, str(e).splitlines()[0], "invalid_request")
        except _Refused as e:
            return _error(400, str(e), e.code)
        except RayhfError as e:
            session.failure = e
            return _error(500, str(e), "template")

    async def _complete(self, sid: int, s: _Session, req: _Request) -> dict[str, Any]:
        if s.waiting_since is not None:
            s.env_seconds += time.monotonic() - s.waiting_since
        s.waiting_since = None
        try:
            self._extend(s, req)
            return await self._turn(sid, s, req)
        finally:
            s.waiting_since = time.monotonic()

    def _extend(self, s: _Session, req: _Request) -> None:
        """Bring the session's tokens up to the request's conversation."""
        keys = tuple(m.key() for m in req.messages)
        if s.traj is None:
            s.traj = start(self.tok, [m.for_template() for m in req.messages], req.tools)
            s.tools = req.tools
        else:
            if req.tools != s.tools:
                raise _Refused(
                    "the tools changed within a trajectory; send the same tools", "tools"
                )
            if keys[: len(s.seen)] != s.seen:
                raise _Refused(
                    "the conversation's history differs from the one this session served; send "
                    "the earlier messages and replies unchanged, then the new ones",
                    "history",
                )
            new = req.messages[len(s.seen) :]
            if not new or any(m.role == "assistant" for m in new):
                raise _Refused(
                    "after a reply send only new tool, user or system messages: an assistant "
                    "turn the model did not sample cannot be trained on",
                    "history",
                )
            add_messages(s.traj, self.tok, [m.for_template() for m in new])
        s.seen = keys
        if s.traj.turns >= self.cfg.max_turns:
            s.ended = "turns"
            raise _Refused(f"the trajectory has had env.max_turns={self.cfg.max_turns}", "turns")
        if len(s.traj.tokens) >= self.cfg.max_tokens:
            s.ended = "tokens"
            raise _Refused(f"the trajectory holds env.max_tokens={self.cfg.max_tokens}", "tokens")

    async def _turn(self, sid: int, s: _Session, req: _Request) -> dict[str, Any]:
        traj = s.traj
        assert traj is not None
        before = len(traj.tokens)
        ids, logprobs, version = await self.generate(traj.tokens)
        room = self.cfg.max_tokens - before
        ids, logprobs = ids[:room], logprobs[:room]
        text = add_model_turn(traj, self.tok, ids, logprobs, version)
        calls = parse_tool_calls(text, self.cfg.tool_parser)
        s.tool_errors += sum(c.error is not None for c in calls)
        good = [] if any(c.error for c in calls) else calls  # a broken call: the turn is text
        s.tool_calls += len(good)
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if good:
            content = (
                text.split("<tool_call>")[0].strip() if self.cfg.tool_parser == "hermes" else ""
            )
            message["content"] = content or None
            message["tool_calls"] = [
                {"id": f"call_{sid}_{traj.turns}_{j}", "type": "function",
                 "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
                for j, c in enumerate(good)
            ]  # fmt: skip
        s.seen = (*s.seen, _Message.model_validate(message).key())
        ended = bool(ids) and ids[-1] == self.tok.eos_token_id
        finish = "tool_calls" if good else "stop" if ended else "length"
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish}
        if req.logprobs:
            texts = [self.tok.decode([t]) for t in ids]  # each token alone, special ones kept
            entries = [chat_token_logprob(*p) for p in zip(texts, logprobs, strict=True)]
            choice["logprobs"] = {"content": entries}
        return {
            "id": f"chatcmpl-{sid}-{traj.turns}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": str(getattr(req, "model", None) or "rayhf-policy"),
            "choices": [choice],
            "usage": {
                "prompt_tokens": before,
                "completion_tokens": len(ids),
                "total_tokens": before + len(ids),
            },
        }

    async def run(
        self, agent: Agent, sid: int, row: dict[str, Any], base: str, http: Any
    ) -> Outcome:
        """One agent to its end; its trajectory as the server recorded it."""
        import openai

        s = self.sessions[sid] = _Session(waiting_since=time.monotonic())
        client = openai.AsyncOpenAI(base_url=f"{base}/sessions/{sid}/v1", api_key="rayhf",
                                    max_retries=0, timeout=None, http_client=http)  # fmt: skip
        ended, reward, info = await self._watch(asyncio.ensure_future(agent(client, row)), s)
        if s.failure is not None:
            raise s.failure
        if s.waiting_since is not None:
            s.env_seconds += time.monotonic() - s.waiting_since
        traj = s.traj or Trajectory([], [], [], [], [])
        return Outcome(traj, reward, ended, s.env_seconds, s.tool_calls, s.tool_errors, info)

    async def _watch(
        self, task: asyncio.Future[float], s: _Session
    ) -> tuple[str, float, dict[str, Any]]:
        limit = self.cfg.step_timeout_s
        while not task.done():
            idle = 0.0 if s.waiting_since is None else time.monotonic() - s.waiting_since
            if idle >= limit:
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
                return "timeout", self.cfg.error_reward, {}
            await asyncio.wait({task}, timeout=limit - idle)
        if s.ended is not None:
            return s.ended, 0.0, {}
        if task.exception() is not None:
            return "error", self.cfg.error_reward, {"error": repr(task.exception())}
        if s.traj is None:
            return "error", self.cfg.error_reward, {"error": "the agent made no request"}
        try:
            return "done", float(task.result()), {}
        except (TypeError, ValueError):
            error = f"the agent returned {task.result()!r}, not a reward"
            return "error", self.cfg.error_reward, {"error": error}


def _error(status: int, message: str, code: str, param: str | None = None) -> JSONResponse:
    error = {"message": message, "type": "invalid_request_error", "code": code, "param": param}
    return JSONResponse({"error": error}, status_code=status)


class _Quiet(uvicorn.Server):
    """A server inside a Ray worker: the worker's signal handlers stay its own."""

    def install_signal_handlers(self) -> None:
        pass

    @contextlib.contextmanager
    def capture_signals(self) -> Any:
        yield


@contextlib.asynccontextmanager
async def serving(app: FastAPI) -> AsyncIterator[str]:
    """``app`` on a free localhost port for the ``async with`` block; yields its base URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    server = _Quiet(uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False))
    task = asyncio.ensure_future(server.serve(sockets=[sock]))
    while not server.started:
        if task.done():
            task.result()  # it failed to start: raise why
        await asyncio.sleep(0.005)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        await task
        sock.close()


async def agent_rollouts(
    rows: list[dict[str, Any]], generate: Generate, tok: Any, cfg: EnvConfig
) -> list[Outcome]:
    """A trajectory per row, each an ``env.agent`` run against its own base URL; in row order,
    at most ``env.concurrency`` agents at a time."""
    assert cfg.agent is not None
    agent = load_agent(cfg.agent)
    server = AgentServer(generate, tok, cfg)
    gate = asyncio.Semaphore(cfg.concurrency)

    http = _shared_http()  # one connection pool: a client of its own each cost ~20 ms to make

    async def one(sid: int, row: dict[str, Any], base: str) -> Outcome:
        async with gate:
            return await server.run(agent, sid, dict(row), base, http)

    try:
        async with serving(server.app) as base:
            return list(await asyncio.gather(*(one(i, r, base) for i, r in enumerate(rows))))
    finally:
        await http.close_pool()


def _shared_http() -> Any:
    """The call's agents' connection pool (the openai package's own HTTP client class, which
    differs between its versions); an agent closing its client leaves the pool open."""
    import openai

    class Shared(openai.DefaultAsyncHttpxClient):  # type: ignore[misc]
        async def aclose(self) -> None:
            pass

        async def close_pool(self) -> None:
            await super().aclose()

    return Shared(timeout=None)
