"""The Ray Serve application: an OpenAI-compatible HTTP API in front of a ``ServingEngine``.

    HTTP -> FastAPI route -> body parsed by ``protocol.py`` (any content type; 400 on failure)
         -> engine.prepare per prompt (tokenize, limits; 400 on failure)
         -> @serve.batch queue: concurrent prompts of all requests grouped, up to max_batch_size
         -> engine.generate in a worker thread (the event loop keeps accepting requests): per
            sampling group one decode call of prompts x n rows, max_batch_size of them at once
         -> JSON response, or SSE chunks replaying each output's per-token text pieces
            (a request's n samples are n rows of one generate call; choices indexed by sample)

``build_app(args)`` is the entry point of ``serve run``/``serve deploy`` configs and KubeRay
RayService manifests (``import_path: rayhf.serve.app:build_app``); ``serve_checkpoint`` starts
Serve and blocks, for the CLI. ``GET /v1/stats`` reports the replica's batch sizes (debug) and
``GET /health`` answers 200 once the model is loaded.
"""

# No `from __future__ import annotations`: FastAPI must see the route annotations as classes,
# which it cannot resolve from strings once Serve's ingress has rewritten the methods.
import asyncio
import os
import secrets
import signal
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import Field, ValidationError, model_validator
from ray import serve
from ray.serve import Application
from starlette.exceptions import HTTPException as StarletteHTTPException

from rayhf.errors import RayhfError
from rayhf.sampling import LOGPROB_FLOOR, chat_token_logprob
from rayhf.serve.engine import (
    EngineOutput,
    EngineRequest,
    RequestRejected,
    SamplingSpec,
    ServingEngineConfig,
    TokenLogprob,
    check_adapters,
    check_checkpoint,
    load_engine,
    require_vllm,
)
from rayhf.serve.protocol import (
    SSE_DONE,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatMessage,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    ErrorDetail,
    ErrorResponse,
    GenerationRequest,
    ModelCard,
    ModelList,
    ServerStats,
    Usage,
    render_simple_chat,
    sse_event,
)

APP_NAME = "policy"


class ServeConfig(ServingEngineConfig):
    """``build_app``'s args: the engine's fields plus how the deployment runs."""

    model_id: str | None = None  # None = the checkpoint directory's name
    # Prompts one generate call batches, at most; also the rows (prompts x n) the engine
    # decodes at once (its KV cache's rows: further rows wait for one to end), and the most
    # prompts x n one request may ask for.
    max_batch_size: int = Field(16, gt=0)
    # How long a batch waits to fill up. benchmarks/serve_latency.py, 16 clients on 2 cores:
    # 0.01 s -> mean batch 4, 30 req/s; 0.05 s -> 16, 63 req/s; a lone request pays the wait.
    batch_wait_timeout_s: float = Field(0.05, ge=0)
    num_replicas: int = Field(1, gt=0)
    num_cpus: float = Field(1.0, gt=0)  # per replica; also its torch threads (at least 1)
    # requests to /v1/... must send "Authorization: Bearer <api_key>" (401 otherwise); /health
    # stays open for probes. None: no key, as vLLM's server without --api-key.
    api_key: str | None = Field(None, min_length=1, repr=False)

    @property
    def served_model_id(self) -> str:
        return self.model_id or Path(self.checkpoint).name

    @model_validator(mode="after")
    def _adapters_named_apart(self) -> "ServeConfig":
        if self.served_model_id in self.adapters:
            raise ValueError(
                f"adapters: {self.served_model_id!r} is the checkpoint's model id; name the "
                "adapter otherwise"
            )
        return self

    @property
    def max_ongoing_requests(self) -> int:
        """Per replica: one batch generating while the next one fills."""
        return 2 * self.max_batch_size


def parse_args(args: dict[str, Any]) -> ServeConfig:
    """Validate ``build_app`` args; a mistake is one RayhfError line naming the fields."""
    try:
        return ServeConfig.model_validate(args)
    except ValidationError as e:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or 'args'}: {err['msg']}" for err in e.errors()
        )
        raise RayhfError(f"serve args: {problems}") from None


