"""The engine registry: which backend runs a call (the experiment's ``engines:`` section, keyed
by call name), one row per engine.

Each engine is one config class: its own fields (``extra="forbid"``: another engine's field is
refused by name), the call kinds it runs and the kinds it is the default of, the traits the
planner and the runtime read, its checks and its builder. ``ENGINES`` lists the rows and
``EngineConfig`` is their union, chosen by ``engine``. Nothing outside this module compares an
engine's name: code reads the traits. Builders and checks import their implementation when
called, so the planner can read the traits without importing torch.

Adding an engine: a config class here with its traits, ``make_trainer`` or ``make_generator``
and ``check``, a row in ``ENGINES``; its implementation module beside this one.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, ClassVar, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from rayhf.errors import RayhfError
from rayhf.parallel.layout import Layout

if TYPE_CHECKING:
    from rayhf.engines.call import Generator, RankTrainer
    from rayhf.engines.rank_model import RankModel
    from rayhf.engines.torch_trainer import OptimizerConfig

CallKind = Literal["generate", "inference", "train"]


@dataclass(frozen=True)
class EngineSite:
    """What an engine's ``check`` sees of the call it would run: the call, its role, the role's
    calls' layouts under the plan, and what the role is."""

    call: str
    role: str
    role_layouts: Mapping[str, Layout]  # every call of the role -> its layout
    head_dim: int
    device: str  # the cluster's device kind: cpu | cuda
    zero1: bool  # the role's optimizer.zero1
    init_from: str | None  # the role's init_from
    precision: str  # the role's precision
    kind: str  # the call's kind

    @property
    def layout(self) -> Layout:
        return self.role_layouts[self.call]


class BaseEngineConfig(BaseModel):
    """What every engine row declares; an engine overrides the traits that differ."""

    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid", frozen=True)

    engine: str
    kinds: ClassVar[tuple[CallKind, ...]]  # the call kinds it runs
    default_for: ClassVar[tuple[CallKind, ...]] = ()  # the kinds it runs unless told otherwise
    whole_model_ranks: ClassVar[bool] = False  # every rank holds the whole model (tp = pp = 1)
    # a separate inference server on the call's devices (vLLM): its own whole copy of the
    # weights and its reserved KV cache stay resident for the run, which the planner adds
    server_resident: ClassVar[bool] = False
    # one instance per rank serves all the rank's calls on this engine (one vLLM per rank)
    shared_per_rank: ClassVar[bool] = False
    # train: weights and gradients in the compute dtype (an fp32 master copy in the optimizer)
    # rather than fp32 at every precision; the role then keeps no master weights of its own
    trains_in_compute_dtype: ClassVar[bool] = False
    # train: the ZeRO stages a plan may give the call when the cluster is planned for
    zero_choices: ClassVar[tuple[int, ...]] = ()
    # runs Mixture-of-Experts models (vLLM and DeepSpeed not yet: rayhf's weight sync into
    # vLLM and DeepSpeed's flat ZeRO buffers hold no stacked experts)
    runs_experts: ClassVar[bool] = True

    @property
    def runs_adapters(self) -> bool:
        """Whether it runs a role's LoRA adapters (``models.<role>.lora``) as configured."""
        return True

    @property
    def token_budget(self) -> int | None:
        """Tokens per micro-batch of a call (None: each minibatch whole)."""
        return None

    @property
    def checks_sync(self) -> bool:
        """Whether every weight sync into the engine is compared by checksums."""
        return False

    @property
    def offloads_optimizer(self) -> bool:
        """Whether the optimizer state lives in host memory."""
        return False

    def zero_stage_for(self, zero1: bool) -> int:
        """What the optimizer shards over dp (0: nothing; ``zero1``: the role's optimizer.zero1)."""
        del zero1
        return 0

    def at_zero_stage(self, stage: int) -> BaseEngineConfig:
        """The engine a train call runs on when a plan gives it ZeRO ``stage``."""
        del stage
        return self

    def offers_stage(self, stage: int) -> bool:
        """Whether a plan may give a train call on this engine ZeRO ``stage`` (one of its
        ``zero_choices``) as configured."""
        del stage
        return True

    def check(self, site: EngineSite) -> None:
        """Refuse, naming the field, what this engine cannot run at ``site`` (none by default)."""
        del site

    def make_trainer(self, model: RankModel, optimizer: OptimizerConfig) -> RankTrainer:
        raise AssertionError(f"engine '{self.engine}' runs no train call")

    def make_generator(
        self, model: RankModel, seed: int, sleeps: bool, checked_by: tuple[str, ...]
    ) -> Generator:
        """A generator on ``model``; ``sleeps``: the rank also trains; ``checked_by``: the
        rank's calls that ask for their weight syncs to be checked."""
        raise AssertionError(f"engine '{self.engine}' runs no generate call")


