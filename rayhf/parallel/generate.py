"""Sampling with a KV cache on a sharded model: each rank caches its own stage's layers and its
own tensor-parallel heads.

Per step: stage 0 embeds the newest token of every row and the hidden states travel down the
pipeline; the last stage's tp ranks all hold the gathered logits and sample identically (same
generator state); the chosen tokens are broadcast back up the pipeline for the next step. The
sampling rules and the reported log-probs are the native engine's (``next_tokens``).
"""

from __future__ import annotations

import torch

from rayhf.engines.native import GenerateOutput, GenerationConfig, cut_at_eos, next_tokens
from rayhf.errors import RayhfError
from rayhf.parallel.attention import TokenLayout
from rayhf.parallel.pipeline import Pipeline


def generate(
    pipe: Pipeline,
    prompts: list[list[int]],
    cfg: GenerationConfig,
    eos_token_id: int,
    pad_token_id: int,
    generator: torch.Generator | None = None,
) -> GenerateOutput:
    """One response per prompt; every rank of the pipeline returns the same output."""
    if not prompts:
        return GenerateOutput()
    if any(len(p) == 0 for p in prompts):
        raise RayhfError("every prompt needs at least one token; drop or fill the empty prompts")
    with torch.no_grad():
        tokens, logprobs = _decode(pipe, prompts, cfg, eos_token_id, pad_token_id, generator)
    return cut_at_eos(tokens, logprobs, eos_token_id)


def _decode(
    pipe: Pipeline,
    prompts: list[list[int]],
    cfg: GenerationConfig,
    eos_token_id: int,
    pad_token_id: int,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    n_rows, device = len(prompts), pipe.model.device
    lengths = [len(p) for p in prompts]
    cache = pipe.model.new_cache(n_rows, max(lengths) + cfg.max_new_tokens)
    last_token = torch.tensor(lengths, device=device).cumsum(0) - 1
    ids = torch.tensor([t for p in prompts for t in p], dtype=torch.long, device=device)
    logits = pipe.step(ids, TokenLayout.packed(lengths), cache, last_token)
    finished = torch.zeros(n_rows, dtype=torch.bool, device=device)
    step_tokens: list[torch.Tensor] = []
    step_logprobs: list[torch.Tensor] = []
    every_row = torch.arange(n_rows, device=device)
    for step in range(cfg.max_new_tokens):
        if logits is not None:
            tokens, logprobs = next_tokens(logits.float(), step, cfg, eos_token_id, generator)
            tokens = tokens.masked_fill(finished, pad_token_id)
        else:
            tokens = torch.empty(n_rows, dtype=torch.long, device=device)
            logprobs = torch.empty(n_rows, device=device)
        tokens, logprobs = pipe.broadcast(tokens), pipe.broadcast(logprobs)
        step_tokens.append(tokens)
        step_logprobs.append(logprobs)
        finished |= tokens == eos_token_id
        if finished.all() or step + 1 == cfg.max_new_tokens:
            break
        # Finished rows keep decoding pad tokens; their outputs are dropped by cut_at_eos.
        where = TokenLayout.packed([1] * n_rows, start=[n + step for n in lengths])
        logits = pipe.step(tokens, where, cache, every_row)
    return torch.stack(step_tokens, dim=1).cpu(), torch.stack(step_logprobs, dim=1).cpu()
