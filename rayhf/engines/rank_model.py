"""One rank's piece of a role's model: its pipeline stage and tensor-parallel shards, and what
can be done with them without an optimizer.

    Hugging Face state dict --take this rank's shards--> ShardedModel (+ Pipeline over pp)
      forward:   right-padded rows -> packed -> pipeline -> logits/values, padded again
      weights:   full_state (tensors gathered over tp and pp), load_full_state, save_pretrained
                 (safetensors and the driver's JSON: ``rayhf.models.files``)
      moves:     source_shards / receive_buffers / received  (rayhf.realloc's ShardSource and
                 ShardSink: what reallocation reads and fills)

``version`` counts weight changes (a train step, a reallocation), so a generator that keeps its
own copy of the weights (vLLM) knows when to reload.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from rayhf.models.files import ModelFiles, write_model
from rayhf.models.lora import adapted
from rayhf.models.precision import Numerics
from rayhf.models.sharding import embedding_name, param_shards, take_shard
from rayhf.models.spec import Lora
from rayhf.parallel.gather import gather_whole
from rayhf.parallel.groups import ParallelGroups, single
from rayhf.parallel.model import ShardedModel
from rayhf.parallel.pipeline import Pipeline
from rayhf.parallel.turns import FORWARD, Turns


class RankModel:
    """This rank's shards of a Hugging Face model (``full`` None: zeros that a reallocation
    fills) and the pipeline that runs them; ``files`` gives its shape and saved form."""

    def __init__(
        self,
        files: ModelFiles,
        full: Mapping[str, torch.Tensor] | None,
        tokenizer: Any,
        groups: ParallelGroups | None = None,
        n_microbatches: int = 1,
        device: str = "cpu",
        checkpointing: bool = False,
        numerics: Numerics | None = None,
    ) -> None:
        self.files, self.spec, self.tokenizer = files, files.spec, tokenizer
        self.groups = groups or single()
        self.numerics = numerics or Numerics()
        self.module = ShardedModel(self.spec, self.groups, full, self.numerics).to(device)
        self.module.checkpointing = checkpointing  # recompute each layer in backward
        self.module.train(False)
        self.pipe = Pipeline(self.module, self.groups, n_microbatches)
        self.turns = Turns(
            self.groups.ep_group, torch.device(device), self._idle_forward, self._idle_backward
        )

    @classmethod
    def from_hf(
        cls, model: Any, tokenizer: Any, value_head: bool, lora: Lora | None = None, **kw: Any
    ) -> RankModel:
        """This rank's shards of a whole Hugging Face model, with ``lora``'s adapters (fresh)
        beside its weights (``kw``: groups, n_microbatches, device, checkpointing, numerics)."""
        from rayhf.models.hf import model_files

        files = adapted(model_files(model.config, value_head), lora)
        return cls(files, model.state_dict(), tokenizer, **kw)

    @property
    def device(self) -> torch.device:
        return self.module.device

    @property
    def pad_id(self) -> int:
        return int(self.tokenizer.pad_token_id)

    @property
    def eos_id(self) -> int:
        return int(self.tokenizer.eos_token_id)

    @property
    def version(self) -> int:
        """Bumped whenever the weights change."""
        return self.module.version

    def changed(self) -> None:
        """The weights changed in place (a train step)."""
        self.module.version += 1

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, T, V]`` (LM) or values ``[B, T]`` (value head) of right-padded rows.

        Rows are packed (padding dropped) for the model; padded positions of the result are 0.
        """
        return self._packed(input_ids, attention_mask)

    def score(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        targets: torch.Tensor,
        temperature: float = 1.0,
        routes: torch.Tensor | None = None,
        replay: bool = False,
    ) -> torch.Tensor:
        """``[B, T, 2]``: at each position with a target id (``targets[b, t] >= 0``, the token
        it predicts), the target's log-probability under ``softmax(logits / temperature)`` and
        the distribution's entropy; 0 elsewhere. The LM head runs in slices, so no
        ``[B, T, V]`` logits are made (``ShardedModel.score``). ``routes [B, T, L, k]``: a
        generator's expert choices per token (-1: none), compared with the router's in
        training (``ShardedModel.take_route_checks``) and, with ``replay``, followed."""
        return self._packed(input_ids, attention_mask, targets, temperature, routes, replay)

    def _packed(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        targets: torch.Tensor | None = None,
        temperature: float = 1.0,
        routes: torch.Tensor | None = None,
        replay: bool = False,
    ) -> torch.Tensor:
        """The pipeline over the rows packed (padding dropped), its output padded back with 0."""
        keep = attention_mask.to(self.device).bool()
        lengths = keep.sum(dim=1).tolist()
        packed = None if targets is None else targets.to(self.device)[keep]
        given = None if routes is None else routes.to(self.device)[keep]
        self.turns.take(FORWARD)
        out = self.pipe.forward(
            input_ids.to(self.device)[keep], lengths, packed, temperature, given, replay
        )
        if len(out) == input_ids.numel():  # no padding: the rows, token by token
            return out.view(*input_ids.shape, *out.shape[1:])
        padded = out.new_zeros(*input_ids.shape, *out.shape[1:])
        return padded.index_put((keep.nonzero(as_tuple=True)), out)

    def _idle_forward(self) -> torch.Tensor:
        """A forward of no tokens, beside the ep group's other ranks' (``Turns.drain``)."""
        empty = torch.zeros(0, dtype=torch.long, device=self.device)
        with torch.enable_grad():
            return self.pipe.forward(empty, [], empty)

    def _idle_backward(self, outputs: list[torch.Tensor]) -> None:
        """The backward of idle forwards, as a train step runs its loss's (``Turns.drain``)."""
        kept = [out for out in outputs if out.requires_grad]
        if kept:
            torch.autograd.backward([out.sum() * 0 for out in kept])
        self.pipe.backward_pending()

    def ep_drain(self) -> None:
        """This rank ran its passes: serve its ep group's others until they have too."""
        self.turns.drain()

    def source_shards(self) -> dict[str, torch.Tensor]:
        """What this rank sends when its role's weights move to another layout."""
        return self.module.local_state()

    def receive_buffers(self) -> dict[str, torch.Tensor]:
        """This rank's shards, with storage again if they were released, for a move to fill."""
        self.module.allocate()
        return self.module.local_state()

    def received(self) -> None:
        """A move filled the shards."""
        self.changed()

    def release(self) -> None:
        """Drop the weights' memory until the next move refills them (a copy's)."""
        self.module.release()

    def local_bytes(self) -> int:
        """Bytes of the parameters this rank holds."""
        return sum(p.numel() * p.element_size() for p in self.module.parameters())

    def digest(self) -> float:
        """Sum of |w| over this rank's parameters: a cheap fingerprint for tests and logs."""
        return float(sum(p.detach().abs().sum() for p in self.module.parameters()))

    def full_state(self) -> dict[str, torch.Tensor]:
        """The whole model's Hugging Face state dict on the CPU, gathered as tensors over this
        replica's tp and pp ranks (a collective: every rank of the replica calls it)."""
        local = {k: v.detach() for k, v in self.module.local_state().items()}
        every = {p.name: p for p in param_shards(self.spec)}
        whole = gather_whole(local, every, self.groups)
        full = {k: v.cpu() for k, v in whole.items()}
        if self.spec.tied:
            full["lm_head.weight"] = full[embedding_name(self.spec)]
        return full

    def load_full_state(self, full: Mapping[str, torch.Tensor]) -> int:
        """Keep this rank's shards of a whole-model state dict; returns the bytes kept."""
        c, kept = self.groups.coords, 0
        with torch.no_grad():
            for name, p in self.receive_buffers().items():
                shard = take_shard(full[name], self.module.shards[name], self.groups.tp, c.tp_rank)
                p.copy_(shard)  # cast to the weights' dtype
                kept += p.numel() * p.element_size()
        self.received()
        return kept

    def save_pretrained(
        self, out_dir: str | Path, full: Mapping[str, torch.Tensor] | None = None
    ) -> None:
        """Write the whole model (``full``, else gathered now: a collective) in Hugging Face
        format with its tokenizer; the head rank of replica 0 writes."""
        full = self.full_state() if full is None else full
        if not self.groups.is_head or self.groups.coords.dp_rank != 0:
            return
        write_model(out_dir, self.files, full)
        self.tokenizer.save_pretrained(out_dir)
