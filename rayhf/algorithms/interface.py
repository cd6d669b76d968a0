"""The interface base class and registry: what a call computes, separate from where it runs.

It holds ``ModelEngine`` (the model-side operations an interface may use), ``CallContext`` and
``InterfaceSettings`` (what a call is given), the ``Interface`` base class, and the ``INTERFACES``
registry with ``register`` and ``make_interface``.

An *interface* (named in the graph file, e.g. ``ppo_actor``) turns a packed batch into outputs
(generate, inference) or into an optimizer update (train). It sees the model only through the
``ModelEngine`` protocol, so the runtime that hosts it names no algorithm, and an algorithm is
added by registering an interface here, not by touching the runtime.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import torch
from pydantic import BaseModel

from rayhf.data.batch import PackedBatch
from rayhf.sampling import Feed, GenerateOutput, GenerationConfig

# per sample a generate call made: the step whose update made the weights that sampled it
VERSION_EXTRA = "policy_version"


class ModelEngine(Protocol):
    """The model-side operations an interface may use (``rayhf.engines`` implements it)."""

    tokenizer: Any

    @property
    def pad_id(self) -> int: ...

    @property
    def eos_id(self) -> int: ...

    @property
    def value_head(self) -> bool: ...

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor: ...

    def score(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        targets: torch.Tensor,
        temperature: float = ...,
    ) -> torch.Tensor: ...

    def generate(
        self, prompts: list[list[int]], cfg: GenerationConfig, seed: int, feed: Feed | None = ...
    ) -> GenerateOutput: ...

    def train(
        self,
        minibatches: Sequence[PackedBatch],
        loss_fn: Callable[[PackedBatch], tuple[torch.Tensor, dict[str, float]]],
        weight: Callable[[PackedBatch], float] = ...,
    ) -> dict[str, float]: ...

    def micro_batches(self, batch: PackedBatch) -> list[PackedBatch]: ...

    def all_reduce_mean(self, values: dict[str, float]) -> dict[str, float]: ...

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor: ...

    def all_gather_object(self, obj: object) -> list[object]: ...


@dataclass(frozen=True)
class CallContext:
    """Where and when a call runs, for seeding and logging."""

    step: int
    dp_rank: int
    dp_size: int
    seed: int
    args: dict[str, Any] = field(default_factory=dict)  # the graph's per-call ``args``


@dataclass(frozen=True)
class InterfaceSettings:
    """The experiment settings an interface may read."""

    algorithm: Any  # the algorithm's config model, e.g. PPOConfig
    generation: GenerationConfig
    function: str | None = None  # "module:function" for a function-valued role (rewards)
    env: Any = None  # the experiment's ``env:`` (rayhf.envs.EnvConfig) for multi-turn calls
    judge: Any = None  # the experiment's ``judge:`` (rayhf.algorithms.judge.JudgeConfig)


@dataclass(frozen=True)
class WorkShape:
    """What one call computes beyond one pass over the step's batch: the planner prices it
    (``rayhf.runtime.planning.planner_workloads``) as the interface runs it."""

    samples_per_prompt: int = 1  # generate: responses per prompt (the step's sequences)
    epochs: int = 1  # train: passes over the minibatches
    forward_share: float = 0.0  # train: share of the batch forwarded without gradients first
    reads_answers: bool = False  # generate: its prompts are the step's prompts and responses
    # (a judge's), and it writes ``new_tokens`` each
    new_tokens: int | None = None  # generate: tokens written (None: generation.max_new_tokens)


class Interface:
    """Base class: a call kind an interface does not support is a graph error."""

    name = "interface"
    config_type: ClassVar[type[BaseModel] | None] = (
        None  # the algorithm config it needs; None = any
    )
    # What the runtime must know of a call without naming keys itself (interface key names):
    balance_keys: ClassVar[tuple[str, ...]] = ("seq", "prompts")  # the first present balances
    # a data-parallel split by its token counts (else the batch's first key)
    sequence_keys: ClassVar[tuple[str, ...]] = ("seq",)  # token sequences a train call learns
    # from (the step's tokens/s counts them)
    takes_function: ClassVar[bool] = False  # may run on a function-valued role (no model)
    needs_env: ClassVar[bool] = False  # its generate call runs the experiment's ``env:``
    needs_judge: ClassVar[bool] = False  # its generate call asks with the ``judge:`` section

    def __init__(self, settings: InterfaceSettings) -> None:
        self.settings = settings

    @classmethod
    def work_shape(cls, algorithm: Any, kind: str) -> WorkShape:
        """The work of a ``kind`` call under the ``algorithm`` config (default: one pass)."""
        del algorithm, kind
        return WorkShape()

    def generate(self, engine: ModelEngine, batch: PackedBatch, ctx: CallContext) -> PackedBatch:
        raise NotImplementedError(f"interface '{self.name}' has no generate call")

    def inference(self, engine: ModelEngine, batch: PackedBatch, ctx: CallContext) -> PackedBatch:
        raise NotImplementedError(f"interface '{self.name}' has no inference call")

    def train_step(
        self, engine: ModelEngine, batch: PackedBatch, ctx: CallContext
    ) -> dict[str, float]:
        raise NotImplementedError(f"interface '{self.name}' has no train call")

    def evaluate(
        self, engine: ModelEngine, batch: PackedBatch, ctx: CallContext
    ) -> dict[str, float]:
        """Held-out metrics of a train call, without updating anything (none by default).

        Every dp rank calls it, so an override must call the same collectives on every rank.
        """
        return {}

    def state_dict(self) -> dict[str, Any]:
        """State that must survive a resume (e.g. an adaptive KL coefficient)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        del state


INTERFACES: dict[str, type[Interface]] = {}


def register(name: str) -> Callable[[type[Interface]], type[Interface]]:
    def wrap(cls: type[Interface]) -> type[Interface]:
        cls.name = name
        INTERFACES[name] = cls
        return cls

    return wrap


def make_interface(name: str, settings: InterfaceSettings) -> Interface:
    return INTERFACES[name](settings)
