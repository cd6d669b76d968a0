"""The serving engine seam: prompts in, generated text out, behind one small interface.

    prompt text --prepare--> EngineRequest (token ids + SamplingSpec; limits checked here)
    [EngineRequest] --generate--> per request its n EngineOutputs (per-token text pieces,
                                  finish reason, counts, log-probs when asked)

``NativeEngine`` loads a Hugging Face checkpoint on CPU and decodes with the native generator's
engine (``rayhf.parallel.decode``: the step training's generate calls run). Prompts are
tokenized as in training: ``bos`` (if the tokenizer has one) followed by the text's tokens, no
other special tokens.

Choices:

* Batching. ``generate`` gets every request the deployment's ``@serve.batch`` collected and
  splits them by sampling key: all greedy requests form one group; unseeded sampling requests
  with the same (temperature, top_k, top_p) form one group, its seed drawn from the server's
  random generator; a seeded request runs alone with its seed, so a seed and a prompt give the
  same text whatever else is in flight. A group runs to its longest ``max_tokens`` and each row
  is cut to its own: rows of a batch do not interact (each row its own cache row and
  positions), so a greedy row equals the same request run alone.
* Rows at once. A group is one decode call of prompts x n rows (16 requests of n = 16: 256),
  but the decode engine holds at most ``max_rows`` of them at once (the server's
  ``max_batch_size``; its KV cache and step are that size): the others wait and take the slot
  of a row that ended. A row draws the uniforms of its own index in the call, so a seeded
  request's sample j is the same whenever it runs.
* ``n``. A request's n samples are n rows of its prompt in the same call: the decode engine
  prefills a repeated prompt once and copies its keys and values (as for GRPO's groups), and
  each row draws its own uniforms. A seeded request's sample j is the same for any n >= j + 1.
* Log-probs. Asked for, the call's step also reports each token's log-prob under the raw
  distribution (``log_softmax`` of the logits, before temperature and top-k/top-p; vLLM's
  default ``logprobs_mode``) and the k most likely tokens at each position (the group's
  largest k; each request keeps its own). The sampled tokens do not change.
* Streaming. The native engine returns whole responses, so an output carries one text piece
  per generated token (incremental detokenization) and the server replays the pieces as chunks
  once the batch is done: chunks and text are right, but the first chunk arrives after the whole
  generation. Token-by-token streaming needs a step-wise engine (vLLM, below).
* vLLM. ``engine: vllm`` does not go through this interface: Ray Serve LLM (``ray.serve.llm``)
  serves the checkpoint with its own OpenAI-compatible app (``rayhf.serve.app.build_app``);
  ``require_vllm`` names the extra when vLLM is not installed.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from rayhf.engines.rank_model import RankModel
from rayhf.errors import RayhfError
from rayhf.models.files import quiet_transformers
from rayhf.models.hf import load_model
from rayhf.parallel.decode import DecodeEngine, DecodeOptions
from rayhf.sampling import DecodeRules, GenerateOutput, GenerationConfig, seed_from

ServingEngineName = Literal["native", "vllm"]
# the serving engines that run inside the replica's process (rayhf's decode engine); the others
# are a server app of their own (vllm: Ray Serve LLM on GPUs)
IN_PROCESS: frozenset[str] = frozenset({"native"})


class ServingEngineConfig(BaseModel):
    """What to serve and the per-request limits."""

    model_config = ConfigDict(extra="forbid")

    checkpoint: str  # Hugging Face model directory with its tokenizer, e.g. a training actor/
    engine: ServingEngineName = "native"  # vllm = Ray Serve LLM on GPUs
    max_prompt_tokens: int = Field(512, gt=0)  # longer prompts (bos included) are rejected
    max_tokens: int = Field(256, gt=0)  # ceiling on a request's max_tokens
    default_max_tokens: int = Field(16, gt=0)  # when a request gives none (OpenAI's default)
    # LoRA adapters served beside the checkpoint: the model id a request names -> a PEFT
    # adapter directory of this checkpoint (vLLM's --lora-modules)
    adapters: dict[str, str] = Field(default_factory=dict)

    @property
    def in_process(self) -> bool:
        """Whether the engine runs in the replica's process (else it is a server app)."""
        return self.engine in IN_PROCESS

    @model_validator(mode="after")
    def _check_defaults(self) -> ServingEngineConfig:
        if self.default_max_tokens > self.max_tokens:
            raise ValueError("default_max_tokens must be <= max_tokens; lower default_max_tokens")
        if self.adapters and not self.in_process:
            raise ValueError(f"adapters: engine {self.engine} does not serve them yet; use native")
        return self


@dataclass(frozen=True)
class SamplingSpec:
    """How one request is sampled; ``temperature``/``top_k``/``top_p`` are unused when greedy."""

    max_tokens: int
    greedy: bool = False
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()  # the text ends before the first of these
    n: int = 1  # samples of the prompt
    logprobs: int | None = None  # None: none; k: each token's log-prob and the k most likely


