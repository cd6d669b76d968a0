"""The Ray actor that holds one rank of one role group.

Its remote surface is small and typed: ``setup`` joins the role group's process groups and
shards the model for the layout, ``run`` executes one call through the call's interface,
``realloc_send``/``realloc_recv`` move weight slices to and from other role groups
(``get_weights``/``set_weights`` are the whole-model path), ``save``/``load_optimizer`` serve
checkpoints. ``dag_call``/``dag_send``/``dag_recv`` are the same as nodes of a step's DAG.
Every kind of call gets its data-parallel replica's token-balanced share of the batch (each tp
and pp rank of a replica the same share); the replica's head rank returns the outputs, and train
stats are already all-reduced over the replicas.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Sequence
from dataclasses import fields
from typing import Any

import torch
import torch.distributed as dist

from rayhf.algorithms import CallContext
from rayhf.algorithms.interface import VERSION_EXTRA, Interface
from rayhf.data.batch import PackedBatch
from rayhf.engines.build import make_generators, make_trainer
from rayhf.engines.call import CallEngine, Generator, RankTrainer, whole_state
from rayhf.engines.collectives import DataParallel
from rayhf.engines.rank_model import RankModel
from rayhf.engines.schedule import step_to
from rayhf.engines.torch_trainer import LossFn, Weight, response_tokens
from rayhf.metrics.memory import peak_bytes, reset_peak
from rayhf.models.files import TokenizerDir, quiet_transformers, read_weights
from rayhf.models.precision import DTYPES
from rayhf.parallel.groups import ParallelGroups, build_groups, host_store, join_store, single
from rayhf.parallel.lora import dropout_seeded
from rayhf.realloc.plan import Transfer
from rayhf.realloc.transport import (
    ShardSource,
    TransferGroup,
    copy_into,
    ema_into,
    receive_into,
    send_from,
)
from rayhf.runtime.flow import (
    assemble,
    call_inputs,
    rename_outputs,
    replica_share,
    share_balance,
)
from rayhf.runtime.messages import (
    CallNode,
    CallRequest,
    CallResult,
    MoveNode,
    MoveResult,
    StepInput,
    WeightsSummary,
    WorkerSpec,
)


def _first_weights(spec: WorkerSpec) -> dict[str, torch.Tensor] | None:
    """A model role's full state dict, read from ``model_dir``; None when its weights arrive by
    reallocation (zeros until then) or it has no model."""
    if spec.model is None or spec.model_dir is None:
        return None
    state = read_weights(spec.model_dir, spec.model.spec)
    if state is None:  # not all in safetensors under their names: the model is built to be read
        from rayhf.models.hf import load_model

        quiet_transformers()  # no per-file progress bars in the worker's log, as before
        state = load_model(spec.model_dir, spec.value_head, f"models.{spec.role}").state_dict()
    if spec.adapter_dir is not None:  # LoRA adapters (and the modules they train in full)
        from rayhf.models.lora import read_adapter

        state |= read_adapter(spec.adapter_dir)
    return state


class NonFiniteDrill(CallEngine):
    """A call's engine whose train losses are all multiplied by NaN (``fault_tolerance.inject``
    at site ``nonfinite``): every gradient it makes is not finite."""

    def train(
        self, minibatches: Sequence[PackedBatch], loss_fn: LossFn, weight: Weight = response_tokens
    ) -> dict[str, float]:
        def poisoned(mb: PackedBatch) -> tuple[torch.Tensor, dict[str, float]]:
            loss, stats = loss_fn(mb)
            return loss * float("nan"), stats

        return super().train(minibatches, poisoned, weight)


def optim_file(optim_dir: str, role: str, rank: int) -> str:
    return os.path.join(optim_dir, f"{role}.rank{rank}.pt")


class RoleWorker:
    """One rank: its model, its trainer, one generator per generate call, and one interface
    instance per interface name."""

    def __init__(self, spec: WorkerSpec) -> None:
        torch.set_num_threads(spec.threads)
        os.environ["OMP_NUM_THREADS"] = str(spec.threads)
        self.spec = spec
        self._weights = _first_weights(spec)  # until ``setup`` keeps this rank's shards
        self.tokenizer = TokenizerDir(spec.tokenizer_dir, **spec.special_ids)
        self.groups: ParallelGroups = single()
        self.model: RankModel | None = None
        self.trainer: RankTrainer | None = None
        self.generators: dict[str, Generator] = {}
        self.transfer_groups: dict[str, TransferGroup] = {}
        self.hosted: dict[str, dist.TCPStore] = {}  # rendezvous stores this rank opened, by address
        self.calls = {c.name: c for c in spec.calls}
        self.version = spec.version  # the step whose update made this rank's weights
        self.interfaces = {c.interface: c.interface_type(spec.settings) for c in spec.calls}
        # what reads text loads its tokenizer now, while the other ranks start, not in a step:
        # an env or a judge the whole one (chat templates), a reward function its decoder (read
        # here) or, where the decoder would differ, the whole one
        templates = any(i.needs_env or i.needs_judge for i in self.interfaces.values())
        if templates or (spec.model is None and self.tokenizer.decoder is None):
            self.tokenizer.loaded  # noqa: B018

    def rendezvous_address(self) -> str:
        """``tcp://ip:port`` of a store this rank opens on its node, for a group's rendezvous
        (its rank 0 calls it; the store already listens)."""
        import ray

        store, address = host_store(ray.util.get_node_ip_address())
        self.hosted[address] = store
        return address

    def _store(self, address: str) -> dist.Store:
        """The rendezvous store at ``address``: the one this rank opened there, or a client."""
        return self.hosted.pop(address, None) or join_store(address)

    def _fault(self, site: str, step: int = 0) -> None:
        """Die at once (SIGKILL, no cleanup) if the injected fault names this site and step."""
        fault = self.spec.fault
        if fault is not None and fault.site == site and (site == "startup" or fault.step == step):
            os.kill(os.getpid(), signal.SIGKILL)

    def setup(self, address: str) -> None:
        """Join the role group's dp, tp and pp groups (gloo on CPU, NCCL on GPU), then keep
        this rank's shards of the model."""
        spec = self.spec
        self._fault("startup")
        world = spec.dp_size * spec.tp_size * spec.pp_size
        if world > 1:
            backend = "nccl" if spec.device.startswith("cuda") else "gloo"
            dist.init_process_group(
                backend, store=self._store(address), rank=spec.rank, world_size=world
            )
            self.groups = build_groups(
                spec.dp_size, spec.tp_size, spec.pp_size, spec.rank, ep=spec.ep_size,
                cp=spec.cp_size,
            )  # fmt: skip
        weights, self._weights = self._weights, None
        if spec.model is None:
            return  # a function-valued role
        self.model = RankModel(
            spec.model, weights, self.tokenizer,
            groups=self.groups, n_microbatches=spec.n_microbatches, device=spec.device,
            checkpointing=spec.activation_checkpointing, numerics=spec.numerics,
        )  # fmt: skip
        trainer = next((c for c in spec.calls if c.kind == "train"), None)
        if spec.optimizer is not None and trainer is not None:
            self.trainer = make_trainer(self.model, spec.optimizer, trainer.engine)
        gen_calls = {c.name: c.engine for c in spec.calls if c.kind == "generate"}
        self.generators = make_generators(self.model, gen_calls, spec.seed, trainer is not None)

    def _engine_for(self, call: str) -> CallEngine:
        """What ``call``'s interface runs on: the rank's model, that call's own generator, the
        role's trainer, and the reductions over the replicas."""
        comm = DataParallel(self.groups.dp_group)
        generator = self.generators.get(call)
        trainer = self.trainer if self.calls[call].kind == "train" else None
        budget = self.calls[call].engine.token_budget
        return CallEngine(self.tokenizer, self.model, comm, generator, trainer, budget)

    def run(self, req: CallRequest) -> CallResult:
        call = self.calls[req.call]
        interface = self.interfaces[call.interface]
        # a cp group's ranks share their rows: to the algorithm, one replica
        groups = self.groups
        ctx = CallContext(
            req.step, groups.batch_rank, groups.batch_groups, self.spec.seed, call.args
        )
        engine = self._engine_for(req.call)
        site = "eval" if req.evaluate else "call"
        if call.kind == "generate" and getattr(engine.generator, "stale", False):
            site = "sync"  # its generator loads new weights before it samples
        self._fault(site, req.step)
        if self.model is not None:
            reset_peak(self.model.device)
        start = time.perf_counter()
        batch, stats = None, {}
        if call.kind != "train" and req.batch.n_samples == 0:
            pass  # more dp ranks than samples: this rank has nothing to do
        elif call.kind == "generate":
            batch = interface.generate(engine, req.batch, ctx)
        elif call.kind == "inference":
            with self._model().module.base_weights() if call.base else contextlib.nullcontext():
                batch = interface.inference(engine, req.batch, ctx)
        elif req.evaluate:
            stats = interface.evaluate(engine, req.batch, ctx)
        else:
            stats = self._train(interface, engine, req, ctx)
        if self.model is not None and call.kind != "generate":
            self.model.ep_drain()  # the passes of its ep group's others, if they have more
        peak = peak_bytes(self.model.device) if self.model is not None else 0
        if self.model is not None and self.model.device.type == "cuda":
            # role groups colocated on a GPU are separate processes, each with its own caching
            # allocator: a call hands back what it cached, for the next call in another process
            torch.cuda.empty_cache()
        seconds = time.perf_counter() - start
        result = CallResult(req.call, self.spec.rank, batch, stats, seconds, engine.name)
        result.peak_bytes = peak
        return result

    def _train(
        self, interface: Interface, engine: CallEngine, req: CallRequest, ctx: CallContext
    ) -> dict[str, float]:
        """A train call at the step's learning rate (the role's schedule), logged per role."""
        opt = self.spec.optimizer
        assert self.trainer is not None and opt is not None, f"{req.call}: train a frozen role"
        total = opt.schedule.total_steps or req.step
        lr = step_to(self.trainer.optimizer, opt.schedule, opt.lr, req.step, total)
        fault = self.spec.fault
        if fault is not None and fault.site == "nonfinite" and req.step >= fault.step:
            engine = NonFiniteDrill(**{f.name: getattr(engine, f.name) for f in fields(engine)})
        module = self._model().module
        with dropout_seeded(module, self.spec.seed, req.step, self.groups.batch_rank):
            stats = interface.train_step(engine, req.batch, ctx)
        return {**stats, f"lr/{self.spec.role}": lr}

    def dag_call(self, step: StepInput, node: CallNode, *upstream: Any) -> CallResult:
        """A call as a node of the step's DAG: assemble the batch from the step input and the
        source calls' results among ``upstream`` (the rest only order this node), take this
        replica's share, run, and return the outputs under graph key names (head ranks only);
        results of another step among ``upstream`` only order this node too."""
        began, version = time.time(), self.version
        call = self.calls[node.call]
        outputs: dict[str, dict[int, PackedBatch]] = {s: {} for s in node.sources}
        for r in upstream:
            if isinstance(r, MoveResult) and r.sent and r.unit == f"realloc:{node.call}":
                version = r.version  # a copy holds the weights its move sent
            if not isinstance(r, CallResult) or r.step != step.step:
                continue  # it only orders this node
            if r.call in outputs and r.batch is not None:
                outputs[r.call][r.rank] = r.batch
        batch = assemble(
            step.batch, [(s, [b for _, b in sorted(outputs[s].items())]) for s in node.sources]
        )
        view = call_inputs(batch, call.inputs, call.name)
        keys = self.interfaces[call.interface].balance_keys
        shares = self.groups.batch_groups  # a cp group's ranks share their rows
        part = replica_share(view, shares, self.groups.batch_rank, keys)
        result = self.run(CallRequest(node.call, step.step, part, node.evaluate))
        balance = share_balance(view, shares, keys) if self.spec.rank == 0 else {}
        if node.evaluate:
            balance = {}
        for name, value in balance.items():  # rank 0 reports the call's stats
            result.stats[f"dp_{name}_max_over_mean/{node.call}"] = value
        if result.batch is not None:
            keep = self.groups.is_head
            result.batch = rename_outputs(result.batch, call.outputs, call.name) if keep else None
        if call.kind == "generate" and result.batch is not None:
            # each sample names the weights that sampled it (an off-policy loss reads it)
            result.batch.extras[VERSION_EXTRA] = [version] * result.batch.n_samples
        if node.release:
            self._model().release()  # a copy: the next reallocation refills it
        if call.kind == "train" and not node.evaluate:
            self.version = step.step
        result.began, result.ended, result.step = began, time.time(), step.step
        result.version = version
        return result

    def dag_send(self, step: StepInput, move: MoveNode, *upstream: Any) -> MoveResult:
        """A weight move's sending side as a node of the step's DAG."""
        began = time.time()
        self._fault("move", step.step)
        self.realloc_send(move.group, move.by_peer, move.dtype)
        return MoveResult(move.unit, self.spec.rank, 0, began, time.time(), self.version, sent=True)

    def dag_recv(self, step: StepInput, move: MoveNode, *upstream: Any) -> MoveResult:
        """A weight move's receiving side as a node of the step's DAG."""
        began = time.time()
        self._fault("move", step.step)
        received = self.realloc_recv(move.group, move.by_peer, move.eta, move.forward)
        return MoveResult(move.unit, self.spec.rank, received, began, time.time())

    def get_weights(self) -> dict[str, torch.Tensor]:
        """The whole model (gathered over this replica's tp and pp ranks, and its ep group's
        replicas: every rank of those must call); the head rank returns it, the others an empty
        dict."""
        full = self._full_state()
        return full if self.groups.is_head else {}

    def set_weights(self, weights: dict[str, torch.Tensor]) -> int:
        """Keep this rank's shards of the whole-model ``weights``; returns the bytes kept."""
        kept = self._model().load_full_state(weights)
        self._weights_loaded()
        return kept

    def join_transfer_group(
        self,
        name: str,
        address: str,
        rank: int,
        size: int,
        shared_devices: bool = False,
        shm: bool = True,
        ipc: bool = False,
    ) -> None:
        """Join the reallocation transfer group ``name`` (made once per pair of role groups;
        ``shared_devices``: the two groups have devices in common; ``shm``: messages to members
        on this host go through shared memory; ``ipc``: those on this rank's GPU through its
        memory)."""
        self.transfer_groups[name] = TransferGroup(
            self._store(address),
            rank,
            size,
            self.spec.device,
            shared_devices,
            same_host=shm,
            ipc=ipc,
        )

    def realloc_send(
        self, group: str, by_peer: dict[int, list[Transfer]], dtype: str = "fp32"
    ) -> int:
        """Send this rank's planned source slices, in ``dtype``; returns bytes sent."""
        return send_from(self.transfer_groups[group], self._source(), by_peer, DTYPES[dtype])

    def realloc_recv(
        self,
        group: str,
        by_peer: dict[int, list[Transfer]],
        eta: float | None = None,
        forward: dict[int, list[Transfer]] | None = None,
    ) -> int:
        """Receive this rank's planned slices (copy, or blend with weight ``eta``), relaying
        those ``forward`` names to the next ranks of their streams."""
        blend = copy_into if eta is None else ema_into(eta)
        tg = self.transfer_groups[group]
        received = receive_into(tg, self._model(), by_peer, blend, forward)
        self._weights_loaded()
        return received

    def weights_summary(self) -> WeightsSummary:
        """The bytes of weights this rank holds (a ZeRO-3 rank: its slices) and their digest."""
        held = self._source().source_shards().values()
        n_bytes = sum(t.numel() * t.element_size() for t in held)
        return WeightsSummary(n_bytes, self._model().digest())

    def save(self, model_dir: str, optim_dir: str, step: int = 0) -> None:
        """Every rank calls: replica 0 gathers and its head writes the model (Hugging Face
        format) to ``model_dir``; each rank writes its optimizer + interface state to
        ``optim_dir/{role}.rank{r}.pt`` (ranks hold different shards of the optimizer)."""
        self._fault("checkpoint", step)
        over_dp = self.trainer is not None and self.trainer.gathers_over_dp
        # replica 0 gathers, with the replicas holding the rest of its experts (ep > 1)
        if self.groups.coords.dp_rank < self.groups.ep or over_dp:
            self._model().save_pretrained(model_dir, self._full_state())
        state: dict[str, Any] = {
            "interfaces": {k: v.state_dict() for k, v in self.interfaces.items()}
        }
        if self.trainer is not None:
            state["optimizer"] = self.trainer.save_optimizer(self._engine_dir(optim_dir))
        torch.save(state, optim_file(optim_dir, self.spec.role, self.spec.rank))

    def load_optimizer(self, optim_dir: str) -> None:
        path = optim_file(optim_dir, self.spec.role, self.spec.rank)
        state = torch.load(path, weights_only=False)
        if self.trainer is not None:
            self.trainer.load_optimizer(self._engine_dir(optim_dir), state["optimizer"])
        for name, s in state["interfaces"].items():
            self.interfaces[name].load_state_dict(s)

    def _model(self) -> RankModel:
        assert self.model is not None, f"role '{self.spec.role}' has no model"
        return self.model

    def _source(self) -> ShardSource:
        return self.trainer.shard_source() if self.trainer is not None else self._model()

    def _full_state(self) -> dict[str, torch.Tensor]:
        return whole_state(self._model(), self.trainer)

    def _weights_loaded(self) -> None:
        """New weights came from outside: the optimizer takes them as its master copy
        (DeepSpeed); a vLLM generator reloads them before its next call (the model's version)."""
        if self.trainer is not None:
            self.trainer.weights_loaded()

    def _engine_dir(self, optim_dir: str) -> str:
        """Where an engine with its own checkpoint format (DeepSpeed) writes this role's."""
        return os.path.join(optim_dir, self.spec.role)

    def shutdown(self) -> None:
        """Leave the process groups and remove this rank's shared-memory segments (an actor
        killed without this leaves them to the next transfer group's sweep)."""
        for group in self.transfer_groups.values():
            group.close()
        if dist.is_initialized():
            dist.destroy_process_group()