class NativeEngineConfig(BaseEngineConfig):
    """rayhf's own generator on the rank's sharded model, any dp x tp x pp layout
    (``rayhf.parallel.decode``): these settings say how its decode engine runs."""

    engine: Literal["native"] = "native"
    """Sampling on the rank's own sharded model."""
    max_rows: int = Field(256, gt=0)
    """Rows decoded at once; a call's further prompts wait for a row that has ended."""
    cuda_graphs: bool = True
    """On CUDA, replay the decode step from a CUDA graph per batch bucket."""
    compile: bool = False
    """``torch.compile`` the decode step first (a minute or more of compiling per process on CPUs;
    pays in long runs of small models)."""
    release_memory: bool = False
    """Free the KV cache and graphs after each call, for a role sharing the device (the next call
    allocates and captures again)."""
    merge_adapters: bool = True
    """With LoRA adapters, decode on copies of the adapted weights with the adapters merged in,
    made again after each weight update (false: add each adapter's two products at every token,
    and hold no such copies where the step lends none anyway: bf16 weights on GPUs)."""

    kinds = ("generate",)
    default_for = ("generate",)

    def make_generator(
        self, model: RankModel, seed: int, sleeps: bool, checked_by: tuple[str, ...]
    ) -> Generator:
        from rayhf.engines.native import NativeGenerator

        return NativeGenerator(model, self)


class VllmEngineConfig(BaseEngineConfig):
    """vLLM samples a generate call (one whole model per rank), the rank's model scores; the
    rank's calls on vLLM share one vLLM engine. A LoRA role's adapters reach it as a LoRA
    adapter where vLLM runs one for the model (the frozen weights loaded once), else merged into
    the weights they adapt, at each sync (``lora_adapter``)."""

    engine: Literal["vllm"] = "vllm"
    """Sampling on vLLM."""
    check_sync: bool = True
    """Compare, after every weight sync into vLLM, a checksum of each of vLLM's parameters with the
    rank's weights, and stop the run naming any that differs (false: skip)."""
    lora_adapter: bool = True
    """With LoRA adapters, load them alone at each sync, as vLLM's own LoRA adapter, where vLLM runs
    LoRA for the model; false (and where it does not): the weights with them merged in, which vLLM
    decodes faster, but every sync moves the whole model."""

    kinds = ("generate",)
    whole_model_ranks = True
    server_resident = True
    shared_per_rank = True
    runs_experts = False

    @property
    def checks_sync(self) -> bool:
        return self.check_sync

    def check(self, site: EngineSite) -> None:
        from rayhf.engines.vllm_generator import check_vllm

        check_vllm(site.call, site.role, site.layout, site.head_dim, site.device)

    def make_generator(
        self, model: RankModel, seed: int, sleeps: bool, checked_by: tuple[str, ...]
    ) -> Generator:
        from rayhf.engines.vllm_generator import VllmGenerator

        return VllmGenerator(model, seed, sleeps, checked_by, not self.lora_adapter)


class TorchEngineConfig(BaseEngineConfig):
    """rayhf's own forward (inference) and AdamW (train, optionally ZeRO-1 or offloaded to host
    memory) on the rank's sharded model, any layout."""

    engine: Literal["torch"] = "torch"
    """Forward and optimizer on the rank's own sharded model."""
    max_tokens_per_microbatch: int | None = Field(None, gt=0)
    """Cut a call's batches into micro-batches of at most this many tokens (the gradients of a
    minibatch's micro-batches accumulate into one optimizer step), so long responses do not run
    out of memory; None runs each minibatch whole."""
    offload: bool = False
    """Train calls: keep AdamW's state and its fp32 copy of the weights in host memory; each
    step's gradients go to the host, AdamW steps there and the weights come back (device
    memory for the state traded for the host link's time; not with optimizer.zero1 or fp16)."""

    kinds = ("inference", "train")
    default_for = ("inference", "train")
    zero_choices = (0, 1, 2, 3)  # 2 and 3 move the call to DeepSpeed (``at_zero_stage``)

    @property
    def token_budget(self) -> int | None:
        return self.max_tokens_per_microbatch

    @property
    def offloads_optimizer(self) -> bool:
        return self.offload

    def zero_stage_for(self, zero1: bool) -> int:
        return 1 if zero1 else 0

    def at_zero_stage(self, stage: int) -> BaseEngineConfig:
        if stage < 2:
            return self
        return DeepSpeedEngineConfig.model_validate({"zero_stage": stage, "offload": self.offload})

    def offers_stage(self, stage: int) -> bool:
        return not (self.offload and stage == 1)  # ZeRO-1 shards what offload keeps on the host

    def check(self, site: EngineSite) -> None:
        if not self.offload:
            return
        field = f"engines.{site.call}.offload"
        if site.kind != "train":
            article = "an" if site.kind[0] in "aeiou" else "a"
            raise RayhfError(
                f"{field}: {site.call} is {article} {site.kind} call, and only train calls have "
                "an optimizer to offload; remove it"
            )
        if site.zero1:
            raise RayhfError(
                f"{field}: an offloaded optimizer steps in host memory and "
                f"models.{site.role}.optimizer.zero1 shards it over devices; drop one"
            )
        if site.precision == "fp16":
            raise RayhfError(
                f"{field}: fp16's loss scaling unscales the gradients on the device, before "
                f"they go to the host; use bf16 for models.{site.role}.precision, or no offload"
            )

    def make_trainer(self, model: RankModel, optimizer: OptimizerConfig) -> RankTrainer:
        from rayhf.engines.torch_trainer import TorchTrainer

        return TorchTrainer(model, optimizer, offload=self.offload)