@dataclass(frozen=True)
class EngineRequest:
    prompt_ids: tuple[int, ...]  # bos included
    sampling: SamplingSpec
    adapter: str | None = None  # the LoRA adapter it is generated with (``adapters``); None: none


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's raw log-prob (see the module docstring) and the likeliest tokens."""

    token: str  # the token decoded alone, special tokens kept
    logprob: float
    top: tuple[tuple[str, float], ...] = ()  # the k most likely tokens here, most likely first


@dataclass(frozen=True)
class EngineOutput:
    """One response; ``"".join(pieces)`` is the text, so streamed and whole text agree."""

    token_ids: tuple[int, ...]  # generated tokens up to EOS, the stop string or max_tokens
    pieces: tuple[str, ...]  # the text each token added (empty while a character is incomplete)
    finish_reason: Literal["stop", "length"]
    prompt_tokens: int
    logprobs: tuple[TokenLogprob, ...] | None = None  # one per token, if the request asked

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)


class RequestRejected(RayhfError):
    """A request the server cannot take as given; the message says what to change."""

    def __init__(self, message: str, code: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.param = param


class ServingEngine(ABC):
    """Tokenize, check limits, generate a batch. One instance per replica; not thread-safe."""

    def __init__(self, cfg: ServingEngineConfig) -> None:
        self.cfg = cfg

    @abstractmethod
    def encode(self, text: str) -> list[int]:
        """Prompt token ids as training saw them (bos first)."""

    @abstractmethod
    def render_chat(self, messages: list[dict[str, str]]) -> str | None:
        """The tokenizer's chat template applied to ``messages``; None if it has none."""

    @property
    @abstractmethod
    def max_positions(self) -> int | None:
        """The model's context length, if its config states one."""

    @abstractmethod
    def generate(self, requests: list[EngineRequest]) -> list[list[EngineOutput]]:
        """Per request, in order, its ``sampling.n`` outputs."""

    def prepare(
        self, prompt: str, sampling: SamplingSpec, adapter: str | None = None
    ) -> EngineRequest:
        """Tokenize ``prompt`` (for ``adapter``); raise ``RequestRejected`` if it breaks a
        limit."""
        limit = self.cfg.max_tokens
        if sampling.max_tokens > limit:
            raise RequestRejected(
                f"max_tokens={sampling.max_tokens} is over this server's limit; use <= {limit}",
                code="max_tokens_exceeded",
                param="max_tokens",
            )
        ids = self.encode(prompt)
        if not ids:
            raise RequestRejected("the prompt has no tokens; send some text", "empty_prompt")
        if len(ids) > self.cfg.max_prompt_tokens:
            raise RequestRejected(
                f"the prompt has {len(ids)} tokens; this server accepts at most "
                f"{self.cfg.max_prompt_tokens}; shorten the prompt",
                code="context_length_exceeded",
                param="prompt",
            )
        ctx = self.max_positions
        if ctx is not None and len(ids) + sampling.max_tokens > ctx:
            raise RequestRejected(
                f"prompt ({len(ids)} tokens) + max_tokens ({sampling.max_tokens}) is over the "
                f"model's {ctx} positions; shorten the prompt or lower max_tokens",
                code="context_length_exceeded",
                param="max_tokens",
            )
        return EngineRequest(tuple(ids), sampling, adapter)


class NativeEngine(ServingEngine):
    """The native decode engine on a checkpoint loaded on CPU (its buffers kept between
    batches); it decodes at most ``max_rows`` rows (prompts x n) at once."""

    def __init__(self, cfg: ServingEngineConfig, max_rows: int = DecodeOptions.max_rows) -> None:
        super().__init__(cfg)
        from transformers import AutoTokenizer

        quiet_transformers()
        path = check_checkpoint(cfg.checkpoint)
        hf = load_model(path, value_head=False, field="checkpoint").eval()
        self.config = hf.config
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError) as e:
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise RayhfError(f"checkpoint: cannot load a tokenizer from {path}: {msg}") from None
        eos = self.tokenizer.eos_token_id
        if eos is None:
            eos = self.config.eos_token_id
        if not isinstance(eos, int):
            raise RayhfError(f"checkpoint: {path} names no single eos token; set eos_token")
        self.eos_id: int = eos
        pad = self.tokenizer.pad_token_id
        self.pad_id: int = pad if pad is not None else eos
        options = DecodeOptions(max_rows=max_rows)
        base = RankModel.from_hf(hf, self.tokenizer, False)
        self.decoder = DecodeEngine(base.pipe, options)
        self.decoders: dict[str | None, DecodeEngine] = {None: self.decoder}  # and by adapter
        for name, where in cfg.adapters.items():  # each on the checkpoint's weights, unmerged
            model = adapter_model(hf, self.tokenizer, where, f"--adapter {name}", base)
            self.decoders[name] = DecodeEngine(model.pipe, options)
        self._rng = torch.Generator()
        self._rng.seed()  # unseeded requests differ from one server start to the next
        # The server encodes on its event loop while a batch decodes in a worker thread; a
        # fast tokenizer used from two threads at once can fail with "Already borrowed".
        self._tokenizer_lock = threading.Lock()
        self._token_texts: dict[int, str] = {}  # see ``token_text``

    def encode(self, text: str) -> list[int]:
        with self._tokenizer_lock:
            ids = self.tokenizer.encode(text, add_special_tokens=False)
        bos = self.tokenizer.bos_token_id
        # A chat template may already have written the bos token into the text.
        return ids if bos is None or ids[:1] == [bos] else [bos, *ids]

    def render_chat(self, messages: list[dict[str, str]]) -> str | None:
        if not getattr(self.tokenizer, "chat_template", None):
            return None
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        assert isinstance(text, str), type(text)
        return text

    @property
    def max_positions(self) -> int | None:
        config = self.config
        n = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
        return n if isinstance(n, int) else None

    def generate(self, requests: list[EngineRequest]) -> list[list[EngineOutput]]:
        outputs: dict[int, list[EngineOutput]] = {}
        for rows in group_requests(requests).values():
            group = [requests[i] for i in rows]
            outputs.update(zip(rows, self._generate_group(group), strict=True))
        return [outputs[i] for i in range(len(requests))]

    def _generate_group(self, group: list[EngineRequest]) -> list[list[EngineOutput]]:
        """One ``generate`` call for requests that share their sampling key: each request's
        prompt ``n`` times, one row per sample."""
        first = group[0].sampling
        cfg = GenerationConfig(
            max_new_tokens=max(r.sampling.max_tokens for r in group),
            greedy=first.greedy,
            temperature=1.0 if first.greedy else first.temperature,
            top_k=first.top_k,
            top_p=first.top_p,
        )
        seed = seed_from(self._rng) if first.seed is None else first.seed
        rows = [r for r in group for _ in range(r.sampling.n)]
        asked = [r.sampling.logprobs for r in group if r.sampling.logprobs is not None]
        rules = dataclasses.replace(
            DecodeRules.of(cfg, self.eos_id, self.pad_id),
            raw_logprobs=bool(asked),
            top_logprobs=max(asked, default=0),
        )
        decoder = self.decoders[group[0].adapter]
        out = decoder.generate([list(r.prompt_ids) for r in rows], rules, seed)
        done = [self._finish(r, out, i) for i, r in enumerate(rows)]
        per_request, start = [], 0
        for r in group:  # rows hold each request's samples together
            per_request.append(done[start : start + r.sampling.n])
            start += r.sampling.n
        return per_request

    def _finish(self, request: EngineRequest, out: GenerateOutput, row: int) -> EngineOutput:
        """Row ``row`` of ``out`` as ``request``'s response: cut to its ``max_tokens``,
        detokenized, stop strings applied, why it ended named, its log-probs if asked."""
        spec = request.sampling
        tokens = out.tokens[row][: spec.max_tokens]
        pieces, n_used, stopped = detokenize(self._decode, tokens, spec.stop)
        used = tokens[:n_used]
        ended = stopped or (bool(used) and used[-1] == self.eos_id)
        k = spec.logprobs
        return EngineOutput(
            token_ids=tuple(used),
            pieces=tuple(pieces),
            finish_reason="stop" if ended else "length",
            prompt_tokens=len(request.prompt_ids),
            logprobs=None if k is None else self._logprobs(out, row, used, k),
        )

    def _logprobs(
        self, out: GenerateOutput, row: int, used: list[int], k: int
    ) -> tuple[TokenLogprob, ...]:
        """The log-probs of row ``row``'s tokens ``used``, each with its ``k`` likeliest tokens
        (the call's own k may be larger)."""
        text = self.token_text
        tops = out.top_ids[row] if k else [[]] * len(used)
        top_lps = out.top_logprobs[row] if k else [[]] * len(used)
        return tuple(
            TokenLogprob(text(t), lp, tuple(zip(map(text, ids[:k]), lps[:k], strict=True)))
            for t, lp, ids, lps in zip(used, out.logprobs[row], tops, top_lps, strict=False)
        )

    def token_text(self, token: int) -> str:
        """One token decoded alone, special tokens kept (how vLLM names a log-prob's token).
        Cached: that text does not depend on the context, and log-probs ask for it k + 1 times
        a token."""
        text = self._token_texts.get(token)
        if text is None:
            with self._tokenizer_lock:
                decoded = self.tokenizer.decode([token])
            assert isinstance(decoded, str), type(decoded)
            text = self._token_texts[token] = decoded
        return text

    def _decode(self, tokens: list[int]) -> str:
        with self._tokenizer_lock:
            text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        assert isinstance(text, str), type(text)
        return text


