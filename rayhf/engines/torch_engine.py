"""The torch training/inference engine of one role-group rank.

It owns the model, the optimizer and the rank's data-parallel process group. Algorithms see it
through ``rayhf.algorithms.interface.ModelEngine``: forward passes, generation, and ``train`` over
minibatches, where every rank takes the same number of optimizer steps and gradients are
all-reduced (mean) across the data-parallel group before each step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from pydantic import BaseModel, ConfigDict, Field
from transformers import PreTrainedModel

from rayhf.data.batch import PackedBatch
from rayhf.engines.native import GenerateOutput, GenerationConfig, generate
from rayhf.models.hf import per_token_values

LossFn = Callable[[PackedBatch], tuple[torch.Tensor, dict[str, float]]]


class OptimizerConfig(BaseModel):
    """AdamW settings of a trainable role."""

    model_config = ConfigDict(extra="forbid")

    lr: float = Field(1e-4, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = Field(1e-8, gt=0)
    grad_clip: float = Field(1.0, gt=0)  # max global grad norm


class TorchEngine:
    """Model + optimizer of one rank; ``dp_group`` is None when the role has one replica."""

    def __init__(
        self,
        model: PreTrainedModel | None,
        tokenizer,
        value_head: bool,
        optimizer: OptimizerConfig | None,
        dp_group: dist.ProcessGroup | None = None,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.value_head = value_head
        self.dp_group = dp_group
        self.optim_cfg = optimizer
        self.optimizer: torch.optim.Optimizer | None = None
        if model is not None and optimizer is not None:
            self.optimizer = torch.optim.AdamW(
                model.parameters(),
                lr=optimizer.lr,
                betas=optimizer.betas,
                eps=optimizer.eps,
                weight_decay=optimizer.weight_decay,
            )
        if model is not None:
            model.train(False)

    @property
    def pad_id(self) -> int:
        return int(self.tokenizer.pad_token_id)

    @property
    def eos_id(self) -> int:
        return int(self.tokenizer.eos_token_id)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, T, V]`` (LM) or values ``[B, T]`` (value head)."""
        assert self.model is not None, "forward on a role without a model"
        if self.value_head:
            return per_token_values(self.model, input_ids, attention_mask)
        return self.model(input_ids=input_ids, attention_mask=attention_mask).logits

    def generate(
        self, prompts: list[list[int]], cfg: GenerationConfig, seed: int
    ) -> GenerateOutput:
        assert self.model is not None, "generate on a role without a model"
        gen = torch.Generator().manual_seed(seed)
        return generate(self.model, prompts, cfg, self.eos_id, self.pad_id, gen)

    def train(self, minibatches: Sequence[PackedBatch], loss_fn: LossFn) -> dict[str, float]:
        """One optimizer step per minibatch; returns the mean of each stat over minibatches.

        ``minibatches`` has the same length on every dp rank (a rank with no samples for one
        passes an empty batch and contributes zero gradient), so the all-reduces line up.
        """
        assert self.model is not None and self.optimizer is not None, "train on a frozen role"
        self.model.train(True)
        totals: dict[str, float] = {}
        for mb in minibatches:
            self.optimizer.zero_grad(set_to_none=False)
            if mb.n_samples > 0:
                loss, stats = loss_fn(mb)
                loss.backward()
                for k, v in stats.items():
                    totals[k] = totals.get(k, 0.0) + v / len(minibatches)
            self._all_reduce_grads()
            assert self.optim_cfg is not None
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.optim_cfg.grad_clip)
            totals["grad_norm"] = totals.get("grad_norm", 0.0) + float(norm) / len(minibatches)
            self.optimizer.step()
        self.model.train(False)
        return self.all_reduce_mean(totals)

    def _all_reduce_grads(self) -> None:
        if self.dp_group is None:
            return
        assert self.model is not None
        for p in self.model.parameters():
            if p.grad is None:  # a rank whose minibatch was empty still joins the all-reduce
                p.grad = torch.zeros_like(p)
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.dp_group)
        flat /= dist.get_world_size(self.dp_group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()

    def all_reduce_mean(self, values: dict[str, float]) -> dict[str, float]:
        """Mean of each value over the dp ranks (identity with one replica)."""
        if self.dp_group is None or not values:
            return dict(values)
        keys = sorted(values)
        t = torch.tensor([values[k] for k in keys], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.dp_group)
        t /= dist.get_world_size(self.dp_group)
        return dict(zip(keys, t.tolist(), strict=True))

    def all_gather_object(self, obj: object) -> list[object]:
        """``obj`` from every dp rank, in rank order."""
        if self.dp_group is None:
            return [obj]
        out: list[object] = [None] * dist.get_world_size(self.dp_group)
        dist.all_gather_object(out, obj, group=self.dp_group)
        return out

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.dp_group is not None:
            t = t.clone()
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.dp_group)
        return t
