"""Shared language-model pieces: the ``lm`` interface and the helpers the algorithm interfaces use.

It holds ``token_logprobs`` (per-token log-probs from logits), ``response_forward`` (log-probs
and entropies, or values, of the response tokens), sampling a batch of responses
(``sample_batch``), log-prob inference (``logprob_batch``), the rollout statistics of the
critic-free actors (``rollout_stats``) and ``LMInterface``, the generate / log-prob interface
every actor extends.

A sample's ``seq`` is prompt + response ids and ``prompt_lens`` its prompt length; every
per-response-token tensor is right-padded ``[B, R]`` with a bool mask (see ``seqs``).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor

from rayhf.algorithms.interface import ROUTES_EXTRA, CallContext, CallEngine, Interface
from rayhf.algorithms.seqs import (
    gather_positions,
    pack_per_token,
    padded_inputs,
    response_index,
    response_labels,
    response_lengths,
)
from rayhf.data.batch import PackedBatch
from rayhf.errors import RayhfError
from rayhf.sampling import GenerationConfig


def token_logprobs(logits: Tensor, labels: Tensor, temperature: float = 1.0) -> Tensor:
    """Log-probability ``[B, T]`` of each label under ``softmax(logits / temperature)``.

    Computed in float32 as gather minus logsumexp, which avoids a second ``[B, T, V]`` tensor.
    The temperature must match the one used for sampling, or the ratios are biased.
    """
    if temperature <= 0:
        raise RayhfError(f"temperature must be > 0, got {temperature}; set a positive value")
    scaled = logits.float() / temperature
    picked = scaled.gather(-1, labels.long().unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(scaled, dim=-1)


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy ``[B, T]`` of the categorical distribution ``softmax(logits)``."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)


def scores_from_logits(logits: Tensor, targets: Tensor, temperature: float = 1.0) -> Tensor:
    """What ``engine.score`` returns, from whole logits ``[B, T, V]``: ``[B, T, 2]`` log-prob
    of each target (-1: none, 0 out) and entropy under ``softmax(logits / temperature)``. The
    plain path the sliced one is checked against, and what a test's fake engine scores with."""
    keep = targets >= 0
    logp = token_logprobs(logits, targets.clamp(min=0), temperature)
    entropy = entropy_from_logits(logits.float() / temperature)
    return torch.stack([logp, entropy], dim=-1) * keep.unsqueeze(-1)


def response_forward(
    engine: CallEngine, batch: PackedBatch, temperature: float = 1.0, routes: str = "off"
):
    """``(logprobs or values [B, R], entropy [B, R] or None, mask [B, R])``, on the CPU.

    An LM gives the log-probs of the response tokens under ``softmax(logits / temperature)``
    and the entropy of each of those distributions, computed by ``engine.score`` a slice of
    tokens at a time (no ``[B, R, V]`` logits, in forward or backward); a value-head model gives
    the value of the state before each response token (and None). ``routes`` (an
    ``algorithm.router_replay``): what the forward does with the generator's experts of each
    token where the samples carry them (``ROUTES_EXTRA``).
    """
    ids, attn = padded_inputs(batch, engine.pad_id)
    positions, mask = response_index(batch)
    if temperature <= 0:
        raise RayhfError(f"temperature must be > 0, got {temperature}; set a positive value")
    if engine.value_head:
        return gather_positions(engine.forward(ids, attn), positions).cpu(), None, mask
    targets = torch.full_like(ids, -1)
    rows = torch.arange(len(ids)).unsqueeze(1).expand_as(positions)
    targets[rows[mask], positions[mask]] = response_labels(ids, positions)[mask]
    given = padded_routes(batch, ids.shape[1]) if routes != "off" else None
    if given is not None:
        scored = engine.score(ids, attn, targets, temperature, given, routes == "replay")
    else:
        scored = engine.score(ids, attn, targets, temperature)
    scored = gather_positions(scored, positions).cpu()
    scored = scored * mask.unsqueeze(-1)  # padding: 0, not position 0's scores
    return scored[..., 0], scored[..., 1], mask


def padded_routes(batch: PackedBatch, width: int) -> torch.Tensor | None:
    """The samples' generator experts (``ROUTES_EXTRA``) right-padded to ``[B, width, L, k]``
    with -1 (a sample without any: all -1); None when no sample has any."""
    routes = batch.extras.get(ROUTES_EXTRA)
    some = [r for r in routes or [] if r is not None]
    if not some:
        return None
    out = torch.full((batch.n_samples, width, *some[0].shape[1:]), -1, dtype=torch.int16)
    for i, r in enumerate(routes or []):
        if r is not None:
            out[i, : len(r)] = r
    return out


def padded(batch: PackedBatch, key: str) -> torch.Tensor:
    return batch.to_padded(key, 0.0)[0].float()


