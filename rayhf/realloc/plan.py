"""Reallocation planning: which slices of which parameters move from which source rank to which
destination rank when a role's weights go from layout A to layout B. Pure index arithmetic over
``rayhf.models.sharding``; no Ray, no processes.

Every parameter is cut along one dim: its tp dim, or dim 0 for a parameter every tp rank holds
whole. A destination rank needs, per parameter of its stage, the ranges its tp rank holds; each
range is intersected with the ranges of the source tp ranks of the stage that holds the
parameter. Every source data-parallel replica (and, for a tp-replicated parameter, every tp rank)
holds the intersection, so the piece is cut into one part per holder and each part is sent by the
holder that has sent the least so far: the sending load spreads over all replicas.

A flat source (``src_flat``: DeepSpeed ZeRO-3, tp = pp = 1) holds no rows: each dp rank keeps the
contiguous range ``[r * ceil(n/dp), (r+1) * ceil(n/dp))`` of every parameter's flattened elements.
A destination's rows then come from one or two ranks, cut where the ranges end, which can be
mid-row: such a transfer is a rectangle (``cross``: its extent along the other dim of a 2-D
parameter) read from the flat slice as a strided view (``src_view``).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from rayhf.errors import RayhfError
from rayhf.models.sharding import (
    ParamShard,
    embedding_name,
    param_shards,
    shard_ranges,
    stage_layers,
)
from rayhf.models.spec import ModelSpec
from rayhf.parallel.layout import Layout, coords_of, layout_rank


@dataclass(frozen=True)
class Transfer:
    """Rows ``[start, stop)`` along ``dim`` of parameter ``name`` from ``src`` to ``dst`` (layout
    ranks); ``src_offset``/``dst_offset`` locate the rows inside each side's local shard."""

    name: str
    dim: int
    start: int
    stop: int
    src: int
    dst: int
    src_offset: int
    dst_offset: int
    nbytes: int
    cross: tuple[int, int] | None = None  # 2-D: the range along the other dim (None: all)
    src_view: tuple[tuple[int, ...], tuple[int, ...]] | None = None  # flat source: size, stride


@dataclass
class ReallocPlan:
    """The transfers of one A -> B reallocation, and what each device sends and receives."""

    src: Layout
    dst: Layout
    transfers: list[Transfer] = field(default_factory=list)
    sent: dict[int, int] = field(default_factory=dict)  # source device -> bytes
    received: dict[int, int] = field(default_factory=dict)  # destination device -> bytes

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.transfers)

    def for_src(self, rank: int) -> list[Transfer]:
        return [t for t in self.transfers if t.src == rank]

    def for_dst(self, rank: int) -> list[Transfer]:
        return [t for t in self.transfers if t.dst == rank]


def split_dim(p: ParamShard) -> int:
    return 0 if p.tp_dim is None else p.tp_dim


def held_ranges(p: ParamShard, tp: int, tp_rank: int) -> list[tuple[int, int]]:
    """The full-parameter rows (along ``split_dim``) that a tp rank holds, in local order."""
    if p.tp_dim is None or tp == 1:
        return [(0, p.shape[split_dim(p)])]
    return shard_ranges(p, tp, tp_rank)


def local_offset(ranges: list[tuple[int, int]], row: int) -> int:
    """Where full-parameter ``row`` sits in a shard made of ``ranges`` concatenated."""
    offset = 0
    for lo, hi in ranges:
        if lo <= row < hi:
            return offset + row - lo
        offset += hi - lo
    raise AssertionError(f"row {row} not in {ranges}")


def check_compatible(src: ModelSpec, dst: ModelSpec, what: str) -> None:
    """Refuse a reallocation between models whose parameters differ (names or shapes)."""
    a = {p.name: p.shape for p in param_shards(src)}
    b = {p.name: p.shape for p in param_shards(dst)}
    for name in sorted(a.keys() | b.keys()):
        if a.get(name) != b.get(name):
            raise RayhfError(
                f"{what}: the models differ at parameter {name} "
                f"(source {a.get(name, 'missing')}, destination {b.get(name, 'missing')}); "
                f"reallocation needs the same architecture and shapes"
            )


def _stage_of_unit(spec: ModelSpec, pp: int) -> dict[int, int]:
    out = {0: 0, spec.n_layers + 1: pp - 1}
    for stage, layers in enumerate(stage_layers(spec, pp)):
        for i in layers:
            out[i + 1] = stage
    return out


def _parts(lo: int, hi: int, n: int) -> list[tuple[int, int]]:
    n = max(1, min(n, hi - lo))
    base, extra = divmod(hi - lo, n)
    out, start = [], lo
    for i in range(n):
        size = base + (1 if i < extra else 0)
        out.append((start, start + size))
        start += size
    return out


def plan_realloc(
    spec: ModelSpec, src: Layout, dst: Layout, itemsize: int = 4, src_flat: bool = False
) -> ReallocPlan:
    """Every transfer that turns ``spec``'s weights in layout ``src`` into layout ``dst``
    (``src_flat``: the source's dp ranks hold flat slices, ZeRO-3)."""
    assert not src_flat or (src.tp == 1 and src.pp == 1), "a flat source is dp-only"
    plan = ReallocPlan(src, dst)
    src_stage, dst_stage = _stage_of_unit(spec, src.pp), _stage_of_unit(spec, dst.pp)
    tied = embedding_name(spec) if spec.tied else None  # also on the last stage (its copy)
    sent_by_rank: dict[int, int] = defaultdict(int)
    for d_rank in range(dst.world_size):
        c = coords_of(d_rank, dst.pp, dst.tp)
        for p in param_shards(spec):
            copy = p.name == tied and c.pp_rank == dst.pp - 1
            if dst_stage[p.unit] != c.pp_rank and not copy:
                continue
            wanted = held_ranges(p, dst.tp, c.tp_rank)
            if src_flat:
                plan.transfers.extend(_flat_transfers(p, src.dp, wanted, d_rank, itemsize))
                continue
            for piece in _pieces(p, src, src_stage[p.unit], wanted):
                plan.transfers.append(_assign(p, piece, src, d_rank, sent_by_rank, itemsize))
    for t in plan.transfers:
        s_dev, d_dev = src.mesh[t.src], dst.mesh[t.dst]
        plan.sent[s_dev] = plan.sent.get(s_dev, 0) + t.nbytes
        plan.received[d_dev] = plan.received.get(d_dev, 0) + t.nbytes
    return plan


