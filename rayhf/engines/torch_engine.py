"""The torch training/inference engine of one rank of a role group.

It holds this rank's piece of the model (``rayhf.parallel.ShardedModel``: its pipeline stage,
its tensor-parallel shards), the optimizer over that piece, and the rank's process groups.
Algorithms see it through ``rayhf.algorithms.interface.ModelEngine``: padded forward passes
(packed inside), generation, and ``train`` over minibatches. Every rank of a data-parallel
replica runs the same algorithm code on the same batch and gets the same outputs; gradients are
averaged over the replicas before each optimizer step, and the clipping norm is taken over the
whole model (all tp shards, all pp stages).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from pydantic import BaseModel, ConfigDict, Field
from transformers import PreTrainedModel

from rayhf.data.batch import PackedBatch
from rayhf.engines.native import GenerateOutput, GenerationConfig
from rayhf.models.sharding import embedding_name, join_shards, take_shard
from rayhf.models.spec import model_spec
from rayhf.parallel.generate import generate
from rayhf.parallel.groups import ParallelGroups, single
from rayhf.parallel.model import ShardedModel
from rayhf.parallel.pipeline import Pipeline

LossFn = Callable[[PackedBatch], tuple[torch.Tensor, dict[str, float]]]


class OptimizerConfig(BaseModel):
    """AdamW settings of a trainable role."""

    model_config = ConfigDict(extra="forbid")

    lr: float = Field(1e-4, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = Field(1e-8, gt=0)
    grad_clip: float = Field(1.0, gt=0)  # max global grad norm
    zero1: bool = False  # shard optimizer state over the data-parallel replicas (ZeRO stage 1)


class TorchEngine:
    """This rank's model piece + optimizer; ``model`` is None for a function-valued role."""

    def __init__(
        self,
        model: PreTrainedModel | None,
        tokenizer,
        value_head: bool,
        optimizer: OptimizerConfig | None,
        groups: ParallelGroups | None = None,
        n_mbs: int = 1,
        device: str = "cpu",
    ) -> None:
        self.tokenizer = tokenizer
        self.value_head = value_head
        self.groups = groups or single()
        self.optim_cfg = optimizer
        self.optimizer: torch.optim.Optimizer | None = None
        self.model: ShardedModel | None = None
        self.hf_config = None
        self.vllm: Any = None  # a VllmGenerator when this rank's generate calls use vLLM
        self.weights_version = 0  # bumped whenever the weights change (vLLM reloads lazily)
        self._vllm_version = -1
        if model is None:
            return
        self._shard(model.config, model.state_dict(), n_mbs, device)

    def _shard(self, hf_config, full: dict[str, torch.Tensor] | None, n_mbs: int, device: str):
        self.hf_config = hf_config
        spec = model_spec(hf_config, self.value_head)
        self.model = ShardedModel(spec, self.groups, full).to(device)
        self.model.train(False)
        self.pipe = Pipeline(self.model, self.groups, n_mbs)
        if self.optim_cfg is not None:
            self.optimizer = self._make_optimizer(self.optim_cfg)

    def _make_optimizer(self, cfg: OptimizerConfig) -> torch.optim.Optimizer:
        assert self.model is not None
        return _make_optimizer(self.model, cfg, self.groups)

    def init_empty(self, hf_config, n_mbs: int = 1, device: str = "cpu") -> None:
        """Hold zeros in this rank's shards of ``hf_config``'s model (reallocation fills them)."""
        self._shard(hf_config, None, n_mbs, device)

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        return self.groups.dp_group

    @property
    def pad_id(self) -> int:
        return int(self.tokenizer.pad_token_id)

    @property
    def eos_id(self) -> int:
        return int(self.tokenizer.eos_token_id)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, T, V]`` (LM) or values ``[B, T]`` (value head) of right-padded rows.

        Rows are packed (padding dropped) for the model; padded positions of the result are 0.
        """
        assert self.model is not None, "forward on a role without a model"
        device = self.model.device
        keep = attention_mask.to(device).bool()
        lengths = keep.sum(dim=1).tolist()
        out = self.pipe.forward(input_ids.to(device)[keep], lengths)
        padded = out.new_zeros(*input_ids.shape, *out.shape[1:])
        return padded.index_put((keep.nonzero(as_tuple=True)), out)

    def generate(
        self, prompts: list[list[int]], cfg: GenerationConfig, seed: int
    ) -> GenerateOutput:
        assert self.model is not None, "generate on a role without a model"
        if self.vllm is not None:
            return self._generate_vllm(prompts, cfg, seed)
        gen = torch.Generator().manual_seed(seed)
        return generate(self.pipe, prompts, cfg, self.eos_id, self.pad_id, gen)

    def use_vllm(self, seed: int, colocated: bool) -> None:
        """Generate with vLLM from now on (this rank must hold the whole model: tp=1, pp=1);
        ``colocated``: the rank also trains, so vLLM sleeps between its generate calls."""
        from rayhf.engines.vllm_engine import VllmGenerator

        assert self.model is not None and self.hf_config is not None
        assert self.groups.tp == 1 and self.groups.pp == 1, "vLLM ranks hold whole models"
        max_len = int(getattr(self.hf_config, "max_position_embeddings", 2048))
        self.vllm = VllmGenerator(self.hf_config, max_len, seed, sleeps=colocated)

    def weights_changed(self) -> None:
        self.weights_version += 1

    def weights_loaded(self) -> None:
        """New weights were written into this rank's shards from outside (a reallocation)."""
        self.weights_changed()

    def source_shards(self) -> dict[str, torch.Tensor]:
        """What this rank sends when its role's weights move to another layout."""
        assert self.model is not None
        return self.model.local_state()

    def sync_vllm(self) -> float:
        """Reload vLLM's weights from this rank's model if they changed; returns seconds."""
        if self.vllm is None or self._vllm_version == self.weights_version:
            return 0.0
        began = time.perf_counter()
        self.vllm.load_weights(self.full_state().items())
        self._vllm_version = self.weights_version
        return time.perf_counter() - began

    def _generate_vllm(
        self, prompts: list[list[int]], cfg: GenerationConfig, seed: int
    ) -> GenerateOutput:
        """vLLM samples the tokens; the log-probs come from this rank's own forward (the
        training forward), as the native engine's do: of ``logits / temperature``, unfiltered."""
        from rayhf.engines.vllm_engine import with_logprobs

        self.sync_vllm()
        tokens = self.vllm.generate(prompts, cfg, self.eos_id, seed)
        rows = [p + t for p, t in zip(prompts, tokens, strict=True)]
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros(len(rows), width, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, : len(r)] = torch.tensor(r)
            mask[i, : len(r)] = 1
        with torch.no_grad():
            logits = self.forward(ids, mask).float()
        if not cfg.greedy:
            logits = logits / cfg.temperature
        logp = logits.log_softmax(dim=-1)
        out = []
        for i, (p, t) in enumerate(zip(prompts, tokens, strict=True)):
            pos = torch.arange(len(p) - 1, len(p) - 1 + len(t))
            out.append(logp[i, pos, torch.tensor(t, dtype=torch.long)].tolist())
        return with_logprobs(tokens, out, self.eos_id)

    def train(self, minibatches: Sequence[PackedBatch], loss_fn: LossFn) -> dict[str, float]:
        """One optimizer step per minibatch; returns the mean of each stat over minibatches.

        ``minibatches`` has the same length on every dp rank (a rank with no samples for one
        passes an empty batch and contributes zero gradient), so the all-reduces line up.
        """
        assert self.model is not None and self.optimizer is not None, "train on a frozen role"
        assert self.optim_cfg is not None
        self.model.train(True)
        self.pipe.record = True
        totals: dict[str, float] = {}
        try:
            for mb in minibatches:
                self.optimizer.zero_grad(set_to_none=False)
                if mb.n_samples > 0:
                    loss, stats = loss_fn(mb)
                    loss.backward()
                    self.pipe.backward_pending()
                    for k, v in stats.items():
                        totals[k] = totals.get(k, 0.0) + v / len(minibatches)
                self._all_reduce_grads()
                norm = self._clip_grads(self.optim_cfg.grad_clip)
                totals["grad_norm"] = totals.get("grad_norm", 0.0) + norm / len(minibatches)
                self.optimizer.step()
            self.weights_changed()
        finally:
            self.pipe.record = False
            self.pipe.pending.clear()
            self.model.train(False)
        return self.all_reduce_mean(totals)

    def _all_reduce_grads(self) -> None:
        """Average gradients over the data-parallel replicas (one flat all-reduce)."""
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

    def _clip_grads(self, max_norm: float) -> float:
        """Scale gradients so the whole model's gradient norm is at most ``max_norm``.

        A tp-replicated parameter has the same gradient on every tp rank, so it is counted once.
        """
        assert self.model is not None
        sharded = torch.zeros((), dtype=torch.float32)
        replicated = torch.zeros((), dtype=torch.float32)
        params = dict(self.model.local_state())
        for name, p in params.items():
            if p.grad is None:
                continue
            sq = p.grad.detach().float().pow(2).sum()
            if self.model.shards[name].tp_dim is None or self.groups.tp == 1:
                replicated += sq
            else:
                sharded += sq
        if self.groups.tp_group is not None:
            dist.all_reduce(sharded, group=self.groups.tp_group)
        total = sharded + replicated
        if self.groups.pp_group is not None:
            dist.all_reduce(total, group=self.groups.pp_group)
        norm = float(total.sqrt())
        coef = min(1.0, max_norm / (norm + 1e-6))
        if coef < 1.0:
            for p in params.values():
                if p.grad is not None:
                    p.grad.mul_(coef)
        return norm

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

    def local_bytes(self) -> int:
        """Bytes of the parameters this rank holds."""
        assert self.model is not None
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    def full_state(self) -> dict[str, torch.Tensor]:
        """The whole model's Hugging Face state dict, gathered over this replica's tp and pp
        ranks (a collective: every rank of the replica calls it)."""
        assert self.model is not None
        local = {k: v.detach().cpu() for k, v in self.model.local_state().items()}
        stage = local
        if self.groups.tp_group is not None:
            parts: list = [None] * self.groups.tp
            dist.all_gather_object(parts, local, group=self.groups.tp_group)
            stage = {k: join_shards([p[k] for p in parts], self.model.shards[k]) for k in local}
        full = dict(stage)
        if self.groups.pp_group is not None:
            stages: list = [None] * self.groups.pp
            dist.all_gather_object(stages, stage, group=self.groups.pp_group)
            full = {k: v for s in stages for k, v in s.items()}
        if self.model.spec.tied:
            full["lm_head.weight"] = full[embedding_name(self.model.spec)]
        return full

    def load_full_state(self, full: dict[str, torch.Tensor]) -> int:
        """Keep this rank's shards of a whole-model state dict; returns the bytes kept."""
        assert self.model is not None
        c, kept = self.groups.coords, 0
        with torch.no_grad():
            for name, p in self.model.local_state().items():
                shard = take_shard(full[name], self.model.shards[name], self.groups.tp, c.tp_rank)
                p.copy_(shard)
                kept += shard.numel() * shard.element_size()
        self.weights_loaded()
        return kept

    @property
    def gathers_over_dp(self) -> bool:
        """Whether ``full_state`` is a collective over the dp replicas too (no replica holds
        the whole model: ZeRO-3)."""
        return False

    def save_optimizer(self, path: str) -> dict[str, Any]:
        """This rank's optimizer state, to store in the rank's checkpoint file."""
        assert self.optimizer is not None
        return getattr(self.optimizer, "optim", self.optimizer).state_dict()  # ZeRO-1: its part

    def load_optimizer(self, path: str, state: dict[str, Any]) -> None:
        assert self.optimizer is not None
        getattr(self.optimizer, "optim", self.optimizer).load_state_dict(state)

    def save_pretrained(self, out_dir: str | Path) -> None:
        """Write the whole model in Hugging Face format (collective; the head rank of replica
        0 writes)."""
        from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

        full = self.full_state()
        if not self.groups.is_head or self.groups.coords.dp_rank != 0:
            return
        cls = AutoModelForSequenceClassification if self.value_head else AutoModelForCausalLM
        hf = cls.from_config(self.hf_config)
        hf.load_state_dict(full, strict=True)
        hf.save_pretrained(out_dir)
        self.tokenizer.save_pretrained(out_dir)


def _make_optimizer(
    model: torch.nn.Module, cfg: OptimizerConfig, groups: ParallelGroups
) -> torch.optim.Optimizer:
    kwargs: dict[str, Any] = {
        "lr": cfg.lr,
        "betas": cfg.betas,
        "eps": cfg.eps,
        "weight_decay": cfg.weight_decay,
    }
    if cfg.zero1 and groups.dp_group is not None:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(
            list(model.parameters()),
            optimizer_class=torch.optim.AdamW,
            process_group=groups.dp_group,
            **kwargs,
        )
    return torch.optim.AdamW(model.parameters(), **kwargs)
