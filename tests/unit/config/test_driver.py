"""The driver's own settings: defaults, choices and bounds."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from rayhf.config.driver import DriverConfig


def test_defaults():
    cfg = DriverConfig()
    assert (cfg.executor, cfg.call_timeout_s) == ("auto", 3600.0)


@pytest.mark.parametrize("executor", ["auto", "plain", "compiled"])
def test_executors(executor):
    assert DriverConfig(executor=executor).executor == executor


@pytest.mark.parametrize(
    "bad",
    [{"executor": "threads"}, {"call_timeout_s": 0}, {"call_timeout_s": -1.0}, {"retries": 3}],
)
def test_bad_values_are_refused(bad):
    with pytest.raises(ValidationError):
        DriverConfig(**bad)
