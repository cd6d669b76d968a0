"""Training with DeepSpeed ZeRO, in the role-group actor's own process.

The rank's ``ShardedModel`` (tp = pp = 1: the whole model) is handed to ``deepspeed.initialize``
with the role's AdamW settings; the forward stays rayhf's (so the algorithms, generation and
inference calls on the same ranks run unchanged) and DeepSpeed owns backward, the gradient
reduction over the data-parallel ranks, clipping and the optimizer step:

    stage 1   optimizer state split over the dp ranks
    stage 2   + gradients split (reduce-scatter instead of all-reduce)
    stage 3   + parameters split: each dp rank keeps a flat 1/dp slice of every parameter
              (``param.ds_tensor``); forward and backward gather them for the moment they run

At bf16 DeepSpeed runs its bf16 mode (the rank's weights in bf16, its fp32 master copy in the
optimizer: what OpenRLHF runs, and what verl's FSDP gathers), so ZeRO-3 gathers and gradient
reductions move bf16; the torch engine instead keeps fp32 weights under autocast.

The role group's process group is the dp group (DeepSpeed takes torch.distributed's world), gloo
on CPU and NCCL on GPU. Weights leave a ZeRO-3 group as its flat slices: reallocation plans from
that layout (``rayhf.realloc.plan``, ``src_flat``), so no rank ever gathers the whole model to send.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from rayhf.data.batch import PackedBatch
from rayhf.engines.collectives import DataParallel
from rayhf.engines.config import DeepSpeedEngineConfig
from rayhf.engines.rank_model import RankModel
from rayhf.engines.torch_trainer import (
    LossFn,
    OptimizerConfig,
    Totals,
    Weight,
    global_scales,
    response_tokens,
)
from rayhf.errors import RayhfError
from rayhf.parallel.attention import TokenLayout
from rayhf.parallel.layout import Layout

DEEPSPEED_EXTRA = "pip install 'rayhf[deepspeed]'"


def import_deepspeed() -> Any:
    """The ``deepspeed`` module, or a one-line error naming the extra to install."""
    os.environ.setdefault("DS_BUILD_OPS", "0")  # nothing to compile at import
    try:
        import deepspeed
    except ImportError as e:
        msg = f"engine 'deepspeed' needs DeepSpeed, which is not installed: {DEEPSPEED_EXTRA}"
        raise RayhfError(msg) from e
    # DeepSpeed's CPU backend JIT-compiles a shared-memory op (30 s on 2 cores, under a lock file
    # in ~/.cache that a killed build leaves behind, hanging every later run) for an inference
    # all-reduce the trainer never calls: training reduces through torch.distributed.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    return deepspeed


def check_deepspeed(
    call: str, role: str, engine: DeepSpeedEngineConfig, role_layouts: Mapping[str, Layout],
    zero1: bool, init_from: str | None, precision: str = "fp32",
) -> None:  # fmt: skip
    """Refuse, naming the field, what DeepSpeed cannot run here: a tp/pp layout, torch's
    ``zero1`` beside it, ZeRO-3 receiving weights (``init_from``), ZeRO-3 ranks shared with the
    role's other calls (``role_layouts``: every call of the role -> its layout), fp16 (its loss
    scaling is the torch engine's), no DeepSpeed."""
    layout, field = role_layouts[call], f"engines.{call}"
    if precision == "fp16":
        raise RayhfError(
            f"models.{role}.precision: fp16 training scales the loss on engine 'torch' only, "
            f"and {call} runs on DeepSpeed; use bf16, or engine torch for {call}"
        )
    if layout.tp > 1 or layout.pp > 1 or layout.cp > 1:
        raise RayhfError(
            f"{field}.engine: DeepSpeed ZeRO shards over data-parallel ranks only (tp=1, pp=1, "
            f"cp=1) but the plan gives {call} {layout.name}; set plan.{call} to a dp-only layout"
        )
    if zero1:
        raise RayhfError(
            f"models.{role}.optimizer.zero1: {call} runs on DeepSpeed, whose zero_stage "
            f"already shards the optimizer; remove zero1"
        )
    if engine.zero_stage == 3 and init_from is not None:
        raise RayhfError(
            f"{field}.zero_stage: a ZeRO-3 role sends its weights but cannot receive them, and "
            f"models.{role}.init_from would; use zero_stage 1 or 2, or drop init_from"
        )
    if engine.zero_stage == 3:  # its ranks hold slices: the role's other calls need their own
        for other, lay in role_layouts.items():
            if other != call and lay == layout:
                raise RayhfError(
                    f"plan.{other}: role '{role}' trains on ZeRO-3 ({call}), whose ranks hold "
                    f"only slices of the weights; give {other} a layout other than {call}'s"
                )
    if importlib.util.find_spec("deepspeed") is None:
        raise RayhfError(f"{field}.engine: DeepSpeed is not installed: {DEEPSPEED_EXTRA}")


def ds_config(
    optim: OptimizerConfig, zero_stage: int, offload: bool, bf16: bool = False
) -> dict[str, Any]:
    """DeepSpeed's config for one train call: fp32, or ``bf16`` (DeepSpeed's bf16 mode: bf16
    weights, gathers and gradients, an fp32 master copy in the optimizer), one micro-batch per
    step (rayhf cuts the minibatches itself), AdamW from torch (no CPU-Adam build), ZeRO
    ``zero_stage``."""
    zero: dict[str, Any] = {"stage": zero_stage}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
        if zero_stage == 3:
            zero["offload_param"] = {"device": "cpu"}
    precision = {"bf16": {"enabled": True}} if bf16 else {}
    return {
        **precision,
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": optim.grad_clip,
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": optim.lr,
                "betas": list(optim.betas),
                "eps": optim.eps,
                "weight_decay": optim.weight_decay,
                "torch_adam": True,
            },
        },
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


