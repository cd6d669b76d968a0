"""Layouts and coordinates: where a call's ranks sit and how they are numbered.

A layout is a mesh (ordered device indices) plus ``dp x tp x pp`` whose product is the mesh
size, a micro-batch count, and ``ep``: how many of the data-parallel ranks split a
Mixture-of-Experts model's experts between them (expert parallelism, carved out of dp: groups of
``ep`` neighbouring dp ranks each hold ``1/ep`` of every layer's experts and send each other
their tokens), and ``cp``: how many of the data-parallel ranks split each sequence of the rows
they share between them (context parallelism, carved out of dp the same way: groups of ``cp``
neighbouring dp ranks take one share of the batch, each rank a ``1/cp`` slice of its tokens, and
attention gathers the sequence back per head: ``rayhf.parallel.context``). Since both are carved
out of dp, the weights a rank holds depend on dp, tp and pp alone. ``Layout`` checks its
arithmetic once, here; everything
downstream (process groups, sharding, reallocation, the planner) trusts it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Layout:
    """Where and how one call runs: ``mesh`` devices split as ``dp x tp x pp``."""

    mesh: tuple[int, ...]
    dp: int
    tp: int = 1
    pp: int = 1
    n_microbatches: int = 1
    ep: int = 1
    cp: int = 1

    def __post_init__(self) -> None:
        assert self.dp * self.tp * self.pp == len(self.mesh), f"bad layout {self}"
        assert self.dp % self.ep == 0, f"ep={self.ep} does not divide dp={self.dp}"
        assert self.dp % self.cp == 0, f"cp={self.cp} does not divide dp={self.dp}"
        assert self.ep == 1 or self.cp == 1, f"ep={self.ep} with cp={self.cp}"
        assert len(set(self.mesh)) == len(self.mesh), f"repeated device in {self.mesh}"

    def __hash__(self) -> int:  # memoized: the planner's search hashes layouts millions of times
        cached = self.__dict__.get("_hash")
        if cached is None:
            cached = hash(
                (self.mesh, self.dp, self.tp, self.pp, self.n_microbatches, self.ep, self.cp)
            )  # ints: the same
            object.__setattr__(self, "_hash", cached)  # in every process
        return cached

    @property
    def name(self) -> str:
        """Short stable name, used in actor names: ``d0-1.dp2tp1pp1`` (``...ep2`` with experts
        split, ``...cp2`` with sequences split)."""
        devices = _ranges(self.mesh)
        experts = f"ep{self.ep}" if self.ep > 1 else ""
        context = f"cp{self.cp}" if self.cp > 1 else ""
        return f"d{devices}.dp{self.dp}tp{self.tp}pp{self.pp}{experts}{context}"

    @property
    def batch_groups(self) -> int:
        """How many shares the batch splits into: the dp ranks over the cp ranks that share
        one."""
        return self.dp // self.cp

    @property
    def world_size(self) -> int:
        return len(self.mesh)


@dataclass(frozen=True)
class Coords:
    """A rank's place on the three named mesh axes."""

    dp_rank: int
    pp_rank: int
    tp_rank: int


def layout_rank(dp_rank: int, pp_rank: int, tp_rank: int, pp: int, tp: int) -> int:
    """A layout's rank order: tp innermost (tp peers are neighbouring devices), then pp, then dp."""
    return (dp_rank * pp + pp_rank) * tp + tp_rank


def coords_of(rank: int, pp: int, tp: int) -> Coords:
    """Inverse of ``layout_rank``."""
    return Coords(rank // (pp * tp), rank // tp % pp, rank % tp)


def stage_major(mesh: tuple[int, ...], dp: int, tp: int, pp: int) -> tuple[int, ...]:
    """``mesh`` reordered so that a layout's ranks sit where Megatron-LM puts them: tp innermost,
    then dp, then pp (rank ``layout_rank(d, p, t)`` on ``mesh[(p * dp + d) * tp + t]``). Each
    pipeline stage's ``dp x tp`` ranks are then neighbouring devices, so an ep group (``ep``
    neighbouring dp ranks) spans ``ep x tp`` devices, not ``ep x tp x pp``; only the stages'
    point-to-point sends cross the gaps."""
    return tuple(
        mesh[(p * dp + d) * tp + t] for d in range(dp) for p in range(pp) for t in range(tp)
    )


def _ranges(mesh: tuple[int, ...]) -> str:
    if list(mesh) == list(range(mesh[0], mesh[0] + len(mesh))) and len(mesh) > 1:
        return f"{mesh[0]}-{mesh[-1]}"
    return "_".join(str(d) for d in mesh)
