"""Routing a reallocation's slices: who sends which slice to whom. Pure.

A route is a tree: a source rank (the holder) sends the slices to some destination ranks, each
of which may forward them to others. Hops are ``(from, to)``; ``from`` is ``SENDER`` for the
holder, else a destination rank that has received them on an earlier hop of the same route.

The greedy routing here: a needer on a device that holds its slices gets a local copy; the
other needers of a group of slices (same holders, same needers) get them down chains, one per
holder, each holder sending the share that evens out the holders' sending (water filling), and
each chain ends at the needer whose device would otherwise send the most (it forwards nothing).
It meets the move's bound in most layout pairs; ``rayhf.realloc.balance`` solves the others.
"""

from __future__ import annotations

from collections import defaultdict

from rayhf.parallel.layout import Layout
from rayhf.realloc.needs import Content

SENDER = -1  # a hop from the route's sender (a source rank)
Hops = tuple[tuple[int, int], ...]
Route = tuple[int, Hops, list[Content]]  # sender, hops, slices
Group = tuple[tuple[int, ...], tuple[int, ...], list[Content]]  # holders, needers, slices


def chain(*ranks: int) -> Hops:
    """Hops down a chain: the sender to ``ranks[0]``, which forwards to ``ranks[1]``, ..."""
    return tuple(zip((SENDER, *ranks[:-1]), ranks, strict=True))


def split_local(found: list[Content], src: Layout, dst: Layout) -> tuple[list[Route], list[Group]]:
    """Local copies (a needer on a device that holds the slices gets them from the holder
    there, by (holder, needer)), and the groups the other needers form."""
    alike: dict[tuple, list[Content]] = defaultdict(list)  # slices with the same ranks
    for c in found:
        alike[c.holders, c.needers].append(c)
    local: dict[tuple[int, int], list[Content]] = defaultdict(list)
    remote: dict[tuple, list[Content]] = defaultdict(list)
    for (holders, needers), cs in alike.items():
        on_device = {src.mesh[h]: h for h in reversed(holders)}  # the first holder there
        far = []
        for n in needers:
            h = on_device.get(dst.mesh[n])
            if h is None:
                far.append(n)
            else:
                local[h, n] += cs
        if far:
            remote[holders, tuple(far)] += cs
    copies: list[Route] = [(h, ((SENDER, n),), cs) for (h, n), cs in local.items()]
    return copies, [(holders, needers, cs) for (holders, needers), cs in remote.items()]