class DeepSpeedTrainer:
    """DeepSpeed's backward and step over a ``RankModel`` (``engine: deepspeed``)."""

    name = "deepspeed"

    def __init__(
        self, model: RankModel, cfg: OptimizerConfig, engine: DeepSpeedEngineConfig
    ) -> None:
        assert model.groups.tp == 1 and model.groups.pp == 1, "DeepSpeed ranks hold whole models"
        self.model, self.zero_stage = model, engine.zero_stage
        self.comm = DataParallel(model.groups.dp_group)
        deepspeed = import_deepspeed()
        _join_world(model.device.type == "cpu", model.groups.dp)
        bf16 = model.numerics.compute == torch.bfloat16
        config = ds_config(cfg, engine.zero_stage, engine.offload, bf16)
        params = [p for p in model.module.parameters() if p.requires_grad]  # (LoRA: adapters)
        self.ds, self.optimizer, _, _ = deepspeed.initialize(
            model=model.module, model_parameters=params, config=config
        )

    @property
    def gathers_over_dp(self) -> bool:
        """Whether gathering the whole model is a collective over the dp ranks too (ZeRO-3:
        no replica holds it)."""
        return self.zero_stage == 3

    def train(
        self,
        minibatches: Sequence[PackedBatch],
        loss_fn: LossFn,
        token_budget: int | None = None,
        weight: Weight = response_tokens,
    ) -> dict[str, float]:
        """One DeepSpeed step per minibatch; a rank without samples in one backpropagates a
        zero loss so the gradient reduction lines up. (No token budget: DeepSpeed fixes its
        gradient accumulation steps at start, and a budget's micro-batch count varies.)"""
        assert token_budget is None, "max_tokens_per_microbatch is a torch engine setting"
        self.model.module.train(True)
        totals = Totals(len(minibatches))
        scales = global_scales(self.comm, minibatches, weight)
        try:
            for mb, scale in zip(minibatches, scales, strict=True):
                if mb.n_samples > 0:
                    loss, stats = loss_fn(mb)
                    loss = loss * scale  # a mean over every dp rank's tokens (or samples)
                    totals.add(stats)
                else:
                    loss = self._zero_loss()
                self.ds.backward(loss)
                self.ds.step()
                norm = float(self.ds.get_global_grad_norm() or 0.0)
                totals.add({"grad_norm": norm})
            self.model.changed()
        finally:
            self.model.module.train(False)
        return totals.reduced(self.comm)

    def _zero_loss(self) -> torch.Tensor:
        ids = torch.full((1,), self.model.pad_id, dtype=torch.long, device=self.model.device)
        return self.model.module(ids, TokenLayout.packed([1])).sum() * 0.0

    def weights_loaded(self) -> None:
        """Weights written into the module from outside become the optimizer's master copy."""
        if self.gathers_over_dp:
            raise RuntimeError("a ZeRO-3 role group sends its weights; it does not receive them")
        self.ds.optimizer.refresh_fp32_params()

    def shard_source(self) -> Any:
        """What a move out of this layout reads: ZeRO-3's flat slices, else the shards."""
        return _FlatSlices(self.model) if self.gathers_over_dp else self.model

    @contextlib.contextmanager
    def gathered(self) -> Iterator[None]:
        """ZeRO-3: every parameter gathered over the dp ranks meanwhile (all of them call)."""
        if not self.gathers_over_dp:
            yield
            return
        deepspeed = import_deepspeed()
        with deepspeed.zero.GatheredParameters(list(self.model.module.parameters())):
            yield

    def save_optimizer(self, path: str) -> dict[str, Any]:
        """DeepSpeed's own checkpoint (optimizer partitions per rank) under ``path``; every dp
        rank calls."""
        self.ds.save_checkpoint(path, tag="deepspeed", save_latest=False)
        return {"deepspeed_tag": "deepspeed"}

    def load_optimizer(self, path: str, state: dict[str, Any]) -> None:
        self.ds.load_checkpoint(path, tag=state["deepspeed_tag"], load_module_strict=True)


class _FlatSlices:
    """A ZeRO-3 rank as a reallocation source: its flat slice of every parameter."""

    def __init__(self, model: RankModel) -> None:
        self.model = model

    def source_shards(self) -> dict[str, torch.Tensor]:
        shards = self.model.module.local_state()
        return {name: getattr(p, "ds_tensor") for name, p in shards.items()}  # noqa: B009


def _join_world(cpu: bool, dp: int) -> None:
    """DeepSpeed reads its launcher's variables: a Ray GPU actor sees one device (index 0);
    emulated CPU devices of one group share a host."""
    if not torch.distributed.is_initialized():  # a group of one rank: DeepSpeed still wants a
        torch.distributed.init_process_group(  # process group (else it looks for MPI)
            "gloo" if cpu else "nccl", store=torch.distributed.HashStore(), rank=0, world_size=1
        )
    rank = torch.distributed.get_rank()
    os.environ.setdefault("LOCAL_RANK", str(rank) if cpu else "0")
    os.environ.setdefault("LOCAL_SIZE", str(dp) if cpu else "1")
