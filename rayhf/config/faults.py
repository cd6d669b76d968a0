"""Fault tolerance settings (``fault_tolerance:`` in the experiment config): how many times a
run recovers by itself, how long it waits for the cluster and for a preempted step, and a
sequence of faults to inject (drills and tests)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

# Where an injected fault kills its actor: a call of a train step, a weight move inside a step,
# a checkpoint write, start-up (joining the role group), an evaluation call, a vLLM weight sync;
# or, ``nonfinite``, where its train calls' gradients stop being finite.
FaultSite = Literal["call", "move", "checkpoint", "startup", "eval", "sync", "nonfinite"]


class FaultInjection(BaseModel):
    """Kill one actor (SIGKILL, as the kernel's OOM killer or a lost node would) where it
    reaches ``site`` at ``step``; in one attempt of the run only, so a recovery gets past it.
    ``nonfinite`` kills nothing: from ``step`` on, every loss of the actor's train calls is
    multiplied by NaN, so each optimizer step's gradient is not finite (a drill of the trainer's
    skip and of ``optimizer.max_skipped_steps``)."""

    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid")

    site: FaultSite
    """Where the actor dies: a call, a weight move, a checkpoint write, start-up, an evaluation
    call, a vLLM weight sync; or where its gradients turn NaN (``nonfinite``, from ``step`` on)."""
    step: int = Field(1, ge=0)
    """The step it fires in (eval: the evaluation after that step)"""
    role: str
    """Whose actor dies."""
    rank: int = Field(0, ge=0)
    """Which rank (of each of the role's groups: the first to get there)"""


class FaultToleranceConfig(BaseModel):
    """How a run survives a dead actor, a lost node and SIGTERM."""

    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid")

    max_restarts: int = Field(3, ge=0)
    """Recoveries per run (tear down, wait for the devices, restore the last complete checkpoint,
    continue); 0: the first failure stops the run with the command that resumes it."""
    resources_timeout_s: float = Field(300.0, gt=0)
    """A recovery's wait for the devices."""
    preempt_grace_s: float = Field(60.0, gt=0)
    """After SIGTERM the run checkpoints at the next step boundary; past this it stops without."""
    inject: list[FaultInjection] = []
    """Faults to inject (drills and tests): the first in the run's first attempt, the second in the
    attempt after the first recovery, ...; a single fault is a list of one."""

    @field_validator("inject", mode="before")
    @classmethod
    def _one_is_a_list(cls, value: object) -> object:
        return [] if value is None else [value] if isinstance(value, dict) else value

    def fault_of_attempt(self, attempt: int) -> FaultInjection | None:
        """The fault to inject in attempt ``attempt`` (0: the first; n: after n recoveries)."""
        return self.inject[attempt] if attempt < len(self.inject) else None
