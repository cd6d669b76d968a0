"""The process groups of one layout, built inside the processes that hold it.

A layout of ``dp x pp x tp`` ranks orders them with tp innermost (tensor-parallel peers are
neighbouring devices, where the fastest links are), then pp, then dp::

    rank = base + (dp_rank * pp + pp_rank) * tp + tp_rank     (rayhf.parallel.layout.layout_rank)

Every process of the world calls ``build_groups`` with the same arguments except ``rank``
(``torch.distributed.new_group`` is collective over the whole world, members or not).
"""

from __future__ import annotations

import datetime
import os
import sys
from dataclasses import dataclass

import torch.distributed as dist

from rayhf.parallel.layout import Coords, coords_of, layout_rank


@dataclass
class ParallelGroups:
    """The groups of one rank. Axes: ``dp`` (replicas, gradient all-reduce), ``pp`` (stages,
    activations point to point), ``tp`` (shards of one layer, all-reduce/all-gather).

    A group is None when its axis has size 1, so single-process code never touches
    ``torch.distributed``.
    """

    dp: int
    pp: int
    tp: int
    coords: Coords
    dp_group: dist.ProcessGroup | None
    pp_group: dist.ProcessGroup | None
    tp_group: dist.ProcessGroup | None
    pp_ranks: tuple[int, ...]  # global ranks of this rank's pipeline, stage order
    # the first and last stage of this rank's pipeline (pp > 1, those two stages only): a tied
    # embedding's two copies sum their gradients over it
    ends_group: dist.ProcessGroup | None = None
    # expert parallelism (``Layout.ep``): ``ep`` neighbouring dp ranks split the experts and
    # exchange tokens (``ep_group``); the ranks holding the same experts, one per such group,
    # sum those experts' gradients (``expert_dp_group``, dp / ep ranks)
    ep: int = 1
    ep_group: dist.ProcessGroup | None = None
    expert_dp_group: dist.ProcessGroup | None = None
    # context parallelism (``Layout.cp``): ``cp`` neighbouring dp ranks share a share of the
    # batch and split each of its sequences (``cp_group``: attention's exchange)
    cp: int = 1
    cp_group: dist.ProcessGroup | None = None

    @property
    def is_first_stage(self) -> bool:
        return self.coords.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.coords.pp_rank == self.pp - 1

    @property
    def ep_rank(self) -> int:
        """Which ``1/ep`` of the experts this rank holds."""
        return self.coords.dp_rank % self.ep

    @property
    def cp_rank(self) -> int:
        """Which ``1/cp`` slice of each sequence this rank holds."""
        return self.coords.dp_rank % self.cp

    @property
    def batch_groups(self) -> int:
        """How many shares the batch splits into (``Layout.batch_groups``): the dp ranks over
        the cp ranks that share one."""
        return self.dp // self.cp

    @property
    def batch_rank(self) -> int:
        """Which of the ``batch_groups`` shares this rank's cp group takes."""
        return self.coords.dp_rank // self.cp

    @property
    def is_head(self) -> bool:
        """The rank that reports its replica's results (tp 0, stage 0, its cp group's first)."""
        return self.coords.pp_rank == 0 and self.coords.tp_rank == 0 and self.cp_rank == 0


STORE_TIMEOUT = datetime.timedelta(seconds=300)


def host_store(host: str = "127.0.0.1") -> tuple[dist.TCPStore, str]:
    """A rendezvous store listening on ``host``, at a port the OS picks, and its address.

    It listens before anyone is told the address: a port found free and bound only later, by
    whichever member hosts, can be taken in between (CI saw it), and the members then wait on
    whatever took it. The host keeps the store; every member, the host too, joins through it.
    """
    store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=STORE_TIMEOUT)
    return store, f"tcp://{host}:{store.port}"


def join_store(address: str) -> dist.TCPStore:
    """A client of the store that ``host_store`` opened at ``address`` (``tcp://host:port``)."""
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    return dist.TCPStore(host, int(port), is_master=False, timeout=STORE_TIMEOUT)


def leave_spawned() -> None:
    """End a spawned rank: leave its process groups, then exit without finalizing Python.

    A gloo thread drops its reference to a finished collective after the caller's ``wait``
    returns. When that reference is the last one to a tensor Python made, dropping it takes the
    GIL; during the interpreter's shutdown the thread is killed there, inside a destructor, and
    the rank aborts ("terminate called without an active exception"; about 1 exit in 10 here).
    Nothing is left to finalize after the groups are gone, so the rank skips that step.
    """
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def single() -> ParallelGroups:
    """The groups of a lone process (dp = tp = pp = 1)."""
    return ParallelGroups(1, 1, 1, Coords(0, 0, 0), None, None, None, (0,))


