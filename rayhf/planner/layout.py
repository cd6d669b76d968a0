"""Layouts and plans: the planner's decisions as plain values.

A layout is a mesh (ordered device indices) plus ``dp x tp x pp`` whose product is the mesh
size, and a micro-batch count. A plan maps every call of the graph to a layout. ``Layout``
checks its arithmetic once, here; everything downstream trusts it.
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

from rayhf.errors import RayhfError


class LayoutSpec(BaseModel):
    """A manual layout for one call in the config's ``plan:`` section."""

    model_config = ConfigDict(extra="forbid")

    mesh: list[int] | None = None  # device indices; None = all devices
    dp: int | None = Field(None, gt=0)  # None = whatever mesh size / (tp * pp) leaves
    tp: int = Field(1, gt=0)
    pp: int = Field(1, gt=0)
    n_mbs: int = Field(1, gt=0)  # micro-batches per forward (pipeline depth, memory)


@dataclass(frozen=True)
class Layout:
    """Where and how one call runs: ``mesh`` devices split as ``dp x tp x pp``."""

    mesh: tuple[int, ...]
    dp: int
    tp: int = 1
    pp: int = 1
    n_mbs: int = 1

    def __post_init__(self) -> None:
        assert self.dp * self.tp * self.pp == len(self.mesh), f"bad layout {self}"
        assert len(set(self.mesh)) == len(self.mesh), f"repeated device in {self.mesh}"

    def __hash__(self) -> int:  # memoized: the planner's search hashes layouts millions of times
        cached = self.__dict__.get("_hash")
        if cached is None:
            cached = hash((self.mesh, self.dp, self.tp, self.pp, self.n_mbs))  # ints: the same
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


def layout_from_spec(spec: LayoutSpec, n_devices: int, where: str) -> Layout:
    """Turn a config ``LayoutSpec`` into a ``Layout``; errors name ``where`` (``plan.<call>``)."""
    mesh = tuple(spec.mesh) if spec.mesh is not None else tuple(range(n_devices))
    bad = [d for d in mesh if not 0 <= d < n_devices]
    if bad or not mesh or len(set(mesh)) != len(mesh):
        raise RayhfError(
            f"{where}.mesh: {list(mesh)} must be distinct device indices in 0..{n_devices - 1}"
        )
    dp = spec.dp or len(mesh) // (spec.tp * spec.pp)
    if dp * spec.tp * spec.pp != len(mesh):
        raise RayhfError(f"{where}: dp*tp*pp = {dp}*{spec.tp}*{spec.pp} != mesh size {len(mesh)}")
    return Layout(mesh, dp, spec.tp, spec.pp, spec.n_mbs)
