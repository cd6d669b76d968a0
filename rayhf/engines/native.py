"""Native generation engine: batched sampling with a KV cache for any Hugging Face causal LM.

Data flow: prompts -> left-padded batch (attention mask, position ids) -> one prefill forward
that fills the cache -> one forward per new token, feeding the cache back -> per-row tokens and
log-probs cut after EOS.

The reported log-prob of a token is ``log_softmax(logits / temperature)`` before the min-length
EOS mask and before top-k/top-p filtering, so a trainer that recomputes log-probs from one full
forward at the same temperature gets the same numbers. Greedy decoding reports temperature 1.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import Tensor
from transformers import PreTrainedModel

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


def generate(
    model: PreTrainedModel,
    prompts: list[list[int]],
    cfg: GenerationConfig,
    eos_token_id: int,
    pad_token_id: int,
    generator: torch.Generator | None = None,
) -> GenerateOutput:
    """Sample one response per prompt; the model is in eval mode meanwhile, then restored."""
    if not prompts:
        return GenerateOutput()
    if any(len(p) == 0 for p in prompts):
        raise RayhfError("every prompt needs at least one token; drop or fill the empty prompts")
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            tokens, logprobs = _decode(model, prompts, cfg, eos_token_id, pad_token_id, generator)
    finally:
        model.train(was_training)
    return cut_at_eos(tokens, logprobs, eos_token_id)


def _decode(
    model: PreTrainedModel,
    prompts: list[list[int]],
    cfg: GenerationConfig,
    eos_token_id: int,
    pad_token_id: int,
    generator: torch.Generator | None,
) -> tuple[Tensor, Tensor]:
    """Prefill then decode; returns [batch, steps] tokens and log-probs, pad after a row's EOS."""
    device = next(model.parameters()).device
    ids, mask = _left_pad(prompts, pad_token_id, device)
    positions = (mask.cumsum(dim=-1) - 1).clamp(min=0)
    finished = torch.zeros(len(prompts), dtype=torch.bool, device=device)
    step_tokens: list[Tensor] = []
    step_logprobs: list[Tensor] = []
    logits, cache = _forward(model, ids, mask, positions, None)
    for step in range(cfg.max_new_tokens):
        tokens, logprobs = next_tokens(logits, step, cfg, eos_token_id, generator)
        tokens = tokens.masked_fill(finished, pad_token_id)
        step_tokens.append(tokens)
        step_logprobs.append(logprobs)
        finished |= tokens == eos_token_id
        if finished.all() or step + 1 == cfg.max_new_tokens:
            break
        # Finished rows keep attending normally to their pad inputs; their outputs are dropped.
        mask = torch.cat([mask, mask.new_ones(len(prompts), 1)], dim=-1)
        positions = positions[:, -1:] + 1
        logits, cache = _forward(model, tokens[:, None], mask, positions, cache)
    return torch.stack(step_tokens, dim=1), torch.stack(step_logprobs, dim=1)


def _left_pad(
    prompts: list[list[int]], pad_token_id: int, device: torch.device
) -> tuple[Tensor, Tensor]:
    """Right-align prompts so every row's next token is the last column."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
        mask[row, width - len(prompt) :] = 1
    return ids.to(device), mask.to(device)


def _forward(
    model: PreTrainedModel, ids: Tensor, mask: Tensor, positions: Tensor, cache: Any
) -> tuple[Tensor, Any]:
    """One cached forward; returns float32 last-position logits [batch, vocab] and the cache."""
    extra = {"logits_to_keep": 1} if _accepts_logits_to_keep(model) else {}
    out = model(
        input_ids=ids,
        attention_mask=mask,
        position_ids=positions,
        past_key_values=cache,
        use_cache=True,
        **extra,
    )
    return out.logits[:, -1].float(), out.past_key_values


def _accepts_logits_to_keep(model: PreTrainedModel) -> bool:
    """Whether the model can skip the LM head for all but the last position (prefill memory)."""
    return "logits_to_keep" in inspect.signature(model.forward).parameters


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