def sampling_spec(body: GenerationRequest, cfg: ServeConfig) -> SamplingSpec:
    """The engine's view of a request's sampling options; temperature 0 means greedy."""
    return SamplingSpec(
        max_tokens=body.token_cap() or cfg.default_max_tokens,
        greedy=body.temperature == 0,
        temperature=body.temperature or 1.0,
        top_k=max(body.top_k, 0),
        top_p=body.top_p,
        seed=body.seed,
        stop=body.stop_strings(),
        n=body.n,
        logprobs=body.logprob_count(),
    )


def usage_of(outputs: list[list[EngineOutput]]) -> Usage:
    """Per prompt its samples: the prompt counted once, every sample's tokens."""
    prompt = sum(samples[0].prompt_tokens for samples in outputs if samples)
    completion = sum(o.completion_tokens for samples in outputs for o in samples)
    return Usage(
        prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
    )


def _floor(logprob: float) -> float:
    return max(logprob, LOGPROB_FLOOR)


def completion_logprobs(tokens: tuple[TokenLogprob, ...], offset: int = 0) -> CompletionLogprobs:
    """OpenAI's legacy log-probs of ``tokens``, the first starting at ``offset`` in the text."""
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t.token)
    return CompletionLogprobs(
        text_offset=offsets,
        token_logprobs=[_floor(t.logprob) for t in tokens],
        tokens=[t.token for t in tokens],
        top_logprobs=[
            {t.token: _floor(t.logprob), **{s: _floor(v) for s, v in t.top}} for t in tokens
        ],
    )


def chat_logprobs(tokens: tuple[TokenLogprob, ...]) -> ChatLogprobs:
    content = [chat_token_logprob(t.token, t.logprob, t.top) for t in tokens]
    return ChatLogprobs.model_validate({"content": content})


def completion_response(
    rid: str, model: str, outputs: list[list[EngineOutput]]
) -> CompletionResponse:
    """Choice ``prompt * n + sample`` for each sample of each prompt."""
    choices = [
        CompletionChoice(
            index=i,
            text=o.text,
            logprobs=None if o.logprobs is None else completion_logprobs(o.logprobs),
            finish_reason=o.finish_reason,
        )
        for i, o in enumerate(o for samples in outputs for o in samples)
    ]
    return CompletionResponse(id=rid, model=model, choices=choices, usage=usage_of(outputs))


def _steps(out: EngineOutput) -> Iterator[tuple[str, tuple[TokenLogprob, ...]]]:
    """A stream's pieces of ``out``: one per non-empty piece, or with log-probs one per token
    (each with its token's log-probs, its piece possibly empty)."""
    if out.logprobs is None:
        yield from ((piece, ()) for piece in filter(None, out.pieces))
        return
    yield from ((piece, (lp,)) for piece, lp in zip(out.pieces, out.logprobs, strict=True))


def completion_events(
    rid: str, model: str, outputs: list[list[EngineOutput]], include_usage: bool
) -> Iterator[str]:
    """SSE events: each choice's text pieces, its finish chunk, [usage], then [DONE]."""
    created = int(time.time())

    def chunk(choices: list[CompletionChoice], usage: Usage | None = None) -> str:
        return sse_event(
            CompletionChunk(id=rid, created=created, model=model, choices=choices, usage=usage)
        )

    for i, out in enumerate(o for samples in outputs for o in samples):
        offset = 0
        for piece, lps in _steps(out):
            logprobs = None if out.logprobs is None else completion_logprobs(lps, offset)
            offset += sum(len(t.token) for t in lps)
            choice = CompletionChoice(index=i, text=piece, logprobs=logprobs, finish_reason=None)
            yield chunk([choice])
        yield chunk([CompletionChoice(index=i, text="", finish_reason=out.finish_reason)])
    if include_usage:
        yield chunk([], usage_of(outputs))
    yield SSE_DONE


