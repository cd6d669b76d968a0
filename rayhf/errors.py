"""Exceptions the CLI reports in one line: ``RayhfError`` for mistakes a user can fix (config,
files, values; exit 2) and ``RunFailed`` for a run stopped by a failure of the cluster under it
(an actor died; exit 1). Everything else is a bug and keeps its traceback.
"""


class RayhfError(ValueError):
    """A user error whose message names what to change: a config field, a file or a value."""


class RunFailed(RuntimeError):
    """A run stopped because part of the cluster failed; the message names the role and how to
    continue (``--resume``)."""