def generation_config(base: GenerationConfig, args: dict[str, Any]) -> GenerationConfig:
    """The experiment's generation settings with a call's ``args.generation`` overrides."""
    overrides = args.get("generation", {})
    return GenerationConfig.model_validate({**base.model_dump(), **overrides})


def sample_batch(
    engine: CallEngine,
    batch: PackedBatch,
    cfg: GenerationConfig,
    ctx: CallContext,
    n_samples: int = 1,
) -> PackedBatch:
    """Generate ``n_samples`` responses per prompt: ``seq``, ``prompt_lens``, ``logprobs``.

    With ``n_samples > 1`` the result is a new batch: sample ``j`` of prompt ``p`` gets id
    ``p * n_samples + j``, and key ``group_ids`` holds ``p`` (its prompt's sample id).
    """
    prompts = [batch.sample("prompts", i).tolist() for i in range(batch.n_samples)]
    expanded = [p for p in prompts for _ in range(n_samples)]
    seed = ctx.seed * 100_003 + ctx.step * 101 + ctx.dp_rank
    out = engine.generate(expanded, cfg, seed=seed)
    seqs = [p + t for p, t in zip(expanded, out.tokens, strict=True)]
    routes = {ROUTES_EXTRA: out.routes} if out.routes else {}
    if n_samples == 1:
        ids = list(batch.sample_ids)
    else:
        ids = [sid * n_samples + j for sid in batch.sample_ids for j in range(n_samples)]
    result = PackedBatch(ids)
    result.add("seq", torch.tensor([t for s in seqs for t in s]), [len(s) for s in seqs])
    result.add("prompt_lens", torch.tensor([len(p) for p in expanded]), [1] * len(expanded))
    lps = [lp for row in out.logprobs for lp in row]
    result.add("logprobs", torch.tensor(lps, dtype=torch.float32), [len(t) for t in out.tokens])
    if n_samples > 1:
        groups = [sid for sid in batch.sample_ids for _ in range(n_samples)]
        result.add("group_ids", torch.tensor(groups), [1] * len(groups))
    for key, values in batch.extras.items():  # each answer keeps its prompt's row
        result.add_extra(key, [v for v in values for _ in range(n_samples)])
    for key, values in routes.items():
        result.add_extra(key, values)
    return result


def logprob_batch(
    engine: CallEngine,
    batch: PackedBatch,
    temperature: float,
    key: str = "logprobs",
    routes: str = "off",
) -> PackedBatch:
    """Per-response-token log-probs (or values, for a value head) under ``key``, one forward
    per micro-batch of the call's token budget (``routes``: see ``response_forward``)."""
    parts = []
    for part in engine.micro_batches(batch):
        with torch.no_grad():
            values, _, _ = response_forward(engine, part, temperature, routes)
        packed, lens = pack_per_token(part, values)
        parts.append(PackedBatch(list(part.sample_ids), {key: packed}, {key: lens}))
    return PackedBatch.concat(parts)


def rollout_means(batch: PackedBatch) -> dict[str, float]:
    """Mean task reward and response length of ``batch``."""
    return {
        "task_reward": batch.tensors["scores"].float().mean().item(),
        "response_len": torch.tensor(response_lengths(batch)).float().mean().item(),
    }


def rollout_stats(engine: CallEngine, batch: PackedBatch) -> dict[str, float]:
    """``rollout_means`` over every dp rank's batch."""
    return engine.all_reduce_mean(rollout_means(batch))


class LMInterface(Interface):
    """A causal LM's generate (``seq``, ``prompt_lens``, ``logprobs``) and log-prob inference.

    Call args: ``generation`` (overrides of the experiment's generation settings, e.g.
    ``{greedy: true}``).
    """

    name = "lm"
    # the policy's own calls: its generator's experts (``algorithm.router_replay``) reach its
    # forwards; not a reference's or another model's
    policy: ClassVar[bool] = False

    @property
    def temperature(self) -> float:
        gen = self.settings.generation
        return 1.0 if gen.greedy else gen.temperature

    @property
    def router_replay(self) -> str:
        """The algorithm's ``router_replay`` in this interface's calls ("off": none)."""
        return getattr(self.settings.algorithm, "router_replay", "off") if self.policy else "off"

    def generation(self, ctx: CallContext) -> GenerationConfig:
        """The call's generation settings (its ``args`` applied); the experts of each token
        kept where the algorithm replays or measures them."""
        cfg = generation_config(self.settings.generation, ctx.args)
        if self.router_replay != "off":
            cfg = cfg.model_copy(update={"expert_routes": True})
        return cfg

    def generate(self, engine: CallEngine, batch: PackedBatch, ctx: CallContext) -> PackedBatch:
        return sample_batch(engine, batch, self.generation(ctx), ctx)

    def inference(self, engine: CallEngine, batch: PackedBatch, ctx: CallContext) -> PackedBatch:
        return logprob_batch(engine, batch, self.temperature, routes=self.router_replay)
