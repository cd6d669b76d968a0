"""Sampling with a KV cache on a sharded model: each rank caches its own stage's layers and its
own tensor-parallel heads.

Per step: stage 0 embeds the newest token of every row and the hidden states travel down the
pipeline; the last stage's tp ranks all hold the gathered logits and sample identically (same
generator state); the chosen tokens are broadcast back up the pipeline for the next step. The
loop and the sampling rules are ``rayhf.sampling``'s.
"""

from __future__ import annotations

import torch

from rayhf.parallel.attention import TokenLayout
from rayhf.parallel.pipeline import Pipeline
from rayhf.sampling import DecodeSteps, GenerateOutput, GenerationConfig, check_prompts, decode


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
    check_prompts(prompts)
    n_rows, device = len(prompts), pipe.model.device
    lengths = [len(p) for p in prompts]
    cache = pipe.model.new_cache(n_rows, max(lengths) + cfg.max_new_tokens)
    every_row = torch.arange(n_rows, device=device)

    def prefill() -> torch.Tensor | None:
        last_token = torch.tensor(lengths, device=device).cumsum(0) - 1
        ids = torch.tensor([t for p in prompts for t in p], dtype=torch.long, device=device)
        return pipe.step(ids, TokenLayout.packed(lengths), cache, last_token)

    def extend(tokens: torch.Tensor, step: int) -> torch.Tensor | None:
        where = TokenLayout.packed([1] * n_rows, start=[n + step for n in lengths])
        return pipe.step(tokens, where, cache, every_row)

    steps = DecodeSteps(prefill, extend, pipe.broadcast)
    with torch.no_grad():
        return decode(steps, n_rows, cfg, eos_token_id, pad_token_id, generator, device)
