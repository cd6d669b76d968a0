"""The seams: a call's generator and a role's trainer, and the view of them an interface gets.

    Generator    generate(prompts, cfg, seed) -> tokens + log-probs  NativeGenerator, VllmGenerator
    RankTrainer  train(minibatches, loss_fn) -> stats, optimizer I/O  TorchTrainer, DeepSpeedTrainer

A worker holds one trainer per rank (its role's train call picks it) and one generator per
generate call (each call's ``engines:`` entry picks its own), and hands each call a
``CallEngine``: the rank's model for forwards, the call's generator, the trainer, and the
data-parallel reductions; it is all an algorithm's interface sees of the model.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from rayhf.data.batch import PackedBatch
from rayhf.engines.collectives import DataParallel
from rayhf.engines.config import default_engine
from rayhf.engines.rank_model import RankModel
from rayhf.engines.torch_trainer import LossFn, Weight, response_tokens
from rayhf.sampling import Feed, GenerateOutput, GenerationConfig


class Generator(Protocol):
    """Samples responses for a generate call; sees new weights through the rank's model."""

    name: str

    def generate(
        self, prompts: list[list[int]], cfg: GenerationConfig, seed: int
    ) -> GenerateOutput: ...


class RankTrainer(Protocol):
    """Optimizer steps over a rank's model, and the state a checkpoint keeps of them."""

    name: str
    optimizer: Any

    @property
    def gathers_over_dp(self) -> bool: ...

    def train(
        self,
        minibatches: Sequence[PackedBatch],
        loss_fn: LossFn,
        token_budget: int | None = ...,
        weight: Weight = ...,
    ) -> dict[str, float]: ...

    def weights_loaded(self) -> None: ...

    def shard_source(self) -> Any: ...

    def gathered(self) -> AbstractContextManager[None]: ...

    def save_optimizer(self, path: str) -> dict[str, Any]: ...

    def load_optimizer(self, path: str, state: dict[str, Any]) -> None: ...


@dataclass
class CallEngine:
    """What one call's interface runs on (``model`` None: a function-valued role)."""

    tokenizer: Any
    model: RankModel | None
    comm: DataParallel
    generator: Generator | None = None
    trainer: RankTrainer | None = None
    token_budget: int | None = None  # the call's max_tokens_per_microbatch

    @property
    def pad_id(self) -> int:
        return int(self.tokenizer.pad_token_id)

    @property
    def eos_id(self) -> int:
        return int(self.tokenizer.eos_token_id)

    @property
    def value_head(self) -> bool:
        return self.model is not None and self.model.spec.value_head

    @property
    def name(self) -> str:
        """The backend that runs this call: its generator, its trainer, else the inference
        default (the rank's forward), or ``function`` for a role without a model."""
        for part in (self.generator, self.trainer):
            if part is not None:
                return part.name
        return default_engine("inference").engine if self.model is not None else "function"

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        assert self.model is not None, "forward on a role without a model"
        return self.model.forward(input_ids, attention_mask)

    def score(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        targets: torch.Tensor,
        temperature: float = 1.0,
        routes: torch.Tensor | None = None,
        replay: bool = False,
    ) -> torch.Tensor:
        """``RankModel.score``."""
        assert self.model is not None, "score on a role without a model"
        return self.model.score(input_ids, attention_mask, targets, temperature, routes, replay)

    @property
    def streams(self) -> bool:
        """Whether the call's generator takes a ``Feed``."""
        return bool(getattr(self.generator, "streams", False))

    def generate(
        self, prompts: list[list[int]], cfg: GenerationConfig, seed: int, feed: Feed | None = None
    ) -> GenerateOutput:
        """The call's responses; a ``feed`` reaches a generator that streams (the native one),
        others answer the given prompts only."""
        assert self.generator is not None, "generate outside a generate call"
        if feed is not None and self.streams:
            return self.generator.generate(prompts, cfg, seed, feed)  # type: ignore[call-arg]
        return self.generator.generate(prompts, cfg, seed)

    def train(
        self, minibatches: Sequence[PackedBatch], loss_fn: LossFn, weight: Weight = response_tokens
    ) -> dict[str, float]:
        """One optimizer step per minibatch; ``weight``: what ``loss_fn`` averages over (the
        response tokens, or ``samples``), for the call's token-budget micro-batches."""
        assert self.trainer is not None, "train on a frozen role"
        return self.trainer.train(minibatches, loss_fn, self.token_budget, weight)

    def micro_batches(self, batch: PackedBatch) -> list[PackedBatch]:
        """``batch`` cut by the call's token budget for forwards without gradients (inference);
        ``PackedBatch.concat`` of the results' parts keeps the samples' order."""
        return [batch] if self.token_budget is None else batch.token_chunks(self.token_budget)

    def all_reduce_mean(self, values: dict[str, float]) -> dict[str, float]:
        return self.comm.all_reduce_mean(values)

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        return self.comm.all_reduce_sum(t)

    def all_gather_object(self, obj: object) -> list[object]:
        return self.comm.all_gather_object(obj)

    def full_state(self) -> dict[str, torch.Tensor]:
        """The whole model (a collective over the replica; ZeRO-3: over dp too)."""
        assert self.model is not None
        return whole_state(self.model, self.trainer)


def whole_state(model: RankModel, trainer: RankTrainer | None) -> dict[str, torch.Tensor]:
    """``model``'s whole state dict, gathered over the replica's tp and pp ranks (and the dp
    ranks where the trainer shards parameters: ZeRO-3), as tensors of its own."""
    gather = trainer.gathered() if trainer is not None else contextlib.nullcontext()
    with gather:
        return {k: v.clone() for k, v in model.full_state().items()}
