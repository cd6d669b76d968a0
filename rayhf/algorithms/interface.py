"""The interface base class and an algorithm's registration: what a call computes, separate
from where it runs.

It holds ``CallContext`` and ``InterfaceSettings`` (what a call is given), the ``Interface``
base class, and ``Algorithm``: the row an algorithm module exports (``ALGORITHM``), its config
section and its interfaces, which ``rayhf.config.registry`` lists.

An *interface* (named in the graph file by its ``name``, e.g. ``ppo_actor``) turns a packed
batch into outputs (generate, inference) or into an optimizer update (train). It sees the model
only through ``CallEngine`` (``rayhf.engines.call``: the rank's model, the call's generator and
trainer, the dp reductions), so the runtime that hosts it names no algorithm, and an algorithm
is added by a row in the registry, not by touching the runtime.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from pydantic import BaseModel

from rayhf.data.batch import PackedBatch
from rayhf.engines.call import CallEngine
from rayhf.sampling import GenerationConfig

# per sample a generate call made: the step whose update made the weights that sampled it
VERSION_EXTRA = "policy_version"
# per sample a generate call of a Mixture-of-Experts policy made with ``algorithm.router_replay``:
# the experts each token went to, ``[tokens, L, k]`` int16 (``rayhf.sampling.GenerateOutput``)
ROUTES_EXTRA = "expert_routes"


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
    env: Any = None  # the experiment's ``env:`` (rayhf.envs.env.EnvConfig) for multi-turn calls
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

    name = "interface"  # the name graphs call it by (each interface class sets its own)
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

    def generate(self, engine: CallEngine, batch: PackedBatch, ctx: CallContext) -> PackedBatch:
        raise NotImplementedError(f"interface '{self.name}' has no generate call")

    def inference(self, engine: CallEngine, batch: PackedBatch, ctx: CallContext) -> PackedBatch:
        raise NotImplementedError(f"interface '{self.name}' has no inference call")

    def train_step(
        self, engine: CallEngine, batch: PackedBatch, ctx: CallContext
    ) -> dict[str, float]:
        raise NotImplementedError(f"interface '{self.name}' has no train call")

    def evaluate(
        self, engine: CallEngine, batch: PackedBatch, ctx: CallContext
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


@dataclass(frozen=True)
class Algorithm:
    """One algorithm's registration: its ``algorithm:`` config section (whose ``name`` default
    selects it) and the interfaces its graphs name (``graphs/<name>.yaml`` among them)."""

    config: type[BaseModel]
    interfaces: tuple[type[Interface], ...]

    @property
    def name(self) -> str:
        return str(self.config.model_fields["name"].default)

    def with_interfaces(self, *more: type[Interface]) -> Algorithm:
        """This row with ``more`` interfaces of the algorithm that live in a higher layer."""
        return Algorithm(self.config, self.interfaces + more)
