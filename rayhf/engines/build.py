"""Assemble a rank's engines from its calls' engine configs: the trainer its train call asks
for, one generator per generate call (an engine that is ``shared_per_rank``, vLLM, built once
and shared by the calls that ask for it)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rayhf.engines.call import CallEngine, Generator, RankTrainer
from rayhf.engines.collectives import DataParallel
from rayhf.engines.config import EngineConfig
from rayhf.engines.native import NativeGenerator
from rayhf.engines.rank_model import RankModel
from rayhf.engines.torch_trainer import OptimizerConfig, TorchTrainer
from rayhf.models.precision import Numerics
from rayhf.models.spec import Lora
from rayhf.parallel.groups import ParallelGroups


def make_trainer(model: RankModel, optimizer: OptimizerConfig, engine: EngineConfig) -> RankTrainer:
    return engine.make_trainer(model, optimizer)


def make_generators(
    model: RankModel, engines: Mapping[str, EngineConfig], seed: int, sleeps: bool
) -> dict[str, Generator]:
    """A generator per generate call (``engines``: call -> its engine); ``sleeps``: the rank
    also trains, so a vLLM engine sleeps between its calls."""
    out: dict[str, Generator] = {}
    shared: dict[type, Generator] = {}
    for call, engine in engines.items():
        kind = type(engine)
        if kind in shared:
            out[call] = shared[kind]
            continue
        # a shared engine's calls share one weight sync: it is checked when any of them asks
        # to, and the error names each that does (all must say false to skip the check)
        checked_by = tuple(c for c, e in engines.items() if type(e) is kind and e.checks_sync)
        out[call] = engine.make_generator(model, seed, sleeps, checked_by)
        if engine.shared_per_rank:
            shared[kind] = out[call]
    return out


def standalone_engine(
    hf_model: Any,
    tokenizer: Any,
    value_head: bool,
    optimizer: OptimizerConfig | None = None,
    groups: ParallelGroups | None = None,
    n_microbatches: int = 1,
    device: str = "cpu",
    precision: str = "fp32",
    lora: Lora | None = None,
    checkpointing: bool = False,
) -> CallEngine:
    """One rank's engine outside a role group (Ray Train stages, profiling, checks, tests):
    the native generator, and a torch trainer when ``optimizer`` is given (which keeps fp32
    master weights at a lower ``precision``); ``lora``: fresh adapters, the weights frozen."""
    numerics = Numerics(precision, master=optimizer is not None)
    model = RankModel.from_hf(
        hf_model, tokenizer, value_head, lora, groups=groups, n_microbatches=n_microbatches,
        device=device, numerics=numerics, checkpointing=checkpointing,
    )  # fmt: skip
    trainer = TorchTrainer(model, optimizer) if optimizer is not None else None
    comm = DataParallel(model.groups.dp_group)
    return CallEngine(tokenizer, model, comm, NativeGenerator(model), trainer)