def chat_response(rid: str, model: str, outs: list[EngineOutput]) -> ChatCompletionResponse:
    choices = [
        ChatChoice(
            index=j,
            message=ChatMessage(role="assistant", content=out.text),
            logprobs=None if out.logprobs is None else chat_logprobs(out.logprobs),
            finish_reason=out.finish_reason,
        )
        for j, out in enumerate(outs)
    ]
    return ChatCompletionResponse(id=rid, model=model, choices=choices, usage=usage_of([outs]))


def chat_events(
    rid: str, model: str, outs: list[EngineOutput], include_usage: bool
) -> Iterator[str]:
    """SSE events per choice: a role delta, one content delta per piece (per token with
    log-probs), an empty finish delta; then [usage] and [DONE]."""
    created = int(time.time())

    def chunk(choices: list[ChatChunkChoice], usage: Usage | None = None) -> str:
        return sse_event(
            ChatCompletionChunk(id=rid, created=created, model=model, choices=choices, usage=usage)
        )

    for j, out in enumerate(outs):
        opening = ChatDelta(role="assistant", content="")
        yield chunk([ChatChunkChoice(index=j, delta=opening, finish_reason=None)])
        for piece, lps in _steps(out):
            logprobs = None if out.logprobs is None else chat_logprobs(lps)
            delta = ChatDelta(content=piece)
            choice = ChatChunkChoice(index=j, delta=delta, logprobs=logprobs, finish_reason=None)
            yield chunk([choice])
        yield chunk([ChatChunkChoice(index=j, delta=ChatDelta(), finish_reason=out.finish_reason)])
    if include_usage:
        yield chunk([], usage_of([outs]))
    yield SSE_DONE


def error_response(
    status: int, message: str, kind: str, code: str | None = None, param: str | None = None
) -> JSONResponse:
    detail = ErrorDetail(message=message, type=kind, code=code, param=param)
    return JSONResponse(ErrorResponse(error=detail).model_dump(), status_code=status)


api = FastAPI(title="rayhf policy server", docs_url=None, redoc_url=None)


def validation_error_response(errors: list[Any]) -> JSONResponse:
    """400 naming each bad field; a body that is not JSON gets its own code."""
    if errors and errors[0].get("type") == "json_invalid":
        reason = errors[0].get("ctx", {}).get("error", "malformed")
        message = f"the body is not valid JSON: {reason}"
        return error_response(400, message, "invalid_request_error", "invalid_json")
    where = [[str(p) for p in e["loc"] if p != "body"] for e in errors]
    message = "; ".join(
        f"{'.'.join(w) or 'body'}: {e['msg']}" for w, e in zip(where, errors, strict=True)
    )
    param = where[0][0] if where and where[0] else None  # the top-level field
    return error_response(400, message, "invalid_request_error", "invalid_value", param)


@api.exception_handler(ValidationError)
async def _invalid_body(request: Request, exc: ValidationError) -> JSONResponse:
    return validation_error_response(list(exc.errors()))


@api.exception_handler(RequestValidationError)
async def _invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
    return validation_error_response(list(exc.errors()))


@api.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    if exc.status_code == 404:
        message = f"no route {request.method} {request.url.path}; see /v1/models"
        return error_response(404, message, "not_found_error", "unknown_route")
    return error_response(
        exc.status_code, str(exc.detail), "invalid_request_error", f"http_{exc.status_code}"
    )


@api.exception_handler(RequestRejected)
async def _rejected(request: Request, exc: RequestRejected) -> JSONResponse:
    if exc.code == "model_not_found":
        return error_response(404, str(exc), "not_found_error", exc.code, exc.param)
    return error_response(400, str(exc), "invalid_request_error", exc.code, exc.param)


class Unauthorized(Exception):
    """A /v1 request without the server's API key."""