def group_requests(requests: list[EngineRequest]) -> dict[Hashable, list[int]]:
    """Request indices by adapter and sampling key (see the module docstring), in first-seen
    order."""
    groups: dict[Hashable, list[int]] = {}
    for i, r in enumerate(requests):
        s = r.sampling
        key: Hashable
        if s.greedy:
            key = "greedy"
        elif s.seed is not None:
            key = ("seeded", i)
        else:
            key = ("sample", s.temperature, s.top_k, s.top_p)
        groups.setdefault(key if r.adapter is None else (r.adapter, key), []).append(i)
    return groups


def check_adapters(cfg: ServingEngineConfig) -> None:
    """Each of ``cfg.adapters`` a PEFT adapter that fits the checkpoint, or one line naming it."""
    if not cfg.adapters:
        return
    from rayhf.models.hf import read_model_config
    from rayhf.models.spec import model_spec

    spec = model_spec(read_model_config(cfg.checkpoint, False, "checkpoint"), False)
    for name, where in cfg.adapters.items():
        _adapter_lora(spec, where, f"--adapter {name}")


def _adapter_lora(spec, where: str, field: str):
    """The PEFT adapter in ``where`` as a ``Lora`` of the model ``spec``, or one line naming
    ``field``."""
    from rayhf.models.lora import LoraConfig, lora_of, read_adapter_config

    read_adapter_config(where, field)  # a directory PEFT wrote, or one line naming it
    return lora_of(LoraConfig(adapter=where), spec, field)


