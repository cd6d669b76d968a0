"""The cluster a plan is for: how many devices and of which kind."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class ClusterConfig(BaseModel):
    """Devices to plan and run on; with no address rayhf starts an embedded local Ray cluster."""

    model_config = ConfigDict(extra="forbid")

    n_devices: int = Field(2, gt=0)  # emulated devices on CPU, GPUs on cuda
    device: Literal["cpu", "cuda"] = "cpu"
    address: str | None = None  # an existing Ray cluster (e.g. "auto"); None = embedded
    num_cpus: int | None = Field(None, gt=0)  # CPUs of the embedded cluster; None = all cores
    dashboard: bool = False  # start the Ray dashboard with the embedded cluster
    device_memory_gb: float = Field(4.0, gt=0)  # per emulated device, for the planner