@dataclass(frozen=True)
class _Piece:
    start: int
    stop: int
    holders: tuple[int, ...]  # source layout ranks that hold these rows
    dst_offset: int


def _pieces(p: ParamShard, src: Layout, stage: int, wanted: list[tuple[int, int]]) -> list[_Piece]:
    """The destination's ``wanted`` rows cut where source shards change, one part per holder."""
    out = []
    for a, b in wanted:
        src_tps = range(1) if p.tp_dim is None else range(src.tp)  # replicated: any tp rank
        for src_tp in src_tps:
            for lo, hi in held_ranges(p, src.tp, src_tp):
                x, y = max(a, lo), min(b, hi)
                if x >= y:
                    continue
                holders = tuple(
                    layout_rank(r, stage, tt, src.pp, src.tp)
                    for r in range(src.dp)
                    for tt in (range(src.tp) if p.tp_dim is None else [src_tp])
                )
                for u, v in _parts(x, y, len(holders)):
                    out.append(_Piece(u, v, holders, local_offset(wanted, u)))
    return out


def _assign(
    p: ParamShard,
    piece: _Piece,
    src: Layout,
    d_rank: int,
    sent_by_rank: dict[int, int],
    itemsize: int,
) -> Transfer:
    """Give ``piece`` to the holder that has sent the fewest bytes so far."""
    sender = min(piece.holders, key=lambda h: (sent_by_rank[h], h))
    nbytes = (piece.stop - piece.start) * (p.numel // p.shape[split_dim(p)]) * itemsize
    sent_by_rank[sender] += nbytes
    src_ranges = held_ranges(p, src.tp, coords_of(sender, src.pp, src.tp).tp_rank)
    return Transfer(
        p.name,
        split_dim(p),
        piece.start,
        piece.stop,
        sender,
        d_rank,
        local_offset(src_ranges, piece.start),
        piece.dst_offset,
        nbytes,
    )


def _flat_transfers(
    p: ParamShard, dp: int, wanted: list[tuple[int, int]], d_rank: int, itemsize: int
) -> list[Transfer]:
    """The destination's ``wanted`` ranges of ``p``, each from the flat source rank(s) holding
    it, as rectangles of the parameter seen as ``[rows, cols]`` (a 1-D one as one row)."""
    assert len(p.shape) in (1, 2), f"{p.name}: reallocation handles 1-D and 2-D parameters"
    dim = split_dim(p)
    rows, cols = (1, p.shape[0]) if len(p.shape) == 1 else p.shape
    part = -(-p.numel // dp)  # ceil: every rank's slice has this length (the last padded)
    out = []
    for a, b in wanted:
        box = (0, rows, a, b) if len(p.shape) == 1 or dim == 1 else (a, b, 0, cols)
        for rank in range(dp):
            for r0, r1, c0, c1 in _rectangles(box, rank * part, (rank + 1) * part, cols):
                cross: tuple[int, int] | None = None
                if len(p.shape) == 1:
                    start, stop = c0, c1
                elif dim == 1:
                    start, stop, cross = c0, c1, (r0, r1)
                else:
                    start, stop = r0, r1
                    cross = None if (c0, c1) == (0, cols) else (c0, c1)
                out.append(
                    Transfer(
                        p.name,
                        dim,
                        start,
                        stop,
                        rank,
                        d_rank,
                        r0 * cols + c0 - rank * part,
                        local_offset(wanted, start),
                        (r1 - r0) * (c1 - c0) * itemsize,
                        cross,
                        (((c1 - c0),), (1,))
                        if len(p.shape) == 1
                        else ((r1 - r0, c1 - c0), (cols, 1)),
                    )
                )
    return out


def _rectangles(
    box: tuple[int, int, int, int], lo: int, hi: int, cols: int
) -> list[tuple[int, int, int, int]]:
    """``box`` (rows r0..r1, cols c0..c1 of a row-major ``[*, cols]`` array) cut to the flat
    elements ``[lo, hi)``: at most three rectangles (a partial first row, whole rows, a partial
    last row)."""
    r0, r1, c0, c1 = box
    first, last = max(r0, lo // cols), min(r1, -(-hi // cols)) - 1

    def covered(row: int) -> tuple[int, int]:
        return max(c0, lo - row * cols), min(c1, hi - row * cols)

    out = []
    for row in sorted({first, last}):
        if row in (first, last) and first <= row <= last:
            x, y = covered(row)
            if x < y and (x, y) != (c0, c1):
                out.append((row, row + 1, x, y))
    whole = [row for row in (first, last) if first <= row <= last and covered(row) == (c0, c1)]
    m0 = first if first in whole else first + 1
    m1 = last + 1 if last in whole else last
    if m0 < m1:
        out.append((m0, m1, c0, c1))
    return out
