"""The cluster a plan is for: how many devices and of which kind."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class ClusterConfig(BaseModel):
    """Devices to plan and run on; with no address rayhf starts an embedded local Ray cluster."""

    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid")

    n_devices: int = Field(2, gt=0)
    """Emulated devices on CPU, GPUs on cuda."""
    device: Literal["cpu", "cuda"] = "cpu"
    """cpu: emulated devices (a quarter CPU each); cuda: one GPU per device."""
    address: str | None = None
    """An existing Ray cluster (e.g. "auto"); None = embedded."""
    num_cpus: int | None = Field(None, gt=0)
    """CPUs of the embedded cluster; None = all cores."""
    dashboard: bool = False
    """Start the Ray dashboard with the embedded cluster."""
    device_memory_gb: float = Field(4.0, gt=0)
    """Per emulated device, for the planner."""
