"""Learning-rate schedules (``rayhf.engines.schedule``) on hand-computed cases, the rate reaching
an optimizer, and the settings a config refuses."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

import rayhf
from rayhf.engines.schedule import ScheduleConfig, rate, step_to

REPO = Path(__file__).resolve().parents[3]


def _rates(total: int, **kw: object) -> list[float]:
    cfg = ScheduleConfig.model_validate(kw)
    return [rate(cfg, 2.0, step, total) for step in range(1, total + 1)]


def test_each_shape_on_hand_computed_steps():
    # warm-up: step / warmup_steps of the rate, the first step already learning
    assert _rates(6, warmup_steps=4) == pytest.approx([0.5, 1.0, 1.5, 2.0, 2.0, 2.0])
    # linear: full rate the step after the warm-up, down by 1/(total - warm-up) a step
    assert _rates(6, kind="linear", warmup_steps=2) == pytest.approx([1.0, 2.0, 2.0, 1.5, 1.0, 0.5])
    # cosine to a floor of 0.1: progress 0, 1/4, 1/2, 3/4
    shape = [(1 + math.cos(math.pi * p)) / 2 for p in (0, 0.25, 0.5, 0.75)]
    expected = [2.0 * (0.1 + 0.9 * s) for s in shape]
    assert _rates(4, kind="cosine", min_ratio=0.1) == pytest.approx(expected)
    # total_steps of its own: past it, the floor
    cfg = ScheduleConfig(kind="linear", total_steps=4, min_ratio=0.25)
    assert rate(cfg, 1.0, 9, 100) == 0.25 and rate(cfg, 1.0, 3, 100) == pytest.approx(0.625)


def test_the_rate_reaches_every_parameter_group():
    a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.AdamW([{"params": [a]}, {"params": [b], "lr": 5.0}], lr=1.0)
    got = step_to(opt, ScheduleConfig(warmup_steps=4), 1.0, 1, 10)
    assert got == 0.25 and [g["lr"] for g in opt.param_groups] == [0.25, 0.25]


@pytest.mark.parametrize(
    ("override", "says"),
    [
        ({"models.actor.optimizer.schedule.kind": "step"}, "models.actor.optimizer.schedule.kind"),
        (
            {"models.actor.optimizer.schedule.warmup_steps": 50, "steps": 50},
            "models.actor.optimizer.schedule.warmup_steps: 50 is not shorter than the "
            "schedule's 50 steps",
        ),
        ({"models.actor.optimizer.schedule.min_ratio": 2}, "min_ratio"),
    ],
)
def test_bad_schedules_are_refused_naming_the_field(override, says):
    with pytest.raises((ValidationError, rayhf.RayhfError), match=says):
        rayhf.load_config(REPO / "examples" / "ppo_tiny.yaml").with_overrides(override)
