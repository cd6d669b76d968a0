"""Sampling rules and the one decode loop every generator shares.

    prompts -> prefill (the generator's forward over the prompts) -> last-position logits
      -> next_tokens (temperature, min length, top-k/top-p, greedy) -> tokens, log-probs
      -> extend (the generator's cached forward over the new tokens) -> ... until EOS or the cap
      -> cut_at_eos: per-row tokens and log-probs up to and including the first EOS

The reported log-prob of a token is ``log_softmax(logits / temperature)`` before the min-length
EOS mask and before top-k/top-p filtering, so a trainer that recomputes log-probs from one full
forward at the same temperature gets the same numbers. Greedy decoding reports temperature 1.

``decode`` is the loop; a generator supplies ``prefill`` and ``extend``: the sharded generator
(``rayhf.parallel.generate``) over its pipeline, ``generate`` below over a whole Hugging Face
model with its own KV cache (serving, demo tasks, reference checks).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import Tensor

from rayhf.errors import RayhfError


class GenerationConfig(BaseModel):
    """How responses are sampled; shared by every engine that generates."""

    model_config = ConfigDict(extra="forbid")

    max_new_tokens: int = Field(16, gt=0)  # response length cap, EOS included
    min_new_tokens: int = Field(0, ge=0)  # EOS is masked out before this many tokens
    greedy: bool = False  # argmax instead of sampling; temperature/top_k/top_p are ignored
    temperature: float = Field(1.0, gt=0)  # logits are divided by this before softmax
    top_k: int = Field(0, ge=0)  # sample among the k most likely tokens; 0 = off
    top_p: float = Field(1.0, gt=0, le=1)  # nucleus sampling mass; 1 = off

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


def check_prompts(prompts: list[list[int]]) -> None:
    if any(len(p) == 0 for p in prompts):
        raise RayhfError("every prompt needs at least one token; drop or fill the empty prompts")


def filter_logits(logits: Tensor, top_k: int, top_p: float) -> Tensor:
    """Set logits outside the top-k and the top-p nucleus to -inf; the best token always stays."""
    if 0 < top_k < logits.shape[-1]:
        kth_best = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth_best, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # A token is dropped once the more likely tokens before it already cover top_p.
        drop_sorted = probs.cumsum(dim=-1) - probs >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def next_tokens(
    logits: Tensor,
    step: int,
    cfg: GenerationConfig,
    eos_token_id: int,
    generator: torch.Generator | None,
) -> tuple[Tensor, Tensor]:
    """Pick one token per row; the log-prob comes from the unfiltered, unmasked distribution."""
    scaled = logits if cfg.greedy else logits / cfg.temperature
    logprobs = scaled.log_softmax(dim=-1)
    if step < cfg.min_new_tokens:
        scaled = scaled.clone()
        scaled[:, eos_token_id] = float("-inf")
    if cfg.greedy:
        tokens = scaled.argmax(dim=-1)
    else:
        probs = filter_logits(scaled, cfg.top_k, cfg.top_p).softmax(dim=-1)
        tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)


def cut_at_eos(tokens: Tensor, logprobs: Tensor, eos_token_id: int) -> GenerateOutput:
    """Keep each row up to and including its first EOS."""
    out = GenerateOutput()
    for row_tokens, row_logprobs in zip(tokens.tolist(), logprobs.tolist(), strict=True):
        ended = eos_token_id in row_tokens
        n = row_tokens.index(eos_token_id) + 1 if ended else len(row_tokens)
        out.tokens.append(row_tokens[:n])
        out.logprobs.append(row_logprobs[:n])
        out.finished.append(ended)
    return out


Logits = Tensor | None  # last-position logits [rows, vocab]; None on a rank that does not sample


@dataclass(frozen=True)
class DecodeSteps:
    """A generator's two forwards and how its ranks agree on the sampled tokens."""

    prefill: Callable[[], Logits]  # the prompts' forward
    extend: Callable[[Tensor, int], Logits]  # the forward of step ``i``'s tokens [rows]
    share: Callable[[Tensor], Tensor] = lambda t: t  # every rank gets the sampling rank's tensor


def decode(
    steps: DecodeSteps,
    n_rows: int,
    cfg: GenerationConfig,
    eos_token_id: int,
    pad_token_id: int,
    generator: torch.Generator | None,
    device: torch.device,
) -> GenerateOutput:
    """The decode loop: sample a token per row per step; a finished row decodes pad tokens
    (its outputs are dropped by ``cut_at_eos``) until every row has ended or the cap."""
    logits = steps.prefill()
    finished = torch.zeros(n_rows, dtype=torch.bool, device=device)
    step_tokens: list[Tensor] = []
    step_logprobs: list[Tensor] = []
    for step in range(cfg.max_new_tokens):
        if logits is not None:
            tokens, logprobs = next_tokens(logits.float(), step, cfg, eos_token_id, generator)
            tokens = tokens.masked_fill(finished, pad_token_id)
        else:
            tokens = torch.empty(n_rows, dtype=torch.long, device=device)
            logprobs = torch.empty(n_rows, device=device)
        tokens, logprobs = steps.share(tokens), steps.share(logprobs)
        step_tokens.append(tokens)
        step_logprobs.append(logprobs)
        finished |= tokens == eos_token_id
        if finished.all() or step + 1 == cfg.max_new_tokens:
            break
        logits = steps.extend(tokens, step)
    tokens_out = torch.stack(step_tokens, dim=1).cpu()
    return cut_at_eos(tokens_out, torch.stack(step_logprobs, dim=1).cpu(), eos_token_id)


def generate(
    model: Any,
    prompts: list[list[int]],
    cfg: GenerationConfig,
    eos_token_id: int,
    pad_token_id: int,
    generator: torch.Generator | None = None,
) -> GenerateOutput:
    """Sample one response per prompt from a whole Hugging Face causal LM (left-padded batch,
    Hugging Face's KV cache); the model is in eval mode meanwhile, then restored."""
    if not prompts:
        return GenerateOutput()
    check_prompts(prompts)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            steps = _HfSteps(model, prompts, pad_token_id)
            device = steps.ids.device
            return decode(
                steps.as_steps(), len(prompts), cfg, eos_token_id, pad_token_id, generator, device
            )
    finally:
        model.train(was_training)


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

    def as_steps(self) -> DecodeSteps:
        return DecodeSteps(lambda: self._forward(self.ids), self._extend)

    def _extend(self, tokens: Tensor, step: int) -> Tensor:
        # Finished rows keep attending normally to their pad inputs; their outputs are dropped.
        self.mask = torch.cat([self.mask, self.mask.new_ones(len(tokens), 1)], dim=-1)
        self.positions = self.positions[:, -1:] + 1
        return self._forward(tokens[:, None])

    def _forward(self, ids: Tensor) -> Tensor:
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
