"""The driver's own settings (``driver:`` in the experiment config)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class DriverConfig(BaseModel):
    """How the driver runs each step's DAG."""

    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid")

    executor: Literal["auto", "plain", "compiled"] = "auto"
    """Auto: plain calls; compiled (Ray Compiled Graphs) on GPU when steps do not overlap."""
    call_timeout_s: float = Field(3600.0, gt=0)
    """The longest any wait on the actors may take (a step, a checkpoint write, start-up, a weight
    move); past it the run fails naming the actor that has not answered."""
    overlap_steps: bool = True
    """Submit step i+1 while step i runs (each unit waits only for what its dataflow needs:
    rayhf.planner.step.carried); false: one step at a time. Same results either way."""
    same_host_transport: Literal["ipc", "shm", "group"] = "shm"
    """How a weight move's large messages between processes of one host travel: shm: through
    /dev/shm, a copy in and a copy out; ipc: as shm, but between processes on the same GPU
    through a buffer on it opened by CUDA IPC handle (device copies only; not yet run on a GPU);
    group: over the transfer group's gloo sockets. Groups of GPUs that are not shared use NCCL
    either way."""

    @model_validator(mode="after")
    def _compiled_runs_one_step_at_a_time(self) -> DriverConfig:
        if self.executor == "compiled" and self.overlap_steps:
            raise ValueError(
                "executor: compiled runs one step at a time; set driver.overlap_steps: false "
                "or driver.executor: plain"
            )
        return self

    @property
    def moves_through_shm(self) -> bool:
        """Whether weight moves between processes of one host go through shared memory."""
        return self.same_host_transport in ("shm", "ipc")

    @property
    def moves_through_ipc(self) -> bool:
        """Whether weight moves between processes on the same GPU go through its memory."""
        return self.same_host_transport == "ipc"

    def compiled(self, device: str) -> bool:
        """Whether steps run as Ray compiled graphs on ``device`` (``cuda`` or ``cpu``)."""
        auto = device == "cuda" and not self.overlap_steps
        return self.executor == "compiled" or (self.executor == "auto" and auto)
