"""What every destination rank needs when a role's weights go from layout A to layout B, and
which source ranks hold it: pure index arithmetic over ``rayhf.models.sharding``.

Every parameter is cut along one dim: its tp dim, or dim 0 for a parameter every tp rank holds
whole. A destination rank needs, per parameter of its stage, the ranges its tp rank holds; each
range is intersected with the ranges of the source tp ranks of the stage that holds the
parameter. Every source data-parallel replica (and, for a tp-replicated parameter, every tp rank)
holds the intersection: those ranks are its holders.

A flat source (``src_flat``: DeepSpeed ZeRO-3, tp = pp = 1) holds no rows: each dp rank keeps the
contiguous range ``[r * ceil(n/dp), (r+1) * ceil(n/dp))`` of every parameter's flattened elements.
A destination's rows then come from one or two ranks, cut where the ranges end, which can be
mid-row: such a slice is a rectangle (``cross``: its extent along the other dim of a 2-D
parameter) read from the flat slice as a strided view (``src_view``).

Parameters that differ only by name (the same shape, split and stages: every layer's q_proj in
one stage) have the same slices, so a ``Content`` stands for all of them at once: planning costs
the same for 2 layers as for 80.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from rayhf.models.sharding import (
    ParamShard,
    embedding_name,
    expert_range,
    param_shards,
    shard_ranges,
    stage_layers,
)
from rayhf.models.spec import ModelSpec
from rayhf.parallel.layout import Layout, layout_rank

View = tuple[tuple[int, ...], tuple[int, ...]]  # a strided view: size, stride
Experts = tuple[int, int, int]  # along dim 0: source shard's first, destination's first, count


@dataclass(frozen=True)
class Content:
    """Rows ``[start, stop)`` along ``dim`` of each parameter in ``names`` (the same rows of
    parameters of one shape): where they sit in a holder's shard (``src_offset``, or a strided
    ``src_view`` of a flat slice) and in a needer's (``dst_offset``)."""

    names: tuple[str, ...]
    dim: int
    start: int
    stop: int
    src_offset: int
    dst_offset: int
    nbytes: int  # of one parameter's slice
    holders: tuple[int, ...]  # source ranks that hold these rows
    needers: tuple[int, ...]  # destination ranks that need them
    cross: tuple[int, int] | None = None  # 2-D: the range along the other dim (None: all)
    src_view: View | None = None
    # routed experts split by ep: (first expert in the holder's shard, in the needer's, how
    # many) along dim 0 (None: all of dim 0)
    experts: Experts | None = None
    total_bytes: int = field(init=False, compare=False)  # of every parameter's slice

    def __post_init__(self) -> None:
        object.__setattr__(self, "total_bytes", self.nbytes * len(self.names))

    def rows(self, lo: int, hi: int) -> Content:
        """Rows ``[lo, hi)`` of these (a row-major slice: offsets move with the start)."""
        assert self.src_view is None and self.start <= lo < hi <= self.stop
        shift, per_row = lo - self.start, self.nbytes // (self.stop - self.start)
        return Content(
            self.names, self.dim, lo, hi, self.src_offset + shift, self.dst_offset + shift,
            per_row * (hi - lo), self.holders, self.needers, self.cross, None, self.experts,
        )  # fmt: skip


def split_dim(p: ParamShard) -> int:
    return 0 if p.tp_dim is None else p.tp_dim


def held_ranges(p: ParamShard, tp: int, tp_rank: int) -> list[tuple[int, int]]:
    """The full-parameter rows (along ``split_dim``) that a tp rank holds, in local order."""
    if p.tp_dim is None or tp == 1:
        return [(0, p.shape[split_dim(p)])]
    return shard_ranges(p, tp, tp_rank)


def local_offset(ranges: Sequence[tuple[int, int]], row: int) -> int:
    """Where full-parameter ``row`` sits in a shard made of ``ranges`` concatenated."""
    offset = 0
    for lo, hi in ranges:
        if lo <= row < hi:
            return offset + row - lo
        offset += hi - lo
    raise AssertionError(f"row {row} not in {ranges}")