class DeepSpeedEngineConfig(BaseEngineConfig):
    """DeepSpeed ZeRO trains the call (one whole model per rank, dp-only layouts)."""

    engine: Literal["deepspeed"] = "deepspeed"
    """Training on DeepSpeed."""
    zero_stage: Literal[1, 2, 3] = 2
    """The ZeRO stage."""
    offload: bool = False
    """Keep the optimizer state in CPU memory."""

    kinds = ("train",)
    whole_model_ranks = True
    trains_in_compute_dtype = True
    zero_choices = (1, 2, 3)
    runs_experts = False

    @property
    def runs_adapters(self) -> bool:
        """At ZeRO-1 and 2 (every rank holds the whole model, frozen weights and adapters); not
        at ZeRO-3, whose flat slices would mix frozen weights into what moves."""
        return self.zero_stage < 3

    @property
    def offloads_optimizer(self) -> bool:
        return self.offload

    def zero_stage_for(self, zero1: bool) -> int:
        return self.zero_stage

    def check(self, site: EngineSite) -> None:
        from rayhf.engines.deepspeed_trainer import check_deepspeed

        check_deepspeed(
            site.call, site.role, self, site.role_layouts, site.zero1, site.init_from,
            site.precision,
        )  # fmt: skip

    def make_trainer(self, model: RankModel, optimizer: OptimizerConfig) -> RankTrainer:
        from rayhf.engines.deepspeed_trainer import DeepSpeedTrainer

        return DeepSpeedTrainer(model, optimizer, self)


# the registry: name (each row's ``engine``) -> the engine's row
ENGINES: dict[str, type[BaseEngineConfig]] = {
    cls.model_fields["engine"].default: cls
    for cls in (NativeEngineConfig, VllmEngineConfig, TorchEngineConfig, DeepSpeedEngineConfig)
}

if TYPE_CHECKING:
    EngineConfig = BaseEngineConfig
else:  # one of the rows, chosen by ``engine``
    EngineConfig = Annotated[Union[tuple(ENGINES.values())], Field(discriminator="engine")]  # noqa: UP007


def engines_for(kind: str) -> tuple[str, ...]:
    """The engines that run a call of ``kind``, its default first."""
    names = [n for n, cls in ENGINES.items() if kind in cls.kinds]
    return tuple(sorted(names, key=lambda n: kind not in ENGINES[n].default_for))


@functools.cache  # configs are frozen: one default per kind, built once (planner caches hash it)
def default_engine(kind: str) -> BaseEngineConfig:
    """The engine a call of ``kind`` runs on when ``engines:`` does not name one."""
    for cls in ENGINES.values():
        if kind in cls.default_for:
            return cls.model_validate({})
    raise KeyError(kind)


def owner_of(field: str) -> str | None:
    """The engines whose setting ``field`` is, as a message names them (None: no engine's)."""
    owners = [n for n, cls in ENGINES.items() if field in cls.model_fields]
    return "' or '".join(owners) or None


def check_kind(call: str, kind: str, engine: BaseEngineConfig) -> None:
    """Refuse an engine that cannot run a call of ``kind``, naming the field."""
    if kind not in engine.kinds:
        allowed = ", ".join(engines_for(kind))
        article = "an" if kind[0] in "aeiou" else "a"
        raise RayhfError(
            f"engines.{call}.engine: {article} {kind} call runs on {allowed}, not '{engine.engine}'"
        )
