"""Layouts and coordinates: where a call's ranks sit and how they are numbered.

A layout is a mesh (ordered device indices) plus ``dp x tp x pp`` whose product is the mesh
size, and a micro-batch count. ``Layout`` checks its arithmetic once, here; everything
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

    def __post_init__(self) -> None:
        assert self.dp * self.tp * self.pp == len(self.mesh), f"bad layout {self}"
        assert len(set(self.mesh)) == len(self.mesh), f"repeated device in {self.mesh}"

    def __hash__(self) -> int:  # memoized: the planner's search hashes layouts millions of times
        cached = self.__dict__.get("_hash")
        if cached is None:
            cached = hash(
                (self.mesh, self.dp, self.tp, self.pp, self.n_microbatches)
            )  # ints: the same
            object.__setattr__(self, "_hash", cached)  # in every process
        return cached

    @property
    def name(self) -> str:
        """Short stable name, used in actor names: ``d0-1.dp2tp1pp1``."""
        devices = _ranges(self.mesh)
        return f"d{devices}.dp{self.dp}tp{self.tp}pp{self.pp}"

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


def _ranges(mesh: tuple[int, ...]) -> str:
    if list(mesh) == list(range(mesh[0], mesh[0] + len(mesh))) and len(mesh) > 1:
        return f"{mesh[0]}-{mesh[-1]}"
    return "_".join(str(d) for d in mesh)
