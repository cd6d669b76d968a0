"""The HTTP messages of the policy server: the subset of the OpenAI API that rayhf serves.

Routes (``rayhf/serve/app.py``):

* ``GET /v1/models`` -> ``ModelList`` with the one served model id;
* ``POST /v1/completions`` (``CompletionRequest``) -> ``CompletionResponse``, or with
  ``"stream": true`` Server-Sent Events of ``CompletionChunk`` then ``data: [DONE]``;
* ``POST /v1/chat/completions`` (``ChatCompletionRequest``) -> ``ChatCompletionResponse``, or
  a stream of ``ChatCompletionChunk`` (a ``delta`` per piece of text);
* every error -> ``ErrorResponse``: ``{"error": {"message", "type", "code", "param"}}``.

Requests reject unknown fields (``extra="forbid"``), so an unsupported OpenAI option such as
``logprobs`` or ``presence_penalty`` is a 400 naming the field rather than silently ignored.
``top_k`` is an extension (as in vLLM). ``n`` must be 1.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer

FinishReason = Literal["stop", "length"]  # "stop": EOS or a stop string; "length": max_tokens

# Used when the tokenizer has no chat template: one "role: content" line per message, then the
# cue the model completes. A training run that wants chat must use the same rendering.
SIMPLE_CHAT_TEMPLATE = "{role}: {content}\n"
SIMPLE_CHAT_CUE = "assistant:"


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False  # a last chunk with empty choices carries the usage


class GenerationRequest(BaseModel):
    """Sampling options shared by both generation routes."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None  # must be the served model id when given
    max_tokens: int | None = Field(None, gt=0)  # None = the server's default_max_tokens
    temperature: float = Field(1.0, ge=0)  # 0 = greedy (argmax)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1)  # extension; 0 or -1 = off
    n: int = 1  # only 1: one choice per prompt
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None  # up to 4 strings; the text ends before the first one
    seed: int | None = Field(None, ge=0, lt=2**63)  # reproducible sampling (runs in its own batch)
    user: str | None = None  # accepted and ignored, as clients often send it

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError("only n=1 is supported; send the request n times instead")
        return n

    @field_validator("stop")
    @classmethod
    def _few_stops(cls, stop: str | list[str] | None) -> str | list[str] | None:
        stops = [stop] if isinstance(stop, str) else stop or []
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop takes at most 4 non-empty strings")
        return stop

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(GenerationRequest):
    """``/v1/completions``: one prompt, or a list of prompts answered as one choice each."""

    prompt: str | list[str]

    @field_validator("prompt")
    @classmethod
    def _some_prompt(cls, prompt: str | list[str]) -> str | list[str]:
        if isinstance(prompt, list) and not prompt:
            raise ValueError("the prompt list is empty; send at least one prompt")
        return prompt

    def prompts(self) -> list[str]:
        return [self.prompt] if isinstance(self.prompt, str) else list(self.prompt)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant"]
    content: str


class ChatCompletionRequest(GenerationRequest):
    """``/v1/chat/completions``: the conversation so far; the reply is one assistant message."""

    messages: list[ChatMessage] = Field(min_length=1)


class Usage(BaseModel):
    prompt_tokens: int  # bos included
    completion_tokens: int  # generated tokens, EOS or the token completing a stop string included
    total_tokens: int


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: None = None
    finish_reason: FinishReason | None  # None in stream chunks before the last


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class CompletionChunk(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None  # only in the final usage chunk (stream_options.include_usage)


class ChatChoice(BaseModel):
    index: int
    message: ChatMessage
    finish_reason: FinishReason


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None  # only in the first chunk
    content: str | None = None

    @model_serializer
    def _drop_unset(self) -> dict[str, Any]:
        """OpenAI deltas omit absent keys; the last chunk's delta is ``{}``."""
        return {k: v for k, v in (("role", self.role), ("content", self.content)) if v is not None}


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    finish_reason: FinishReason | None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "rayhf"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ServerStats(BaseModel):
    """``GET /v1/stats`` (debug, per replica): how generation calls were batched."""

    requests: int  # prompts generated (a prompt list counts each prompt)
    batches: int  # engine calls
    largest_batch: int
    batch_sizes: dict[int, int]  # batch size -> how many batches had it


class ErrorDetail(BaseModel):
    message: str
    type: str  # invalid_request_error | not_found_error | internal_error
    code: str | None = None  # e.g. invalid_json, context_length_exceeded, model_not_found
    param: str | None = None  # the offending request field, when there is one


class ErrorResponse(BaseModel):
    error: ErrorDetail


def render_simple_chat(messages: list[ChatMessage]) -> str:
    """The fallback chat rendering: ``"user: hi\\nassistant:"`` for one user message."""
    turns = "".join(SIMPLE_CHAT_TEMPLATE.format(role=m.role, content=m.content) for m in messages)
    return turns + SIMPLE_CHAT_CUE


def sse_event(chunk: BaseModel) -> str:
    """One Server-Sent Event carrying a JSON chunk."""
    return f"data: {chunk.model_dump_json()}\n\n"


SSE_DONE = "data: [DONE]\n\n"  # the last event of every stream
