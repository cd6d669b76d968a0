"""The one failure path: every wait on role-group actors goes through ``gather``.

    [Pending(ref, role, actor, doing), ...] --ray.wait, one at a time, under one deadline-->
        results in order
        | an actor died (anywhere among them)   -> RunFailed naming role, actor, what it did
        | a peer's collective broke under it    -> the same, for the actor whose peer died
        | results lost with their node          -> RunFailed naming the node's actor
        | nothing for ``timeout_s``             -> RunFailed naming who has not answered

Calls, weight moves and their routing, checkpoint writes, start-up, eval, engine syncs (inside
calls) and releases all wait here, so a dead actor is one line, never a traceback or a hang.
``RunFailed.recoverable`` is False where a restart would fail the same way (an actor whose
constructor raised).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import ray

from rayhf.errors import RayhfError, RunFailed

# Errors an actor raises when a peer of its collective died under it (gloo, NCCL, sockets).
_BROKEN_PEER = ("connection closed by peer", "connection reset", "gloo", "nccl", "broken pipe")
# How long a broken collective waits for its dead peer's own error, which names the cause.
_PEER_GRACE_S = 5.0


@dataclass(frozen=True)
class Pending:
    """One actor method call being waited for."""

    ref: Any  # ray.ObjectRef
    role: str
    actor: str  # its name: ``{role}.{layout}[{rank}]``
    actor_id: str  # hex, to match a RayActorError to the actor
    doing: str  # e.g. "call 'actor_gen'", "checkpoint write", "start-up"


def pending(ref: Any, handle: Any, role: str, name: str, doing: str) -> Pending:
    """A ``Pending`` for ``ref``, an object ref of a method call on actor ``handle``."""
    return Pending(ref, role, name, handle._actor_id.hex(), doing)


def group_wait(timeout_s: float):
    """``realloc.mover.Wait`` through ``gather``: (role group, rank, ref) calls."""

    def wait(calls: Sequence[tuple[Any, int, Any]], doing: str) -> list[Any]:
        return gather(
            [pending(ref, g.actors[r], g.role, g.actor_name(r), doing) for g, r, ref in calls],
            timeout_s,
        )

    return wait


def gather(calls: Sequence[Pending], timeout_s: float) -> list[Any]:
    """Every call's result, in order; the first failure stops the wait at once (peers of a
    dead actor may be blocked in a collective with it and never return)."""
    index = {c.ref: i for i, c in enumerate(calls)}
    results: dict[int, Any] = {}
    left = [c.ref for c in calls]
    deadline = time.monotonic() + timeout_s
    while left:
        # in slices of at most a second: the main thread handles signals between them (SIGTERM's
        # grace period, Ctrl-C), which a wait of an hour inside Ray would hold back
        remaining = deadline - time.monotonic()
        ready, left = ray.wait(left, num_returns=1, timeout=max(min(remaining, 1.0), 0))
        if not ready and remaining > 1.0:
            continue
        if not ready:
            unanswered = set(left)
            waiting = next(c for c in calls if c.ref in unanswered)
            raise RunFailed(
                f"role '{waiting.role}': actor {waiting.actor} did not finish {waiting.doing} "
                f"within {timeout_s:g} s (driver.call_timeout_s)"
            )
        i = index[ready[0]]
        try:
            results[i] = ray.get(ready[0])
        except ray.exceptions.RayActorError as e:
            raise died(e, calls, set(results), calls[i]) from e
        except ray.exceptions.ObjectLostError as e:
            raise _failed(calls[i], "lost its results with its node", e) from e
        except ray.exceptions.RayTaskError as e:
            raise_user_error(e)
            if not broken_peer(e):
                raise  # a bug in the actor's code: keep its traceback
            raise _peer_failure(e, calls, set(results), left, calls[i]) from e
    return [results[i] for i in range(len(calls))]


def raise_user_error(error: ray.exceptions.RayTaskError) -> None:
    """Raise the ``RayhfError`` an actor's call raised as itself, its one line (a user-facing
    stop, such as too many non-finite gradients), not as a task error's traceback; else
    nothing."""
    if isinstance(error.cause, RayhfError):
        raise error.cause from None


def died(
    error: ray.exceptions.RayActorError,
    calls: Sequence[Pending],
    done: set[int],
    fallback: Pending | None = None,
) -> RunFailed:
    """The failure naming the dead actor (by ``error.actor_id``; an unfinished call of it first,
    since a dependent call reports its upstream's death) and what it was doing."""
    ids = [i for i, c in enumerate(calls) if c.actor_id == error.actor_id]
    unfinished = [i for i in ids if i not in done] or ids
    call = calls[unfinished[0]] if unfinished else fallback
    if call is None:
        out = RunFailed(f"an actor died ({first_line(error)})")
    else:
        out = _failed(call, "died", error)
    out.recoverable = not error.actor_init_failed
    return out


def broken_peer(error: BaseException) -> bool:
    """Whether an actor's error is a collective broken by a dead peer."""
    text = str(error).lower()
    return any(k in text for k in _BROKEN_PEER)


def _peer_failure(
    error: BaseException, calls: Sequence[Pending], done: set[int], left: list[Any],
    call: Pending,
) -> RunFailed:  # fmt: skip
    """A collective broke under ``call``: the dead peer's own error if it arrives in a few
    seconds (it names the cause), else this call's."""
    ready, _ = ray.wait(left, num_returns=len(left), timeout=_PEER_GRACE_S) if left else ([], [])
    for ref in ready:
        try:
            ray.get(ref)
        except ray.exceptions.RayActorError as e:
            return died(e, calls, done)
        except Exception:  # another broken peer: keep looking for the dead one
            continue
    return _failed(call, "lost a peer of its collective", error)


def _failed(call: Pending, what: str, error: BaseException) -> RunFailed:
    return RunFailed(
        f"role '{call.role}': actor {call.actor} {what} during {call.doing} ({first_line(error)})"
    )


def first_line(error: BaseException) -> str:
    """The first line of an error's text (its class name if it has none)."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