def stage_of_unit(spec: ModelSpec, pp: int) -> dict[int, int]:
    out = {0: 0, spec.n_layers + 1: pp - 1}
    for stage, layers in enumerate(stage_layers(spec, pp)):
        for i in layers:
            out[i + 1] = stage
    return out


def contents(
    spec: ModelSpec,
    src: Layout,
    dst: Layout,
    itemsize: int,
    src_flat: bool = False,
    skip_frozen: bool = False,
) -> list[Content]:
    """Every slice some destination rank needs, once, with its holders and all its needers
    (a tp-replicated parameter's rows are needed by every tp rank of its stage, a tied
    embedding's by its first and its last stage). Ranks only: the meshes do not matter.
    ``skip_frozen``: a LoRA role's base weights stay out (the destination holds them already)."""
    assert not src_flat or (src.tp == 1 and src.pp == 1), "a flat source is dp-only"
    src, dst = _ranks_only(src), _ranks_only(dst)
    return _contents(spec, src, dst, itemsize, src_flat, skip_frozen)


def _ranks_only(layout: Layout) -> Layout:
    return Layout(tuple(range(layout.world_size)), layout.dp, layout.tp, layout.pp, ep=layout.ep)


@functools.lru_cache(maxsize=4096)
def _contents(
    spec: ModelSpec, src: Layout, dst: Layout, itemsize: int, src_flat: bool, skip_frozen: bool
) -> list[Content]:
    needed: dict[Content, list[int]] = {}  # content (needers not yet known) -> needers
    for (s_stage, stages), p, names in _classes(spec, src.pp, dst.pp, skip_frozen):
        split = p.expert and (src.ep > 1 or dst.ep > 1)  # experts held by some dp ranks only
        for d_stage, tp_rank, q in itertools.product(
            stages, range(dst.tp), range(dst.ep if split else 1)
        ):
            wanted = tuple(held_ranges(p, dst.tp, tp_rank))
            if src_flat:
                assert not split, "a flat (ZeRO-3) source holds no split experts"
                found = _flat_slices(p, names, src.dp, wanted, itemsize)
            else:
                experts = expert_range(p, dst.ep, q) if split else None
                found = _row_slices(p, names, src, s_stage, wanted, itemsize, experts)
            ranks = [
                layout_rank(r, d_stage, tp_rank, dst.pp, dst.tp)
                for r in range(dst.dp)
                if not split or r % dst.ep == q
            ]
            for c in found:
                needed.setdefault(c, []).extend(ranks)
    return [replace(c, needers=tuple(sorted(set(ranks)))) for c, ranks in needed.items()]


@functools.lru_cache(maxsize=1024)
def _classes(
    spec: ModelSpec, src_pp: int, dst_pp: int, skip_frozen: bool = False
) -> list[tuple[tuple, ParamShard, tuple]]:
    """Parameters that move alike: ((source stage, destination stages), one of them, all their
    names) per shape, split and stages (a tied embedding is needed by the last stage too);
    ``skip_frozen``: a LoRA role's base weights left out."""
    src_stage, dst_stage = stage_of_unit(spec, src_pp), stage_of_unit(spec, dst_pp)
    tied = embedding_name(spec) if spec.tied else None
    classes: dict[tuple, list[ParamShard]] = {}
    for p in param_shards(spec):
        if skip_frozen and p.frozen:
            continue
        stages = (dst_stage[p.unit],) + ((dst_pp - 1,) if p.name == tied and dst_pp > 1 else ())
        classes.setdefault((p.shape, p.tp_dim, p.blocks, src_stage[p.unit], stages), []).append(p)
    return [(key[3:], ps[0], tuple(q.name for q in ps)) for key, ps in classes.items()]


