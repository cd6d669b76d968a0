"""The HTTP messages of the policy server: the subset of the OpenAI API that rayhf serves.

Routes (``rayhf/serve/app.py``):

* ``GET /v1/models`` -> ``ModelList`` with the one served model id;
* ``POST /v1/completions`` (``CompletionRequest``) -> ``CompletionResponse``, or with
  ``"stream": true`` Server-Sent Events of ``CompletionChunk`` then ``data: [DONE]``;
* ``POST /v1/chat/completions`` (``ChatCompletionRequest``) -> ``ChatCompletionResponse``, or
  a stream of ``ChatCompletionChunk`` (a ``delta`` per piece of text);
* every error -> ``ErrorResponse``: ``{"error": {"message", "type", "code", "param"}}``.

Requests take what vLLM's OpenAI server takes for these options: ``n`` (samples of a prompt,
decoded together from one prefill), ``logprobs``/``top_logprobs`` (chat) and ``logprobs`` (an int,
completions), ``stop``, ``seed``, ``max_tokens`` (and chat's ``max_completion_tokens``),
``temperature``/``top_p``, ``stream``. Log-probs are of the model's raw distribution
(``log_softmax`` of the logits, before temperature and top-k/top-p: vLLM's default
``logprobs_mode``), clamped at -9999 as vLLM writes them. A completion request's choices are
indexed ``prompt * n + sample``. Requests reject unknown fields (``extra="forbid"``), so an
unsupported OpenAI option such as ``presence_penalty`` is a 400 naming the field rather than
silently ignored. ``top_k`` is an extension (as in vLLM).
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    field_validator,
    model_serializer,
    model_validator,
)

FinishReason = Literal["stop", "length"]  # "stop": EOS or a stop string; "length": max_tokens

# Used when the tokenizer has no chat template: one "role: content" line per message, then the
# cue the model completes. A training run that wants chat must use the same rendering.
SIMPLE_CHAT_TEMPLATE = "{role}: {content}\n"
SIMPLE_CHAT_CUE = "assistant:"
# The most alternatives a request may ask for per token (vLLM's default ``max_logprobs``).
MAX_LOGPROBS = 20


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
    n: int = Field(1, ge=1)  # samples per prompt (the server caps prompts x n per request)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None  # up to 4 strings; the text ends before the first one
    seed: int | None = Field(None, ge=0, lt=2**63)  # reproducible sampling (runs in its own batch)
    user: str | None = None  # accepted and ignored, as clients often send it

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

    def token_cap(self) -> int | None:
        """The request's limit on generated tokens (None: the server's default)."""
        return self.max_tokens

    def logprob_count(self) -> int | None:
        """None: no log-probs; k: each token's log-prob and the k most likely tokens."""
        return None


class CompletionRequest(GenerationRequest):
    """``/v1/completions``: one prompt, or a list of prompts answered as one choice each."""

    prompt: str | list[str]
    # each token's log-prob and the k most likely tokens' (with the sampled one: k + 1 at most)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    @field_validator("prompt")
    @classmethod
    def _some_prompt(cls, prompt: str | list[str]) -> str | list[str]:
        if isinstance(prompt, list) and not prompt:
            raise ValueError("the prompt list is empty; send at least one prompt")
        return prompt

    def prompts(self) -> list[str]:
        return [self.prompt] if isinstance(self.prompt, str) else list(self.prompt)

    def logprob_count(self) -> int | None:
        return self.logprobs


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant"]
    content: str


class ChatCompletionRequest(GenerationRequest):
    """``/v1/chat/completions``: the conversation so far; the reply is one assistant message."""

    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False  # each generated token's log-prob
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # and the k most likely
    max_completion_tokens: int | None = Field(None, gt=0)  # OpenAI's newer name; wins

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true; set it, or drop top_logprobs")
        return self

    def token_cap(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def logprob_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class Usage(BaseModel):
    prompt_tokens: int  # bos included
    completion_tokens: int  # generated tokens, EOS or the token completing a stop string included
    total_tokens: int


class CompletionLogprobs(BaseModel):
    """A completion choice's tokens (or a stream chunk's), as OpenAI's legacy format has them."""

    text_offset: list[int]  # where each token's text starts: the sum of earlier tokens' lengths
    token_logprobs: list[float | None]
    tokens: list[str]  # each token decoded alone
    top_logprobs: list[dict[str, float] | None]  # the sampled token first, then the k likeliest


class CompletionChoice(BaseModel):
    index: int  # prompt * n + sample
    text: str
    logprobs: CompletionLogprobs | None = None
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


class ChatTopLogprob(BaseModel):
    token: str  # the token decoded alone
    logprob: float
    bytes: list[int] | None  # the token's text as UTF-8


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob]  # the k most likely tokens at this position, in order


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None


class ChatChoice(BaseModel):
    index: int
    message: ChatMessage
    logprobs: ChatLogprobs | None = None
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
    logprobs: ChatLogprobs | None = None
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