def check_api_key(expected: str | None, authorization: str | None) -> None:
    """Raise ``Unauthorized`` unless ``authorization`` is ``Bearer <expected>`` (or no key is
    set). The comparison takes the same time whatever the key's first wrong character."""
    if expected is None:
        return
    scheme, _, key = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not secrets.compare_digest(key.strip(), expected):
        raise Unauthorized("missing or wrong API key: send 'Authorization: Bearer <key>'")


@api.exception_handler(Unauthorized)
async def _unauthorized(request: Request, exc: Unauthorized) -> JSONResponse:
    response = error_response(401, str(exc), "authentication_error", "invalid_api_key")
    response.headers["WWW-Authenticate"] = "Bearer"
    return response


@api.exception_handler(Exception)
async def _internal(request: Request, exc: Exception) -> JSONResponse:
    """A bug, not a bad request: 500 with the exception's first line."""
    message = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return error_response(500, message, "internal_error", "internal_error")


@serve.deployment(name="PolicyServer")
@serve.ingress(api)
class PolicyServer:
    """One replica: the engine, the batch queue in front of it, and the routes."""

    def __init__(self, cfg: ServeConfig) -> None:
        torch.set_num_threads(max(1, int(cfg.num_cpus)))
        self._cfg = cfg
        self._model_id = cfg.served_model_id
        self._engine = load_engine(cfg, max_rows=cfg.max_batch_size)
        # serve.batch's setters are attributes its type stubs do not declare.
        self._generate.set_max_batch_size(cfg.max_batch_size)  # type: ignore[attr-defined]
        self._generate.set_batch_wait_timeout_s(cfg.batch_wait_timeout_s)  # type: ignore[attr-defined]
        self._batch_sizes: Counter[int] = Counter()

    @api.get("/health")
    async def health(self) -> dict[str, str]:
        return {"status": "ok"}

    @api.get("/v1/models")
    async def models(self, request: Request) -> ModelList:
        self._authorize(request)
        ids = [self._model_id, *self._cfg.adapters]
        return ModelList(data=[ModelCard(id=i) for i in ids])

    @api.get("/v1/stats")
    async def stats(self, request: Request) -> ServerStats:
        self._authorize(request)
        sizes = self._batch_sizes
        return ServerStats(
            requests=sum(n * k for n, k in sizes.items()),
            batches=sum(sizes.values()),
            largest_batch=max(sizes, default=0),
            batch_sizes=dict(sorted(sizes.items())),
        )

    @api.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        self._authorize(request)
        body = CompletionRequest.model_validate_json(await request.body())
        outputs = await self._run(body.prompts(), body)
        rid, model = f"cmpl-{uuid.uuid4().hex}", body.model or self._model_id
        if body.stream:
            events = completion_events(rid, model, outputs, body.include_usage())
            return StreamingResponse(events, media_type="text/event-stream")
        return JSONResponse(completion_response(rid, model, outputs).model_dump())

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        self._authorize(request)
        body = ChatCompletionRequest.model_validate_json(await request.body())
        messages = [m.model_dump() for m in body.messages]
        prompt = self._engine.render_chat(messages) or render_simple_chat(body.messages)
        [outs] = await self._run([prompt], body)
        rid, model = f"chatcmpl-{uuid.uuid4().hex}", body.model or self._model_id
        if body.stream:
            events = chat_events(rid, model, outs, body.include_usage())
            return StreamingResponse(events, media_type="text/event-stream")
        return JSONResponse(chat_response(rid, model, outs).model_dump())

    def _authorize(self, request: Request) -> None:
        check_api_key(self._cfg.api_key, request.headers.get("authorization"))

    async def _run(self, prompts: list[str], body: GenerationRequest) -> list[list[EngineOutput]]:
        """Check the request whole before queueing any of it, then generate its prompts (per
        prompt its ``n`` samples)."""
        adapters = self._cfg.adapters
        if body.model is not None and body.model != self._model_id and body.model not in adapters:
            served = ", ".join(repr(m) for m in [self._model_id, *adapters])
            raise RequestRejected(
                f"model {body.model!r} is not served here; use one of {served}",
                code="model_not_found",
                param="model",
            )
        if len(prompts) * body.n > self._cfg.max_batch_size:
            raise RequestRejected(
                f"{len(prompts)} prompts x n={body.n} samples in one request; this server "
                f"generates at most {self._cfg.max_batch_size} (--max-batch-size) at once",
                code="too_many_prompts" if body.n == 1 else "too_many_samples",
                param="prompt" if body.n == 1 else "n",
            )
        sampling = sampling_spec(body, self._cfg)
        adapter = body.model if body.model in adapters else None
        requests = [self._engine.prepare(p, sampling, adapter) for p in prompts]
        return list(await asyncio.gather(*(self._generate(r) for r in requests)))

    @serve.batch(max_batch_size=16, batch_wait_timeout_s=0.05)  # set from the config in __init__
    async def _generate(self, requests: list[EngineRequest]) -> list[list[EngineOutput]]:
        self._batch_sizes[len(requests)] += 1
        return await asyncio.to_thread(self._engine.generate, requests)


