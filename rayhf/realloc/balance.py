"""The exact routing, for moves the greedy one leaves above their bound: a linear program picks
how many bytes of each group of slices every holder and every needer sends, so that the busiest
device sends the least; the routes are then cut to match. Pure (scipy's HiGHS solver).

A group is the slices some holders hold and some needers need (``B`` bytes, ``n`` needers).
Every needer receives each byte once, so the group's sending adds up to ``B * n``, shared by

    holders:  y_h >= 0 each, together >= B (every byte leaves a holder)
    needers:  x_v >= 0 each (what they forward of what they received)

minimizing ``T``, the most any device sends over all groups (a device may hold or need slices
of many groups). Any such split can be routed: the holders cut the bytes into parts in
proportion to ``y``; every needer forwards ``x_v / B`` copies of every part on average, its
share laid out round a circle of length 1 after the others' (McNaughton's wrap-around rule), so
at every byte the needers forward ``ceil`` or ``floor`` of the total, at most ``n - 1``
copies, and the holder sends the rest. A byte's copies form a tree: the holder and the needers
that forward, each sending as many copies as its share covers that byte. Cuts fall on whole
rows of one parameter, so the busiest device may exceed ``T`` by a few rows.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from dataclasses import replace

from rayhf.parallel.layout import Layout
from rayhf.realloc.needs import Content
from rayhf.realloc.route import SENDER, Group, Hops, Route, total_bytes

RELAY_COST = 1e-6  # of T per byte forwarded: among the best splits, the fewest relays


def balanced_routes(groups: list[Group], src: Layout, dst: Layout) -> tuple[list[Route], float]:
    """Routes for every group that minimize the busiest device's sending, and that least
    (no routing through the devices that hold or need each slice sends less)."""
    sends, forwards, least = _solve(groups, src, dst)
    out: list[Route] = []
    for (holders, needers, cs), y, x in zip(groups, sends, forwards, strict=True):
        out += _realize(holders, needers, cs, y, x)
    return out, least


def _solve(
    groups: list[Group], src: Layout, dst: Layout
) -> tuple[list[list[float]], list[list[float]], float]:
    """Per group, the bytes each holder sends and each needer forwards; and ``T``."""
    import numpy as np
    from scipy.optimize import linprog
    from scipy.sparse import coo_matrix

    scale = max(total_bytes(cs) for _, _, cs in groups)  # in units of the largest group
    columns: list[tuple[int, int, bool]] = []  # (group, device, a needer's)
    for g, (holders, needers, _) in enumerate(groups):
        columns += [(g, src.mesh[h], False) for h in holders]
        columns += [(g, dst.mesh[n], True) for n in needers]
    t = len(columns)  # the last column: T
    devices = sorted({d for _, d, _ in columns})
    row_of = {d: len(groups) + i for i, d in enumerate(devices)}
    eq: tuple[list, list, list] = ([], [], [])  # per group: all it sends = B * n
    ub: tuple[list, list, list] = ([], [], [])  # per group: forwarded <= B * (n - 1);
    for j, (g, d, needer) in enumerate(columns):  # per device: sent - T <= 0
        _put(eq, g, j)
        if needer:
            _put(ub, g, j)
        _put(ub, row_of[d], j)
    for d in devices:
        _put(ub, row_of[d], t, -1.0)
    sizes = [total_bytes(cs) / scale for _, _, cs in groups]
    b_eq = [b * len(n) for b, (_, n, _) in zip(sizes, groups, strict=True)]
    b_ub = [b * (len(n) - 1) for b, (_, n, _) in zip(sizes, groups, strict=True)]
    cost = np.array([RELAY_COST if needer else 0.0 for _, _, needer in columns] + [1.0])
    res = linprog(
        cost,
        A_ub=coo_matrix((ub[2], (ub[0], ub[1])), shape=(len(b_ub) + len(devices), t + 1)),
        b_ub=b_ub + [0.0] * len(devices),
        A_eq=coo_matrix((eq[2], (eq[0], eq[1])), shape=(len(b_eq), t + 1)),
        b_eq=b_eq,
        bounds=(0.0, None),
        method="highs",
    )
    assert res.status == 0, f"reallocation balance: {res.message}"
    sends: list[list[float]] = [[] for _ in groups]
    forwards: list[list[float]] = [[] for _ in groups]
    for (g, _, forwarder), value in zip(columns, res.x[:t], strict=True):
        (forwards if forwarder else sends)[g].append(max(0.0, float(value)) * scale)
    return sends, forwards, float(res.x[t]) * scale


def _put(m: tuple[list, list, list], row: int, col: int, value: float = 1.0) -> None:
    m[0].append(row)
    m[1].append(col)
    m[2].append(value)


def _realize(
    holders: tuple[int, ...],
    needers: tuple[int, ...],
    cs: list[Content],
    sends: list[float],
    forwards: list[float],
) -> list[Route]:
    """Routes that make each holder send ``sends`` and each needer forward ``forwards``."""
    total, shares = total_bytes(cs), sum(sends)
    copies = [f / total for f in forwards]  # of every byte, how many copies each forwards
    arcs = _arcs(copies, len(needers))
    out: list[Route] = []
    parts = _cut(cs, _cumulative([y / shares for y in sends]))
    for h, part in zip(holders, parts, strict=True):
        pieces = _cut(part, [hi for _, hi, _ in arcs])
        out += [(h, _tree(needers, d), p) for (_, _, d), p in zip(arcs, pieces, strict=True) if p]
    return out


def _cumulative(fractions: list[float]) -> list[float]:
    out, edge = [], 0.0
    for f in fractions:
        edge += f
        out.append(edge)
    out[-1] = 1.0
    return out


def _arcs(copies: list[float], n: int) -> list[tuple[float, float, list[int]]]:
    """``copies`` laid end to end on the real line and wound round a circle of length 1: the
    arcs between breakpoints, each with how many times each share covers it (together at most
    ``n - 1``: the holder sends at least one copy)."""
    ends = [0.0]
    for c in copies:
        ends.append(ends[-1] + c)
    cuts = sorted({0.0, 1.0} | {e - math.floor(e) for e in ends})
    out = []
    for lo, hi in itertools.pairwise(cuts):
        if hi - lo <= 1e-12:
            continue
        mid = (lo + hi) / 2
        degrees = [math.ceil(b - mid) - math.ceil(a - mid) for a, b in itertools.pairwise(ends)]
        while sum(degrees) > n - 1:  # a sliver past the bound (rounding): trim the largest
            degrees[degrees.index(max(degrees))] -= 1
        out.append((lo, hi, degrees))
    return out


def _tree(needers: tuple[int, ...], degrees: list[int]) -> Hops:
    """Hops over ``needers`` in which needer i forwards to ``degrees[i]`` others and the sender
    to the rest: those that forward are placed first, breadth first, so every one has received
    before it sends."""
    order = sorted(range(len(needers)), key=lambda i: degrees[i] == 0)
    slots = deque([(SENDER, len(needers) - sum(degrees))])
    hops = []
    for i in order:
        parent, left = slots[0]
        hops.append((parent, needers[i]))
        if left == 1:
            slots.popleft()
        else:
            slots[0] = (parent, left - 1)
        if degrees[i] > 0:
            slots.append((needers[i], degrees[i]))
    return tuple(hops)


def _cut(cs: list[Content], edges: list[float]) -> list[list[Content]]:
    """``cs`` (in order) cut at ``edges`` (increasing fractions of its bytes, the last 1.0)
    into consecutive pieces, each cut on a row boundary of one parameter (a flat source's
    slices: between parameters)."""
    total = total_bytes(cs)
    pieces: list[list[Content]] = []
    rest, done = list(cs), 0
    for edge in edges:
        head, rest = _take(rest, int(edge * total + 0.5) - done)
        pieces.append(head)
        done += total_bytes(head)
    pieces[-1] += rest  # what rounding left over
    return pieces


def _take(cs: list[Content], want: int) -> tuple[list[Content], list[Content]]:
    """The first ``want`` bytes of ``cs`` (to the nearest row) and the rest."""
    head: list[Content] = []
    for i, c in enumerate(cs):
        if want <= 0:
            return head, cs[i:]
        if c.total_bytes <= want:
            head.append(c)
            want -= c.total_bytes
            continue
        k, rem = divmod(want, c.nbytes)  # whole parameters, then rows of the next
        rows = int(rem * (c.stop - c.start) / c.nbytes + 0.5) if c.src_view is None else 0
        names = c.names
        tail = [replace(c, names=names[k + 1 :])] if k + 1 < len(names) else []
        if k:
            head.append(replace(c, names=names[:k]))
        one = replace(c, names=(names[k],))
        if rows >= c.stop - c.start:
            head.append(one)
        elif rows > 0:
            head.append(one.rows(c.start, c.start + rows))
            tail.insert(0, one.rows(c.start + rows, c.stop))
        else:
            tail.insert(0, one)
        return head, tail + cs[i + 1 :]
    return head, []