def build_groups(
    dp: int, tp: int, pp: int, rank: int, base: int = 0, ep: int = 1, cp: int = 1
) -> ParallelGroups:
    """Create the groups of a layout whose ranks are ``base .. base+dp*tp*pp-1``, one per line
    of ranks along each axis of size > 1: ``dp``, ``pp``, ``tp``, ``ep`` (``ep`` neighbouring
    dp ranks), ``expert_dp`` (dp ranks ``ep`` apart), ``cp`` (``cp`` neighbouring dp ranks),
    and ``ends`` (a pipeline's first and last stage).

    ``rank`` is this process's global rank; it need not belong to the layout (it must still call,
    since group creation is collective); then the returned groups are all None. A group is made
    once in a world: later layouts with the same axis and ranks get it again.
    """
    size = dp * tp * pp
    assert dist.is_initialized() or size == 1, "build_groups needs torch.distributed"
    assert base + size <= (dist.get_world_size() if dist.is_initialized() else 1)
    local = rank - base
    member = 0 <= local < size
    coords = coords_of(local, pp, tp) if member else Coords(-1, -1, -1)
    mine: dict[str, dist.ProcessGroup | None] = dict.fromkeys(
        ("dp", "pp", "tp", "ends", "ep", "expert_dp", "cp")
    )
    pp_ranks: tuple[int, ...] = (rank,)
    dp_lines = _lines(dp, pp, tp, "dp")
    for axis, n, lines in (
        ("dp", dp, dp_lines),
        ("pp", pp, _lines(dp, pp, tp, "pp")),
        ("tp", tp, _lines(dp, pp, tp, "tp")),
        ("ep", ep, [line[i : i + ep] for line in dp_lines for i in range(0, dp, ep)]),
        ("expert_dp", dp // ep, [line[i::ep] for line in dp_lines for i in range(ep)]),
        ("cp", cp, [line[i : i + cp] for line in dp_lines for i in range(0, dp, cp)]),
    ):
        if n == 1:
            continue
        for line in lines:
            ranks = [base + r for r in line]
            group = _group(axis, ranks)
            if rank in ranks:
                mine[axis] = group
                if axis == "pp":
                    pp_ranks = tuple(ranks)
    if pp > 1:
        for line in _lines(dp, pp, tp, "pp"):
            ends = [base + line[0], base + line[-1]]
            group = _group("ends", ends)
            if rank in ends:
                mine["ends"] = group
    return ParallelGroups(
        dp, pp, tp, coords, mine["dp"], mine["pp"], mine["tp"], pp_ranks if member else (),
        mine["ends"], ep, mine["ep"], mine["expert_dp"], cp, mine["cp"],
    )  # fmt: skip


# the groups made so far in this process's world, by axis and ranks, and that world
_MADE: dict[tuple[str, tuple[int, ...]], dist.ProcessGroup | None] = {}
_MADE_IN: list[dist.ProcessGroup | None] = [None]


def _group(axis: str, ranks: list[int]) -> dist.ProcessGroup | None:
    """The ``axis`` group of ``ranks`` in this world, made by its first ``build_groups``.

    A process that builds layout after layout (the checks run dozens) would otherwise make a
    group, with its gloo threads and connections, for every one, and keep them. Every rank of
    the world makes the same calls, so every rank finds or makes the same groups."""
    world = dist.group.WORLD
    if _MADE_IN[0] is not world:  # another world: its groups are gone with it
        _MADE.clear()
        _MADE_IN[0] = world
    key = (axis, tuple(ranks))
    if key not in _MADE:
        _MADE[key] = dist.new_group(ranks)
    return _MADE[key]


def _lines(dp: int, pp: int, tp: int, axis: str) -> list[list[int]]:
    """Every set of layout ranks that differ only along ``axis``."""
    out = []
    if axis == "dp":
        for p in range(pp):
            for t in range(tp):
                out.append([layout_rank(d, p, t, pp, tp) for d in range(dp)])
    elif axis == "pp":
        for d in range(dp):
            for t in range(tp):
                out.append([layout_rank(d, p, t, pp, tp) for p in range(pp)])
    else:
        for d in range(dp):
            for p in range(pp):
                out.append([layout_rank(d, p, t, pp, tp) for t in range(tp)])
    return out