@functools.lru_cache(maxsize=16384)
def _row_slices(
    p: ParamShard,
    names: tuple[str, ...],
    src: Layout,
    stage: int,
    wanted: tuple[tuple[int, int], ...],
    itemsize: int,
    experts: tuple[int, int] | None = None,
) -> list[Content]:
    """The ``wanted`` rows cut where the source's tp shards change (cached: they depend on
    the parameter's shape and the ranks, not on which layers); of routed experts split over
    ep ranks, only the ``experts`` (a range of dim 0) a destination holds, cut where the
    source's ep shares change."""
    if experts is not None:  # from each source ep share holding some of them: its dp ranks
        shares = []
        for s in range(src.ep):
            lo, hi = expert_range(p, src.ep, s)
            x, y = max(lo, experts[0]), min(hi, experts[1])
            mine = set(range(s, src.dp, src.ep))
            for c in _row_slices(p, names, src, stage, wanted, itemsize) if x < y else []:
                holders = tuple(h for h in c.holders if h // (src.pp * src.tp) in mine)
                share, where = c.nbytes * (y - x) // p.shape[0], (x - lo, x - experts[0], y - x)
                shares.append(replace(c, nbytes=share, holders=holders, experts=where))
        return shares
    dim, out = split_dim(p), []
    row_bytes = p.numel // p.shape[dim] * itemsize
    for a, b in wanted:
        src_tps = range(1) if p.tp_dim is None else range(src.tp)  # replicated: any tp rank
        for src_tp in src_tps:
            ranges = held_ranges(p, src.tp, src_tp)
            for lo, hi in ranges:
                x, y = max(a, lo), min(b, hi)
                if x >= y:
                    continue
                holders = tuple(
                    layout_rank(r, stage, tt, src.pp, src.tp)
                    for r in range(src.dp)
                    for tt in (range(src.tp) if p.tp_dim is None else [src_tp])
                )
                src_off, dst_off = local_offset(ranges, x), local_offset(wanted, x)
                nbytes = (y - x) * row_bytes
                out.append(Content(names, dim, x, y, src_off, dst_off, nbytes, holders, ()))
    return out


@functools.lru_cache(maxsize=16384)
def _flat_slices(
    p: ParamShard,
    names: tuple[str, ...],
    dp: int,
    wanted: tuple[tuple[int, int], ...],
    itemsize: int,
) -> list[Content]:
    """The ``wanted`` ranges of ``p``, each from the flat source rank(s) holding it, as
    rectangles of the parameter seen as ``[rows, cols]`` (a 1-D one as one row, one of more
    dims, split along the first, as ``[shape[0], the rest]``: a DeltaNet layer's convolution)."""
    dim = split_dim(p)
    assert len(p.shape) <= 2 or dim == 0, f"{p.name}: a parameter of 3+ dims splits on dim 0"
    rows, cols = (1, p.shape[0]) if len(p.shape) == 1 else (p.shape[0], math.prod(p.shape[1:]))
    part = -(-p.numel // dp)  # ceil: every rank's slice has this length (the last padded)
    out = []
    for a, b in wanted:
        box = (0, rows, a, b) if len(p.shape) == 1 or dim == 1 else (a, b, 0, cols)
        for rank in range(dp):
            for r0, r1, c0, c1 in rectangles(box, rank * part, (rank + 1) * part, cols):
                cross: tuple[int, int] | None = None
                if len(p.shape) == 1:
                    start, stop = c0, c1
                elif dim == 1:
                    start, stop, cross = c0, c1, (r0, r1)
                else:
                    start, stop = r0, r1
                    cross = None if (c0, c1) == (0, cols) else (c0, c1)
                view = ((c1 - c0,), (1,)) if len(p.shape) == 1 else ((r1 - r0, c1 - c0), (cols, 1))
                src_off, dst_off = r0 * cols + c0 - rank * part, local_offset(wanted, start)
                nbytes = (r1 - r0) * (c1 - c0) * itemsize
                out.append(
                    Content(names, dim, start, stop, src_off, dst_off, nbytes, (rank,), (),
                            cross, view)
                )  # fmt: skip
    return out


def rectangles(
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