def adapter_model(hf, tokenizer, where: str, field: str, base: RankModel) -> RankModel:
    """The checkpoint ``hf`` with the PEFT adapter in ``where`` beside its weights, which it
    shares with ``base`` (the checkpoint's model): an adapter costs its own tensors."""
    from rayhf.models.lora import adapted, read_adapter

    lora = _adapter_lora(base.files.spec, where, field)
    state = hf.state_dict() | read_adapter(where)
    model = RankModel(adapted(base.files, lora), state, tokenizer)
    for name in base.module.shards:
        model.module.param(name).data = base.module.param(name).data
    return model


def detokenize(
    decode: Callable[[list[int]], str], tokens: list[int], stops: tuple[str, ...]
) -> tuple[list[str], int, bool]:
    """Text pieces per token, the number of tokens kept, and whether a stop string ended it.

    The final text is the decoded tokens cut before the first stop string; piece ``k`` is what
    token ``k`` adds to it. Decoding every prefix (quadratic, fine for a few hundred tokens)
    keeps multi-token characters whole: a piece stays empty until its character is complete.
    """
    texts = [decode(tokens[:k]) for k in range(1, len(tokens) + 1)]
    n_used, stopped, final = len(tokens), False, texts[-1] if texts else ""
    for k, text in enumerate(texts, start=1):
        hits = [text.find(s) for s in stops if s in text]
        if hits:
            n_used, stopped, final = k, True, text[: min(hits)]
            break
    pieces, done = [], 0
    for text in texts[:n_used]:
        end = max(done, _common_prefix_len(text, final))
        pieces.append(final[done:end])
        done = end
    if pieces:
        pieces[-1] += final[done:]
    return pieces, n_used, stopped


def _common_prefix_len(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def check_checkpoint(path: str | Path) -> Path:
    """``path`` as a Path if it holds a model and a tokenizer; else a one-line RayhfError."""
    p = Path(path).expanduser()
    if not p.is_dir():
        raise RayhfError(f"checkpoint: {p} is not a directory; pass a Hugging Face model directory")
    if not (p / "config.json").is_file():
        raise RayhfError(f"checkpoint: {p} is not a model directory (no config.json)")
    if not any((p / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        raise RayhfError(
            f"checkpoint: {p} has no tokenizer; save it with tokenizer.save_pretrained"
        )
    return p


def require_vllm() -> None:
    """Fail in one line when ``engine: vllm`` is asked for without vLLM installed."""
    if importlib.util.find_spec("vllm") is None:
        raise RayhfError(
            "engine: vllm needs vLLM; pip install 'rayhf[vllm]' (GPU), or use engine: native"
        )


def load_engine(cfg: ServingEngineConfig, max_rows: int) -> ServingEngine:
    """The in-process engine for ``cfg``, decoding at most ``max_rows`` rows at once; ``vllm``
    is served by Ray Serve LLM, not from here."""
    if not cfg.in_process:
        raise RayhfError(f"engine: {cfg.engine} has no in-process engine; use engine: native")
    return NativeEngine(cfg, max_rows)
