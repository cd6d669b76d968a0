"""The three exceptions the CLI reports in one line, each with its own exit code: a user error is
a ``ValueError``; a cluster failure and Ctrl-C are ``RuntimeError``s, never taken for one."""

from __future__ import annotations

import pytest

from rayhf.errors import RayhfError, RunFailed, RunInterrupted


def test_a_user_error_is_a_value_error():
    assert issubclass(RayhfError, ValueError)
    with pytest.raises(ValueError, match="set lr"):
        raise RayhfError("models.actor.optimizer.lr: must be > 0; set lr")


@pytest.mark.parametrize("cls", [RunFailed, RunInterrupted])
def test_run_stops_are_runtime_errors_not_user_errors(cls):
    assert issubclass(cls, RuntimeError)
    assert not issubclass(cls, ValueError) and not issubclass(cls, RayhfError)


def test_the_three_are_distinct():
    assert len({RayhfError, RunFailed, RunInterrupted}) == 3
    assert not issubclass(RunFailed, RunInterrupted) and not issubclass(RunInterrupted, RunFailed)
