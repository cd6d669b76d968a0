"""Learning-rate schedules: the rate of a role's optimizer at each step of the run.

    rate(step) = lr * warm-up(step) * shape(progress)
      warm-up:  step / warmup_steps up to warmup_steps, then 1 (step counts from 1, so the first
                step already learns, at lr / warmup_steps)
      progress: (step - 1 - warmup_steps) / (total_steps - warmup_steps): 0 at the first step
                after the warm-up, just under 1 at the last (which still learns, a little)
      shape:    constant 1; linear 1 -> min_ratio; cosine 1 -> min_ratio along half a cosine

The rate is a pure function of the run's step, set before each train call (every minibatch of
that call steps at it, as verl's per-step scheduler does), so a resumed run has the rates of an
uninterrupted one with nothing saved beyond the step it resumes at. ``total_steps`` defaults to
the run's ``steps``; a resume that extends the run stretches the decay from there on.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class ScheduleConfig(BaseModel):
    """How a role's learning rate moves over the run."""

    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid")

    kind: Literal["constant", "linear", "cosine"] = "constant"
    """The shape after the warm-up: constant, linear decay, or cosine decay."""
    warmup_steps: int = Field(0, ge=0)
    """Steps of linear warm-up from lr / warmup_steps to lr."""
    min_ratio: float = Field(0.0, ge=0, le=1)
    """The floor of a decay, as a share of lr (reached at total_steps)."""
    total_steps: int | None = Field(None, gt=0)
    """The step the decay ends at; None: the run's steps."""


def rate(cfg: ScheduleConfig, lr: float, step: int, total: int) -> float:
    """The learning rate at ``step`` (from 1) of a run of ``total`` steps (``cfg.total_steps``
    when set)."""
    total = cfg.total_steps or total
    warm = min(1.0, step / cfg.warmup_steps) if cfg.warmup_steps else 1.0
    if cfg.kind == "constant" or step <= cfg.warmup_steps:
        return lr * warm
    progress = min(1.0, (step - 1 - cfg.warmup_steps) / max(1, total - cfg.warmup_steps))
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    shape = 1.0 - progress if cfg.kind == "linear" else cosine
    return lr * (cfg.min_ratio + (1.0 - cfg.min_ratio) * shape)


def step_to(optimizer: Any, cfg: ScheduleConfig, lr: float, step: int, total: int) -> float:
    """Set ``optimizer``'s rate (every parameter group; torch's and DeepSpeed's optimizers
    alike) to the schedule's at ``step`` of ``total``; returns it."""
    now = rate(cfg, lr, step, total)
    for group in optimizer.param_groups:
        group["lr"] = now
    return now