def build_app(args: dict[str, Any]) -> Application:
    """The Serve application for ``args`` (see ``ServeConfig``); ``checkpoint`` is required."""
    cfg = parse_args(args)
    if not cfg.in_process:  # vllm: Ray Serve LLM's own app
        if cfg.api_key is not None:
            raise RayhfError("serve --api-key: the vllm engine (Ray Serve LLM) does not take it")
        return _vllm_app(cfg)
    check_checkpoint(cfg.checkpoint)
    check_adapters(cfg)
    return PolicyServer.options(  # type: ignore[attr-defined]  # a Deployment, once decorated
        num_replicas=cfg.num_replicas,
        max_ongoing_requests=cfg.max_ongoing_requests,
        ray_actor_options={"num_cpus": cfg.num_cpus},
    ).bind(cfg)


def _vllm_app(cfg: ServeConfig) -> Application:
    """Ray Serve LLM's OpenAI app on vLLM (GPUs); untested here (vLLM's CPU build is tested
    as a generation engine and as the reference server of test_serve, not behind Serve)."""
    require_vllm()
    from ray.serve.llm import LLMConfig, build_openai_app

    llm = LLMConfig(
        model_loading_config={"model_id": cfg.served_model_id, "model_source": cfg.checkpoint},
        deployment_config={"num_replicas": cfg.num_replicas},
        engine_kwargs={"max_model_len": cfg.max_prompt_tokens + cfg.max_tokens},
    )
    return build_openai_app({"llm_configs": [llm]})


def serve_checkpoint(
    checkpoint: str | Path, host: str = "127.0.0.1", port: int = 8000, **args: Any
) -> None:
    """Serve ``checkpoint`` over HTTP on ``host:port`` until Ctrl-C or SIGTERM; ``args`` as
    ``build_app``.

    Joins the cluster named by ``RAY_ADDRESS`` if set, else starts a local one. Either signal
    stops it at once: a local cluster is shut down with its replicas (Serve's own blocking
    wait would drain them gracefully first, for 30 s and more); on a joined cluster the app is
    deleted.
    """
    import ray

    app = build_app({"checkpoint": str(checkpoint), **args})  # fail on bad args before Ray
    started_ray = not ray.is_initialized()
    if started_ray:  # never a cluster a `ray start` left running, unless RAY_ADDRESS names it
        ray.init(address=os.environ.get("RAY_ADDRESS") or "local")
    previous = signal.signal(signal.SIGTERM, _interrupt)  # ray.init installs its own
    try:
        serve.start(http_options={"host": host, "port": port})
        serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)
        while True:
            time.sleep(1.0)
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        if started_ray:
            ray.shutdown()
        else:
            serve.delete(APP_NAME, _blocking=False)


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt
