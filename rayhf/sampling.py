"""Sampling rules, shared by every generator, and a reference loop over a whole Hugging Face model.

    logits [rows, vocab] --choose(rules, uniforms, steps)--> tokens [rows], log-probs [rows]

``choose`` is a function of fixed-shape tensors with no host round trip, so it runs inside the
native generator's decode step (``rayhf.parallel.decode``), compiled and captured with it. Its
randomness is counter-based: response ``i`` of a call draws ``uniforms(seed, ids, n)[i, j]`` for
its token ``j``, a hash of (seed, i, j) and nothing else, so a response's samples do not depend
on the batch it shares, on the slot it runs in, or on a generator's state, and every
tensor-parallel rank draws the same. A token is drawn by inverting the cumulative distribution
at that uniform (as ``torch.multinomial`` does), after temperature, the min-length EOS mask and
top-k/top-p.

The reported log-prob of a token is ``log_softmax(logits / temperature)`` before the min-length
EOS mask and before top-k/top-p filtering, so a trainer that recomputes log-probs from one full
forward at the same temperature gets the same numbers. Greedy decoding reports temperature 1.
With ``raw_logprobs`` (the policy server's choice, as vLLM's default ``logprobs_mode``) it is
``log_softmax(logits)``, before the temperature too, and ``top_logprobs`` (k > 0, computed by
``top_logprobs`` before ``choose``) asks a step for the k most likely tokens of that raw
distribution at each position as well.

``chat_token_logprob`` writes a token's log-prob as OpenAI's chat format has it, for both servers
that answer it (``rayhf serve``, and the agent server of ``rayhf.envs.proxy``).

``generate`` below samples from a whole Hugging Face model with its own KV cache, one host sync
a step: the reference the engines are checked against, and what demo tasks use.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import Tensor

from rayhf.errors import RayhfError


class GenerationConfig(BaseModel):
    """How responses are sampled; shared by every engine that generates."""

    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid")

    max_new_tokens: int = Field(16, gt=0)
    """Response length cap, EOS included."""
    min_new_tokens: int = Field(0, ge=0)
    """EOS is masked out before this many tokens."""
    greedy: bool = False
    """Argmax instead of sampling; temperature/top_k/top_p are ignored."""
    temperature: float = Field(1.0, gt=0)
    """Logits are divided by this before softmax."""
    top_k: int = Field(0, ge=0)
    """Sample among the k most likely tokens; 0 = off."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling mass; 1 = off."""
    expert_routes: bool = False
    """Keep the experts each token went to (a Mixture-of-Experts model on the native engine:
    ``GenerateOutput.routes``); ``algorithm.router_replay`` sets it."""

    @model_validator(mode="after")
    def _check_lengths(self) -> GenerationConfig:
        if self.min_new_tokens > self.max_new_tokens:
            raise ValueError("min_new_tokens must be <= max_new_tokens; lower min_new_tokens")
        return self


@dataclass
class GenerateOutput:
    """Per-prompt responses; lists, not tensors, because rows end at different lengths."""

    tokens: list[list[int]] = field(default_factory=list)  # response tokens, EOS included
    logprobs: list[list[float]] = field(default_factory=list)  # one per response token
    finished: list[bool] = field(default_factory=list)  # True if the row ended with EOS
    # with ``DecodeRules.top_logprobs`` k > 0 (else empty): per response token the k most likely
    # tokens and their raw log-probs, most likely first
    top_ids: list[list[list[int]]] = field(default_factory=list)
    top_logprobs: list[list[list[float]]] = field(default_factory=list)
    # with ``DecodeRules.routes`` on a Mixture-of-Experts model (else empty): per prompt, the
    # experts each of its tokens and its response's went to, ``[tokens, L, k]`` int16 (L: the
    # model's MoE layers); the last response token's are -1 (no forward of it ran)
    routes: list[torch.Tensor] = field(default_factory=list)


class Feed(Protocol):
    """Prompts that join a generate call while it decodes (continuous batching across callers,
    e.g. multi-turn trajectories whose next turn is ready), and where each response goes as
    soon as its row ends. The call's own prompts are indices ``0..n-1``; fed ones follow."""

    rows: int  # slots the call keeps (the callers that may be waiting at once)
    longest: int  # the longest prompt that may be fed (sizes the KV cache)

    def more(self, free: int, max_len: int) -> list[list[int]]:
        """Up to ``free`` waiting prompts of at most ``max_len`` tokens (without blocking)."""
        ...

    def ended(self, index: int, tokens: list[int], logprobs: list[float], finished: bool):
        """Prompt ``index``'s response (EOS included when ``finished``)."""
        ...


@dataclass(frozen=True)
class DecodeRules:
    """What a decode step bakes in: the sampling settings and the tokenizer's ids (plain values,
    so a compiled step guards on them)."""

    greedy: bool
    temperature: float
    top_k: int
    top_p: float
    min_new_tokens: int
    max_new_tokens: int
    eos: int
    pad: int
    raw_logprobs: bool = False  # report log_softmax(logits), before the temperature
    top_logprobs: int = 0  # also record the k most likely tokens per position (raw log-probs)
    routes: bool = False  # also record each token's experts (a Mixture-of-Experts model)

    @staticmethod
    def of(cfg: GenerationConfig, eos_token_id: int, pad_token_id: int) -> DecodeRules:
        return DecodeRules(
            greedy=cfg.greedy,
            temperature=1.0 if cfg.greedy else cfg.temperature,
            top_k=0 if cfg.greedy else cfg.top_k,
            top_p=1.0 if cfg.greedy else cfg.top_p,
            min_new_tokens=cfg.min_new_tokens,
            max_new_tokens=cfg.max_new_tokens,
            eos=eos_token_id,
            pad=pad_token_id,
            routes=cfg.expert_routes,
        )


def check_prompts(prompts: list[list[int]]) -> None:
    if any(len(p) == 0 for p in prompts):
        raise RayhfError("every prompt needs at least one token; drop or fill the empty prompts")


_MASK32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9  # 2**32 / phi: spreads consecutive step numbers before mixing


def _mul32(x: Any, c: int) -> Any:
    """``x * c mod 2**32`` for ``x`` in [0, 2**32) without overflowing int64: ``c`` in halves."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _MASK32


def _mix32(x: Any) -> Any:
    """Chris Wellons' lowbias32 integer hash (Python ints and int64 tensors alike)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def uniforms(seed: int, ids: Tensor, n_steps: int) -> Tensor:
    """``[len(ids), n_steps]`` float32 uniforms in (0, 1): the draw of response ``ids[i]`` for its
    token ``j``, a hash of (seed, id, j); 24 bits, so every value is exact in float32."""
    key = _mix32((seed & _MASK32) ^ _mix32((seed >> 32) & _MASK32))
    rows = _mix32((ids.long() & _MASK32) ^ key)
    steps = _mix32((torch.arange(n_steps, device=ids.device) * _GOLDEN) & _MASK32)
    bits = _mix32(rows[:, None] ^ steps[None, :])
    return ((bits >> 8).float() + 0.5) * 2.0**-24


def seed_from(generator: torch.Generator | None) -> int:
    """A call's seed from a generator (advancing it) or from torch's global generator."""
    return int(torch.randint(0, 2**62, (), generator=generator))


