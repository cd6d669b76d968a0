"""The driver's own settings: defaults, choices and bounds."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from rayhf.config.driver import DriverConfig


def test_defaults():
    cfg = DriverConfig()
    assert (cfg.executor, cfg.call_timeout_s, cfg.overlap_steps) == ("auto", 3600.0, True)


@pytest.mark.parametrize("executor", ["auto", "plain", "compiled"])
def test_executors(executor):
    assert DriverConfig(executor=executor, overlap_steps=False).executor == executor


def test_compiled_graphs_run_one_step_at_a_time():
    with pytest.raises(ValidationError, match=r"driver\.overlap_steps: false"):
        DriverConfig(executor="compiled")
    # auto: plain calls while steps overlap; compiled on GPU only when they do not
    assert not DriverConfig().compiled("cuda")
    assert DriverConfig(overlap_steps=False).compiled("cuda")
    assert not DriverConfig(overlap_steps=False).compiled("cpu")


@pytest.mark.parametrize(
    "bad",
    [{"executor": "threads"}, {"call_timeout_s": 0}, {"call_timeout_s": -1.0}, {"retries": 3}],
)
def test_bad_values_are_refused(bad):
    with pytest.raises(ValidationError):
        DriverConfig(**bad)