def send_floor(groups: list[Group], src: Layout) -> int:
    """The least the busiest device must send: for each set of holders, what only they hold
    and other devices need, shared evenly among them (each byte leaves its holders once)."""
    held: dict[frozenset[int], int] = defaultdict(int)
    for holders, _, cs in groups:
        held[frozenset(src.mesh[h] for h in holders)] += total_bytes(cs)
    floor = 0
    for devices in held:
        within = sum(b for other, b in held.items() if other <= devices)
        floor = max(floor, -(-within // len(devices)))
    return floor


def greedy_routes(groups: list[Group], src: Layout, dst: Layout, relay: bool) -> list[Route]:
    """Each group's slices cut among its holders, then sent down one chain of its needers per
    holder (``relay``), or straight to every needer."""
    load: dict[int, int] = defaultdict(int)  # device -> bytes it sends
    shares = _shares(groups, src, load, relay)
    sized = sorted(((total_bytes(parts), key, parts) for key, parts in shares.items()),
                   key=lambda x: -x[0])  # fmt: skip
    ordered = [(key, parts) for _, key, parts in sized]
    if not relay:  # point to point: a stream per needer
        return [(h, chain(n), parts) for (h, needers), parts in ordered for n in needers]
    lasts = _spare(ordered, [b for b, _, _ in sized], dst, load)
    return [
        (h, chain(*(n for n in needers if n != last), last), parts)
        for ((h, needers), parts), last in zip(ordered, lasts, strict=True)
    ]


def total_bytes(cs: list[Content]) -> int:
    return sum(c.total_bytes for c in cs)


def _shares(
    groups: list[Group], src: Layout, load: dict[int, int], relay: bool
) -> dict[tuple[int, tuple[int, ...]], list[Content]]:
    """Every slice cut among its holders so that their devices' sending evens out (one part
    per holder at most): by (holder, needers), the parts it sends."""
    out: dict[tuple[int, tuple[int, ...]], list[Content]] = defaultdict(list)
    # slices with fewer holders first: the rest then even out what those forced
    for holders, needers, cs in sorted(groups, key=lambda g: len(g[0])):
        copies = 1 if relay else len(needers)
        if len(holders) == 1:  # nothing to even out
            out[holders[0], needers] += cs
            load[src.mesh[holders[0]]] += total_bytes(cs) * copies
            continue
        for c in sorted(cs, key=lambda c: -c.total_bytes):  # the small ones even out the rest
            for h, part in _fill(c, holders, src, load, copies):
                load[src.mesh[h]] += part.total_bytes * copies
                out[h, needers].append(part)
    return out


def _fill(
    c: Content, holders: tuple[int, ...], src: Layout, load: dict[int, int], copies: int
) -> list[tuple[int, Content]]:
    """``c``'s rows among ``holders``, the least loaded first, each up to a common level
    (water filling, whole rows); a flat source's slices have one holder."""
    order = sorted(holders, key=lambda r: (load[src.mesh[r]], r))
    if len(holders) == 1 or c.src_view is not None:
        return [(order[0], c)]
    row = c.total_bytes // (c.stop - c.start) * copies
    loads = [load[src.mesh[h]] for h in order]
    rows_left, k = c.stop - c.start, 1
    level, budget = float(loads[0]), float(rows_left * row)
    while k < len(order) and (loads[k] - level) * k <= budget:  # raise the k least loaded
        budget -= (loads[k] - level) * k
        level, k = float(loads[k]), k + 1
    level += budget / k
    take = [min(rows_left, max(0, int((level - loads[i]) // row))) for i in range(k)]
    for _ in range(rows_left - sum(take)):  # what rounding left: to the least loaded after
        i = min(range(k), key=lambda i: loads[i] + (take[i] + 1) * row)
        take[i] += 1
    out, start = [], c.start
    for h, n in zip(order, take, strict=False):
        if n > 0:
            out.append((h, c.rows(start, start + n)))
            start += n
    return out


def _spare(
    ordered: list[tuple[tuple[int, tuple[int, ...]], list[Content]]],
    sizes: list[int],
    dst: Layout,
    load: dict[int, int],
) -> list[int]:
    """Each chain's last needer, which forwards nothing: the one whose device would send the
    most (``load``: first hops, plus every chain it is in), largest chains first; then, while
    it lowers the busiest device, that device takes the last place of a chain from another."""
    load = defaultdict(int, load)
    for ((_, needers), _), b in zip(ordered, sizes, strict=True):
        for n in needers if len(needers) > 1 else ():
            load[dst.mesh[n]] += b
    lasts: list[int] = []
    for ((h, needers), _), b in zip(ordered, sizes, strict=True):
        last = max(needers, key=lambda n: (load[dst.mesh[n]], (h - n) % dst.world_size))
        if len(needers) > 1:
            load[dst.mesh[last]] -= b
        lasts.append(last)
    for _ in range(4 * len(ordered)):  # each swap lowers the busiest device, or their number
        busiest = max(load, key=lambda d: load[d])
        swap = next(
            (
                (i, n)
                for i, ((_, needers), _) in enumerate(ordered)
                for n in needers
                if dst.mesh[n] == busiest
                and lasts[i] != n
                and load[dst.mesh[lasts[i]]] + sizes[i] < load[busiest]
            ),
            None,
        )
        if swap is None:
            break
        i, n = swap
        load[busiest] -= sizes[i]
        load[dst.mesh[lasts[i]]] += sizes[i]
        lasts[i] = n
    return lasts