def choose(
    logits: Tensor, rules: DecodeRules, u: Tensor, steps: Tensor, raw_lse: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """One token per row of fp32 ``logits [rows, vocab]`` and its log-prob; ``u [rows]`` the rows'
    uniforms, ``steps [rows]`` the index of the token being chosen in each response (for the
    min-length EOS mask). Fixed shapes, no host sync. ``logits`` is consumed: divided by the
    temperature and EOS-masked in place (each pass over the vocabulary counts at every token).
    ``raw_lse``: ``logits.logsumexp(-1)`` when the caller has it (``top_logprobs`` needed it)."""
    if not rules.raw_logprobs:
        raw_lse = None
    elif raw_lse is None and rules.temperature != 1.0:
        raw_lse = logits.logsumexp(-1)  # before the temperature divides in place
    scaled = logits if rules.temperature == 1.0 else logits.div_(rules.temperature)
    early = eos_logit = None
    if rules.min_new_tokens:
        early = steps < rules.min_new_tokens
        eos_logit = scaled[:, rules.eos].clone()
        scaled[:, rules.eos] = eos_logit.masked_fill(early, float("-inf"))
    top, best = scaled.max(dim=-1, keepdim=True)  # of what may be chosen
    weights = (scaled - top).exp()
    lse = top.squeeze(1) + weights.sum(-1).log()  # of the unmasked distribution:
    if eos_logit is not None and early is not None:  # a masked EOS counts there
        lse = torch.where(early, torch.logaddexp(lse, eos_logit), lse)
    tokens = best.squeeze(1) if rules.greedy else _inverse_cdf(scaled, weights, rules, u)
    # a chosen token is never a masked EOS, so its logit here is the unmasked one
    picked = scaled.gather(1, tokens[:, None]).squeeze(1)
    if raw_lse is not None:
        return tokens, picked * rules.temperature - raw_lse
    return tokens, picked - lse


def top_logprobs(logits: Tensor, k: int, lse: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The ``k`` most likely tokens ``[rows, k]`` of raw ``logits [rows, vocab]`` (before
    ``choose`` consumes them) and their log-probs under ``log_softmax(logits)``, most likely
    first; ``lse``: ``logits.logsumexp(-1)`` if the caller has it. Fixed shapes, no host sync."""
    values, ids = logits.topk(k, dim=-1)
    return ids, values - (logits.logsumexp(-1) if lse is None else lse)[:, None]


# What OpenAI-compatible servers (vLLM) write for a log-prob of -inf: JSON has no infinity.
LOGPROB_FLOOR = -9999.0


def chat_token_logprob(
    token: str, logprob: float, top: Iterable[tuple[str, float]] = ()
) -> dict[str, Any]:
    """One entry of a chat reply's ``logprobs.content`` in OpenAI's format: a generated token's
    text, its log-prob (floored), its text as UTF-8 and the likeliest tokens at its position."""

    def entry(text: str, lp: float) -> dict[str, Any]:
        utf8 = list(text.encode("utf-8", errors="replace"))
        return {"token": text, "logprob": max(lp, LOGPROB_FLOOR), "bytes": utf8}

    return {**entry(token, logprob), "top_logprobs": [entry(t, lp) for t, lp in top]}


def _inverse_cdf(logits: Tensor, weights: Tensor, rules: DecodeRules, u: Tensor) -> Tensor:
    """The first candidate whose cumulative weight reaches ``u`` times the total. Candidates are
    the top-k (sorted), the whole vocabulary sorted (top-p alone) or, with neither, the
    vocabulary as it is (``weights``: ``exp(logits - max)``); top-p drops a candidate once the
    more likely ones before it cover ``top_p``. A candidate of weight 0 is never drawn: its
    cumulative weight equals its predecessor's, and the threshold is > 0."""
    index = None
    if 0 < rules.top_k < logits.shape[-1]:
        logits, index = logits.topk(rules.top_k, dim=-1)
    elif rules.top_p < 1.0:
        logits, index = logits.sort(dim=-1, descending=True)
    if index is not None:
        weights = (logits - logits[:, :1]).exp()
    if rules.top_p < 1.0:
        probs = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.masked_fill(probs.cumsum(-1) - probs >= rules.top_p, 0.0)
    pick = _first_reaching(weights, u)
    return pick if index is None else index.gather(1, pick[:, None]).squeeze(1)


def _first_reaching(weights: Tensor, u: Tensor) -> Tensor:
    """Per row, the first index whose cumulative weight reaches ``u`` times the row's total:
    over blocks of the row first (their sums), then inside the block reached, so a wide
    vocabulary is summed once and scanned in two short pieces, not scanned whole."""
    rows, n = weights.shape
    size = _block_size(n)
    if size == 1:
        total = weights.cumsum(-1)
        return (total < u[:, None] * total[:, -1:]).sum(-1).clamp(max=n - 1)
    blocks = weights.view(rows, n // size, size)
    cum = blocks.sum(-1).cumsum(-1)
    x = u * cum[:, -1]
    block = (cum < x[:, None]).sum(-1).clamp(max=n // size - 1)
    before = cum.gather(1, (block - 1).clamp(min=0)[:, None]).squeeze(1).masked_fill(block == 0, 0)
    inside = blocks.gather(1, block[:, None, None].expand(rows, 1, size)).squeeze(1).cumsum(-1)
    # x - before > 0; rounding may leave the block's own sum a hair under it: then the block's
    # last weighted entry
    x = torch.minimum(x - before, inside[:, -1])
    return block * size + (inside < x[:, None]).sum(-1).clamp(max=size - 1)


@functools.lru_cache(maxsize=64)
def _block_size(n: int) -> int:
    """The largest divisor of ``n`` up to its square root, if at least 16 (else 1: one scan)."""
    size = next(d for d in range(math.isqrt(n), 0, -1) if n % d == 0)
    return size if size >= 16 else 1


def cut_at_eos(tokens: Tensor, logprobs: Tensor, eos_token_id: int) -> GenerateOutput:
    """Keep each row up to and including its first EOS."""
    out = GenerateOutput()
    for row_tokens, row_logprobs in zip(tokens.tolist(), logprobs.tolist(), strict=True):
        t, lp, ended = cut_row(row_tokens, row_logprobs, eos_token_id)
        out.tokens.append(t)
        out.logprobs.append(lp)
        out.finished.append(ended)
    return out


def cut_row(
    tokens: list[int], logprobs: list[float], eos_token_id: int
) -> tuple[list[int], list[float], bool]:
    """One row up to and including its first EOS, and whether it has one."""
    ended = eos_token_id in tokens
    n = tokens.index(eos_token_id) + 1 if ended else len(tokens)
    return tokens[:n], logprobs[:n], ended


def generate(
    model: Any,
    prompts: list[list[int]],
    cfg: GenerationConfig,
    eos_token_id: int,
    pad_token_id: int,
    seed: int | None = None,
) -> GenerateOutput:
    """Sample one response per prompt from a whole Hugging Face causal LM (left-padded batch,
    Hugging Face's KV cache; ``seed`` None: drawn from torch's global generator); the model is
    in eval mode meanwhile, then restored. A finished row decodes pad tokens until every row
    has ended or the cap."""
    if not prompts:
        return GenerateOutput()
    check_prompts(prompts)
    rules = DecodeRules.of(cfg, eos_token_id, pad_token_id)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            steps = _HfSteps(model, prompts, pad_token_id)
            ids = torch.arange(len(prompts), device=steps.ids.device)
            u = uniforms(seed_from(None) if seed is None else seed, ids, cfg.max_new_tokens)
            logits = steps.forward(steps.ids)
            finished = torch.zeros(len(prompts), dtype=torch.bool, device=ids.device)
            chosen: list[tuple[Tensor, Tensor]] = []
            for step in range(cfg.max_new_tokens):
                tokens, logprobs = choose(logits, rules, u[:, step], torch.full_like(ids, step))
                tokens = tokens.masked_fill(finished, pad_token_id)
                chosen.append((tokens, logprobs))
                finished |= tokens == eos_token_id
                if finished.all() or step + 1 == cfg.max_new_tokens:
                    break
                logits = steps.extend(tokens)
    finally:
        model.train(was_training)
    tokens_out = torch.stack([t for t, _ in chosen], dim=1).cpu()
    return cut_at_eos(tokens_out, torch.stack([lp for _, lp in chosen], 1).cpu(), eos_token_id)


class _HfSteps:
    """Prefill and extend over a Hugging Face model: right-aligned prompts (every row's next
    token is the last column), the mask and positions grown by one column per step."""

    def __init__(self, model: Any, prompts: list[list[int]], pad_token_id: int) -> None:
        self.model = model
        device = next(model.parameters()).device
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
            mask[row, width - len(prompt) :] = 1
        self.ids, self.mask = ids.to(device), mask.to(device)
        self.positions = (self.mask.cumsum(dim=-1) - 1).clamp(min=0)
        self.cache: Any = None
        self.keep_last = "logits_to_keep" in inspect.signature(model.forward).parameters

    def extend(self, tokens: Tensor) -> Tensor:
        # Finished rows keep attending normally to their pad inputs; their outputs are dropped.
        self.mask = torch.cat([self.mask, self.mask.new_ones(len(tokens), 1)], dim=-1)
        self.positions = self.positions[:, -1:] + 1
        return self.forward(tokens[:, None])

    def forward(self, ids: Tensor) -> Tensor:
        """One cached forward; float32 last-position logits [batch, vocab]."""
        extra = {"logits_to_keep": 1} if self.keep_last else {}  # prefill: skip the LM head
        out = self.model(
            input_ids=ids,
            attention_mask=self.mask,
            position_ids=self.positions,
            past_key_values=self.cache,
            use_cache=True,
            **extra,
        )
        self.cache = out.past_key_values
        return out.logits[:, -1].float()
