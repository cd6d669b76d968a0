"""The Ray actor that holds one rank of one role group.

Its remote surface is small and typed: ``setup_dp`` joins the data-parallel group, ``run``
executes one call through the call's interface, ``get_weights``/``set_weights`` serve
reallocation, ``save``/``load_optimizer`` serve checkpoints. How a call's batch is spread over
the ranks is declared in ``DISPATCH``.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any

import torch
import torch.distributed as dist

from rayhf.algorithms import CallContext, make_interface
from rayhf.engines.torch_engine import TorchEngine
from rayhf.models.hf import quiet_transformers
from rayhf.runtime.messages import CallRequest, CallResult, WorkerSpec

# kind -> how the driver spreads the batch and joins the results:
#   split/concat: each dp rank gets a token-balanced share; outputs are concatenated
#   split/first: each rank trains on its share; stats are already all-reduced, take rank 0's
DISPATCH: dict[str, tuple[str, str]] = {
    "generate": ("split", "concat"),
    "inference": ("split", "concat"),
    "train": ("split", "first"),
}


def _build_model(spec: WorkerSpec):
    from transformers import AutoConfig

    from rayhf.models.hf import build_model, load_model

    if spec.model_dir is not None:
        return load_model(spec.model_dir, spec.value_head, f"models.{spec.role}")
    if spec.config_dir is not None:
        config = AutoConfig.from_pretrained(spec.config_dir, local_files_only=True)
        return build_model(config, spec.value_head, seed=spec.seed)
    return None


class RoleWorker:
    """One rank: model, optimizer, and one interface instance per interface name."""

    def __init__(self, spec: WorkerSpec) -> None:
        from transformers import AutoTokenizer

        quiet_transformers()
        torch.set_num_threads(spec.threads)
        os.environ["OMP_NUM_THREADS"] = str(spec.threads)
        self.spec = spec
        model = _build_model(spec)
        if model is not None:
            model.to(spec.device)
        tokenizer = AutoTokenizer.from_pretrained(spec.tokenizer_dir, local_files_only=True)
        optim = spec.optimizer if model is not None else None
        self.engine = TorchEngine(model, tokenizer, spec.value_head, optim)
        self.calls = {c.name: c for c in spec.calls}
        self.interfaces = {
            c.interface: make_interface(c.interface, spec.settings) for c in spec.calls
        }

    def rendezvous_address(self) -> str:
        """``tcp://ip:port`` on this node for the dp group's rendezvous (rank 0 calls it)."""
        import ray

        ip = ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return f"tcp://{ip}:{port}"

    def setup_dp(self, init_method: str) -> None:
        """Join the data-parallel process group (gloo on CPU, NCCL on GPU)."""
        if self.spec.dp_size == 1:
            return
        backend = "nccl" if self.spec.device.startswith("cuda") else "gloo"
        dist.init_process_group(
            backend, init_method=init_method, rank=self.spec.rank, world_size=self.spec.dp_size
        )
        self.engine.dp_group = dist.group.WORLD

    def run(self, req: CallRequest) -> CallResult:
        call = self.calls[req.call]
        interface = self.interfaces[call.interface]
        ctx = CallContext(req.step, self.spec.rank, self.spec.dp_size, self.spec.seed, call.args)
        start = time.perf_counter()
        batch, stats = None, {}
        if call.kind != "train" and req.batch.n_samples == 0:
            pass  # more dp ranks than samples: this rank has nothing to do
        elif call.kind == "generate":
            batch = interface.generate(self.engine, req.batch, ctx)
        elif call.kind == "inference":
            batch = interface.inference(self.engine, req.batch, ctx)
        elif req.evaluate:
            stats = interface.evaluate(self.engine, req.batch, ctx)
        else:
            stats = interface.train_step(self.engine, req.batch, ctx)
        return CallResult(req.call, self.spec.rank, batch, stats, time.perf_counter() - start)

    def get_weights(self) -> dict[str, torch.Tensor]:
        assert self.engine.model is not None
        return {k: v.detach().cpu() for k, v in self.engine.model.state_dict().items()}

    def set_weights(self, weights: dict[str, torch.Tensor]) -> int:
        """Load ``weights``; returns the bytes received."""
        assert self.engine.model is not None
        self.engine.model.load_state_dict(weights, strict=True)
        return sum(t.numel() * t.element_size() for t in weights.values())

    def weights_digest(self) -> float:
        """Sum of |w| over all parameters: a cheap fingerprint for tests and logs."""
        assert self.engine.model is not None
        return float(sum(p.detach().abs().sum() for p in self.engine.model.parameters()))

    def save(self, model_dir: str | None, optim_path: str | None) -> None:
        """Write the model (Hugging Face format) and/or optimizer + interface state."""
        if model_dir is not None:
            assert self.engine.model is not None
            self.engine.model.save_pretrained(model_dir)
            self.engine.tokenizer.save_pretrained(model_dir)
        if optim_path is not None:
            state: dict[str, Any] = {
                "interfaces": {k: v.state_dict() for k, v in self.interfaces.items()}
            }
            if self.engine.optimizer is not None:
                state["optimizer"] = self.engine.optimizer.state_dict()
            torch.save(state, optim_path)

    def load_optimizer(self, optim_path: str) -> None:
        state = torch.load(optim_path, weights_only=False)
        if self.engine.optimizer is not None:
            self.engine.optimizer.load_state_dict(state["optimizer"])
        for name, s in state["interfaces"].items():
            self.interfaces[name].load_state_dict(s)

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
