"""Exceptions the CLI reports in one line: ``RayhfError`` for mistakes a user can fix (config,
files, values; exit 2), ``RunFailed`` for a run stopped by a failure of the cluster under it
(an actor died; exit 1) and ``RunInterrupted`` for Ctrl-C (exit 130). Everything else is a bug
and keeps its traceback.
"""


class RayhfError(ValueError):
    """A user error whose message names what to change: a config field, a file or a value."""


class RunFailed(RuntimeError):
    """A run stopped because part of the cluster failed; the message names the role and how to
    continue (``--resume``)."""


class RunInterrupted(RuntimeError):
    """A run stopped by Ctrl-C after its actors were cleaned up; the message says how to
    continue (``--resume``)."""
