"""Exceptions the CLI reports in one line: ``RayhfError`` for mistakes a user can fix (config,
files, values; exit 2), ``RunFailed`` for a run stopped by a failure of the cluster under it
(an actor died; exit 1), ``RunInterrupted`` for Ctrl-C (exit 130) and ``RunPreempted`` for
SIGTERM (exit 143, after a checkpoint). Everything else is a bug
and keeps its traceback.
"""

import time


class RayhfError(ValueError):
    """A user error whose message names what to change: a config field, a file or a value."""


class RunFailed(RuntimeError):
    """A run stopped because part of the cluster failed; the message names the role and how to
    continue (``--resume``). ``recoverable``: whether a restart may get past it (an actor whose
    constructor raised would raise again); ``at``: when it was found (``time.time()``)."""

    def __init__(self, message: str, recoverable: bool = True) -> None:
        super().__init__(message)
        self.recoverable = recoverable
        self.at = time.time()


class RunInterrupted(RuntimeError):
    """A run stopped by Ctrl-C after its actors were cleaned up; the message says how to
    continue (``--resume``)."""


class RunPreempted(RunInterrupted):
    """A run stopped by SIGTERM at a step boundary, after writing its checkpoint; the message
    says how to continue (``--resume``, or ``resume: auto``)."""
