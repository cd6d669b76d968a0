"""Training with DeepSpeed ZeRO, in the role-group actor's own process.

The rank's ``ShardedModel`` (tp = pp = 1: the whole model) is handed to ``deepspeed.initialize``
with the role's AdamW settings; the forward stays rayhf's (so the algorithms, generation and
inference calls on the same ranks run unchanged) and DeepSpeed owns backward, the gradient
reduction over the data-parallel ranks, clipping and the optimizer step:

    stage 1   optimizer state split over the dp ranks
    stage 2   + gradients split (reduce-scatter instead of all-reduce)
    stage 3   + parameters split: each dp rank keeps a flat 1/dp slice of every parameter
              (``param.ds_tensor``); forward and backward gather them for the moment they run

The role group's process group is the dp group (DeepSpeed takes torch.distributed's world), gloo
on CPU and NCCL on GPU. Weights leave a ZeRO-3 group as its flat slices: reallocation plans from
that layout (``rayhf.realloc.plan``, ``src_flat``), so no rank ever gathers the whole model to send.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from rayhf.engines.torch_engine import OptimizerConfig, TorchEngine
from rayhf.errors import RayhfError
from rayhf.parallel.attention import TokenLayout

DEEPSPEED_EXTRA = "pip install 'rayhf[deepspeed]'"


def import_deepspeed() -> Any:
    """The ``deepspeed`` module, or a one-line error naming the extra to install."""
    os.environ.setdefault("DS_BUILD_OPS", "0")  # nothing to compile at import
    try:
        import deepspeed
    except ImportError as e:
        msg = f"engine 'deepspeed' needs DeepSpeed, which is not installed: {DEEPSPEED_EXTRA}"
        raise RayhfError(msg) from e
    return deepspeed


def ds_config(optim: OptimizerConfig, zero_stage: int, offload: bool) -> dict[str, Any]:
    """DeepSpeed's config for one train call: fp32, one micro-batch per step (rayhf cuts the
    minibatches itself), AdamW from torch (no CPU-Adam build), ZeRO ``zero_stage``."""
    zero: dict[str, Any] = {"stage": zero_stage}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
        if zero_stage == 3:
            zero["offload_param"] = {"device": "cpu"}
    return {
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


class DeepSpeedEngine(TorchEngine):
    """A ``TorchEngine`` whose train step is DeepSpeed's (``engine: deepspeed``)."""

    def __init__(self, *args: Any, zero_stage: int = 2, offload: bool = False, **kw: Any) -> None:
        self.zero_stage, self.offload = zero_stage, offload
        self.ds: Any = None
        super().__init__(*args, **kw)

    def _make_optimizer(self, cfg: OptimizerConfig) -> torch.optim.Optimizer:
        assert self.model is not None
        assert self.groups.tp == 1 and self.groups.pp == 1, "DeepSpeed ranks hold whole models"
        deepspeed = import_deepspeed()
        # DeepSpeed reads its launcher's variables: a Ray GPU actor sees one device (index 0);
        # emulated CPU devices of one group share a host (its shared-memory all-reduce)
        cpu = self.model.device.type == "cpu"
        if not torch.distributed.is_initialized():  # a group of one rank: DeepSpeed still
            torch.distributed.init_process_group(  # wants a process group (else it looks for MPI)
                "gloo" if cpu else "nccl", store=torch.distributed.HashStore(), rank=0, world_size=1
            )
        rank = torch.distributed.get_rank()
        world = self.groups.dp
        os.environ.setdefault("LOCAL_RANK", str(rank) if cpu else "0")
        os.environ.setdefault("LOCAL_SIZE", str(world) if cpu else "1")
        config = ds_config(cfg, self.zero_stage, self.offload)
        params = list(self.model.parameters())
        self.ds, optimizer, _, _ = deepspeed.initialize(
            model=self.model, model_parameters=params, config=config
        )
        return optimizer

    @property
    def zero3(self) -> bool:
        return self.ds is not None and self.zero_stage == 3

    def train(self, minibatches, loss_fn) -> dict[str, float]:
        """One DeepSpeed step per minibatch; a rank without samples in one backpropagates a
        zero loss so the gradient reduction lines up."""
        assert self.model is not None and self.ds is not None, "train on a frozen role"
        self.model.train(True)
        totals: dict[str, float] = {}
        try:
            for mb in minibatches:
                if mb.n_samples > 0:
                    loss, stats = loss_fn(mb)
                    for k, v in stats.items():
                        totals[k] = totals.get(k, 0.0) + v / len(minibatches)
                else:
                    loss = self._zero_loss()
                self.ds.backward(loss)
                self.ds.step()
                norm = float(self.ds.get_global_grad_norm() or 0.0)
                totals["grad_norm"] = totals.get("grad_norm", 0.0) + norm / len(minibatches)
            self.weights_changed()
        finally:
            self.model.train(False)
        return self.all_reduce_mean(totals)

    def _zero_loss(self) -> torch.Tensor:
        assert self.model is not None
        ids = torch.full((1,), self.pad_id, dtype=torch.long, device=self.model.device)
        return self.model(ids, TokenLayout.packed([1])).sum() * 0.0

    def weights_loaded(self) -> None:
        """Weights written into the module from outside become the optimizer's master copy."""
        if self.zero3:
            raise RuntimeError("a ZeRO-3 role group sends its weights; it does not receive them")
        super().weights_loaded()
        if self.ds is not None:
            self.ds.optimizer.refresh_fp32_params()

    def source_shards(self) -> dict[str, torch.Tensor]:
        """ZeRO-3: this rank's flat slice of every parameter; otherwise the whole parameters."""
        assert self.model is not None
        if not self.zero3:
            return super().source_shards()
        return {name: getattr(p, "ds_tensor") for name, p in self.model.local_state().items()}  # noqa: B009

    @property
    def gathers_over_dp(self) -> bool:
        return self.zero3

    def full_state(self) -> dict[str, torch.Tensor]:
        """ZeRO-3 gathers every parameter over the dp ranks (all of them call)."""
        if not self.zero3:
            return super().full_state()
        assert self.model is not None
        deepspeed = import_deepspeed()
        with deepspeed.zero.GatheredParameters(list(self.model.parameters())):
            return {k: v.clone() for k, v in super().full_state().items()}

    def local_bytes(self) -> int:
        if not self.zero3:
            return super().local_bytes()
        return sum(t.numel() * t.element_size() for t in self.source_shards().values())

    def save_optimizer(self, path: str) -> dict[str, Any]:
        """DeepSpeed's own checkpoint (optimizer partitions per rank) under ``path``; every dp
        rank calls."""
        self.ds.save_checkpoint(path, tag="deepspeed", save_latest=False)
        return {"deepspeed_tag": "deepspeed"}

    def load_optimizer(self, path: str, state: dict[str, Any]) -> None:
        self.ds.load_checkpoint(path, tag=state["deepspeed_tag"], load_module_strict=True)
