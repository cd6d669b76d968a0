"""Everything that crosses a process boundary between the driver and role-group actors."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rayhf.algorithms.interface import InterfaceSettings
from rayhf.data.batch import PackedBatch
from rayhf.engines.torch_engine import OptimizerConfig


@dataclass(frozen=True)
class CallSpec:
    """A graph call as a role-group worker needs it."""

    name: str
    kind: str  # generate | inference | train
    interface: str
    args: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class WorkerSpec:
    """How to build one rank of a role group."""

    role: str
    layout_name: str
    rank: int  # in the role group: (dp_rank * pp + pp_rank) * tp + tp_rank
    dp_size: int
    tp_size: int
    pp_size: int
    n_mbs: int  # micro-batches per forward (pipeline)
    calls: tuple[CallSpec, ...]
    settings: InterfaceSettings
    tokenizer_dir: str
    model_dir: str | None  # load weights from here; None with config_dir = weights come later
    config_dir: str | None  # build from this config (random weights) when model_dir is None
    value_head: bool
    optimizer: OptimizerConfig | None  # None = frozen role
    seed: int
    threads: int  # torch intra-op threads (the device's CPU share)
    device: str = "cpu"


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
