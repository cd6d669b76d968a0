"""The driver's own settings (``driver:`` in the experiment config)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class DriverConfig(BaseModel):
    """How the driver runs each step's DAG."""

    model_config = ConfigDict(extra="forbid")

    executor: Literal["auto", "plain", "compiled"] = "auto"  # auto: plain on CPU, compiled on GPU
    call_timeout_s: float = Field(3600.0, gt=0)  # a compiled step's longest wait (generate, train)
