"""Everything that crosses a process boundary between the driver and role-group actors."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rayhf.algorithms.interface import Interface, InterfaceSettings
from rayhf.config.faults import FaultInjection
from rayhf.config.registry import INTERFACES
from rayhf.data.batch import PackedBatch
from rayhf.engines.config import EngineConfig, default_engine
from rayhf.engines.torch_trainer import OptimizerConfig
from rayhf.models.files import ModelFiles
from rayhf.models.precision import Numerics
from rayhf.realloc.plan import Transfer


@dataclass(frozen=True)
class CallSpec:
    """A graph call as a role-group worker needs it."""

    name: str
    kind: str  # generate | inference | train
    interface: str
    args: dict[str, Any] = field(default_factory=dict)
    inputs: dict[str, str] = field(default_factory=dict)  # interface name -> graph key read
    outputs: dict[str, str] = field(default_factory=dict)  # interface name -> graph key written
    # the call's engine; left out, the kind's default (filled in on creation, never None after)
    engine: EngineConfig = None  # type: ignore[assignment]
    # the class ``interface`` names, resolved from the registry where the spec is made (the
    # driver), so a worker builds what the driver checked; never None after creation
    interface_type: type[Interface] = None  # type: ignore[assignment]
    base: bool = False  # runs on the role's base weights, its LoRA adapters off (``Call.base``)

    def __post_init__(self) -> None:
        if self.engine is None:
            object.__setattr__(self, "engine", default_engine(self.kind))
        if self.interface_type is None:
            object.__setattr__(self, "interface_type", INTERFACES[self.interface])


@dataclass(frozen=True)
class WorkerSpec:
    """How to build one rank of a role group."""

    role: str
    layout_name: str
    rank: int  # in the role group: (dp_rank * pp + pp_rank) * tp + tp_rank
    dp_size: int
    tp_size: int
    pp_size: int
    n_microbatches: int  # micro-batches per forward (pipeline)
    calls: tuple[CallSpec, ...]
    settings: InterfaceSettings
    tokenizer_dir: str
    special_ids: dict[str, int | None]  # the tokenizer's pad/eos/bos_token_id (TokenizerDir)
    model: ModelFiles | None  # the model's shape and saved form; None for a function role
    model_dir: str | None  # load weights from here; None = they arrive by reallocation
    value_head: bool
    optimizer: OptimizerConfig | None  # None = frozen role
    seed: int
    threads: int  # torch intra-op threads (the device's CPU share)
    device: str = "cpu"
    activation_checkpointing: bool = False  # recompute each layer's activations in backward
    # the precision, and whether it keeps fp32 master weights (trains or blends them)
    numerics: Numerics = field(default_factory=Numerics)
    fault: FaultInjection | None = None  # this rank dies where the fault fires (drills, tests)
    version: int = 0  # the step whose update made the weights it starts with (a resume's)
    ep_size: int = 1  # dp ranks that split a Mixture-of-Experts model's experts (Layout.ep)
    cp_size: int = 1  # dp ranks that split each sequence of the rows they share (Layout.cp)
    adapter_dir: str | None = None  # LoRA adapters to start from (PEFT's); None: fresh ones


@dataclass(frozen=True)
class CallRequest:
    call: str
    step: int
    batch: PackedBatch
    evaluate: bool = False  # train calls report held-out metrics instead of updating


@dataclass
class CallResult:
    """A rank's output: a batch (generate, inference) or stats (train), and its compute time."""

    call: str
    rank: int
    batch: PackedBatch | None
    stats: dict[str, float]
    seconds: float
    engine: str = ""  # the backend that ran it (native, vllm, torch, deepspeed)
    began: float = 0.0  # wall clock (time.time()) around the call, for the trace
    ended: float = 0.0
    step: int = 0  # the step it belongs to (a node may also wait on the previous step's)
    version: int = 0  # the step whose update made this rank's weights when the call began
    peak_bytes: int = 0  # the device's peak memory during the call (``rayhf.metrics.memory``)


@dataclass(frozen=True)
class StepInput:
    """What a step's DAG is executed with."""

    step: int
    batch: PackedBatch  # the step's dataset rows


@dataclass(frozen=True)
class CallNode:
    """The constant part of one rank's call in a step's DAG."""

    call: str
    sources: tuple[str, ...]  # calls whose outputs it reads, in graph order
    evaluate: bool = False
    release: bool = False  # a copy: drop the weights after the call


@dataclass(frozen=True)
class MoveNode:
    """One rank's part of a weight move in a step's DAG: what it sends, or receives."""

    unit: str  # "realloc:<call>" or "ema:<role>"
    group: str  # the transfer group
    by_peer: dict[int, list[Transfer]]
    eta: float | None = None  # receive: blend instead of copy
    dtype: str = "fp32"  # send: what the slices travel in (the receivers' weight dtype)
    forward: dict[int, list[Transfer]] = field(default_factory=dict)  # receive: what it relays


@dataclass
class MoveResult:
    unit: str
    rank: int
    bytes: int  # received (0 for a sender)
    began: float
    ended: float
    version: int = 0  # a sender: the step whose update made the weights it sent
    sent: bool = False  # a sender's result (a call on the copy reads its version)


@dataclass(frozen=True)
class WeightsSummary:
    """What a rank holds of its role's weights (for tests and logs)."""

    bytes: int  # of the weights this rank holds (a ZeRO-3 rank: its flat slices)
    digest: float  # sum of |w| over them: a cheap fingerprint
