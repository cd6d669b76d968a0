"""Same-host messages through shared memory (``rayhf.realloc.shm``): what one rank's segment
holds, another reads bit for bit; segments of dead owners are swept, live ones are not."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import pytest
import torch

from rayhf.realloc import shm

pytestmark = pytest.mark.skipif(not shm.available(), reason="no writable /dev/shm")


def _pair() -> tuple[shm.Segments, shm.Segments]:
    token = uuid.uuid4().hex[:12]
    a, b = shm.Segments(token, 0), shm.Segments(token, 1)
    assert a.meet(1, os.getpid()) and b.meet(0, os.getpid())
    return a, b


def test_a_message_put_by_one_rank_is_read_bit_for_bit_by_another():
    a, b = _pair()
    try:
        x = torch.randn(3, 1000)
        y = torch.arange(777, dtype=torch.int32).to(torch.bfloat16)
        a.reserve(shm.padded(x.nbytes) + shm.padded(y.nbytes))
        hx, hy = a.put(shm.Parts([x], x.dtype)), a.put(shm.Parts([y], y.dtype))
        assert int(hy[2]) % shm.ALIGN == 0 and int(hy[2]) >= x.nbytes
        out_x, out_y = torch.empty_like(x), torch.empty_like(y)
        b.get(hy, shm.Parts([out_y], y.dtype))
        b.get(hx, shm.Parts([out_x], x.dtype))
        assert torch.equal(out_x, x) and torch.equal(out_y, y)
        with pytest.raises(AssertionError, match="more than it reserved"):
            a.put(shm.Parts([torch.zeros(1)], torch.float32))
    finally:
        a.close()
        b.close()


def test_a_larger_move_gets_a_new_segment_and_the_reader_follows_it():
    a, b = _pair()
    try:
        a.reserve(4096)
        small = a.put(shm.Parts([torch.ones(100)], torch.float32))
        a.reserve(1 << 20)  # the next move sends more
        big = torch.randn(200_000)
        header = a.put(shm.Parts([big], big.dtype))
        assert int(header[1]) == int(small[1]) + 1
        out = torch.empty_like(big)
        b.get(header, shm.Parts([out], big.dtype))
        assert torch.equal(out, big)
        names = [p.name for p in shm.SHM_DIR.glob(f"{shm.PREFIX}{a.token}-r0-*")]
        assert len(names) == 2, f"the marker and the newest segment only: {names}"
    finally:
        a.close()
        b.close()
    assert not list(shm.SHM_DIR.glob(f"{shm.PREFIX}{a.token}-*")), "closing removes the files"


def test_a_peer_on_another_host_is_not_met():
    a = shm.Segments(uuid.uuid4().hex[:12], 0)
    try:
        assert not a.meet(1, 1)  # no marker of rank 1: it does not share this /dev/shm
    finally:
        a.close()


def test_the_segments_of_a_dead_owner_are_swept_and_a_live_owners_kept():
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    gone = shm._path("sweeptest", 0, int(dead.stdout), 1)
    gone.touch()
    a = shm.Segments(uuid.uuid4().hex[:12], 0)
    try:
        assert shm.sweep() >= 1
        assert not gone.exists() and a.marker.exists()
    finally:
        a.close()


def test_any_range_of_pieces_is_a_few_views_of_them_in_order():
    from rayhf.realloc.transport import _splittable, _views

    full = torch.arange(7 * 10, dtype=torch.float32).view(7, 10)
    pieces = [full[:, 3:8], torch.arange(13.0), full[2:5]]  # columns, a vector, rows
    assert all(_splittable(p) for p in pieces) and not _splittable(full.t())
    flat = torch.cat([p.reshape(-1) for p in pieces])
    for lo in range(0, flat.numel(), 3):
        for hi in range(lo + 1, flat.numel() + 1, 4):
            views = _views(pieces, lo, hi)
            assert len(views) <= 3 * len(pieces)
            storages = {piece.untyped_storage().data_ptr() for piece in pieces}
            assert views and all(v.untyped_storage().data_ptr() in storages for v in views)
            assert torch.equal(torch.cat([v.reshape(-1) for v in views]), flat[lo:hi]), (lo, hi)


def test_strided_views_go_into_a_segment_cast_and_come_out_into_strided_views():
    a, b = _pair()
    try:
        src = torch.randn(6, 8)
        dst = torch.zeros(6, 16, dtype=torch.bfloat16)
        message = shm.Parts([src[:, 2:6], src[0]], torch.bfloat16)  # sent as bf16
        a.reserve(shm.padded(message.nbytes))
        header = a.put(message)
        b.get(header, shm.Parts([dst[:, 10:14], dst[5, :8]], torch.bfloat16))
        assert torch.equal(dst[:, 10:14], src[:, 2:6].to(torch.bfloat16))
        assert torch.equal(dst[5, :8], src[0].to(torch.bfloat16))
        assert int((dst != 0).sum()) <= 6 * 4 + 8, "nothing outside the views is written"
    finally:
        a.close()
        b.close()


MOVES = 2


def _move_over_real_groups(plan, sources, want, remote: set[int], blend):
    """Every rank's side of ``plan``, a thread each, over real transfer groups in this process
    (sources ranks 0.., destinations after them); ranks in ``remote`` act as another host's."""
    from concurrent.futures import ThreadPoolExecutor

    from rayhf.parallel.groups import host_store, join_store
    from rayhf.realloc import transport

    d0, n = len(sources), len(sources) + len(want)
    _store, address = host_store()

    def join(r: int) -> transport.TransferGroup:
        return transport.TransferGroup(
            join_store(address), r, n, same_host=r not in remote, shm_min_bytes=0
        )

    with ThreadPoolExecutor(n) as pool:
        groups = list(pool.map(join, range(n)))
    got = {r: {k: torch.ones_like(v) for k, v in w.items()} for r, w in want.items()}

    def by_peer(transfers, peer_of):
        out: dict[int, list] = {}
        for t in transfers:
            out.setdefault(peer_of(t), []).append(t)
        return out

    def side(r: int) -> int:
        if r < d0:
            return transport.send_all(
                groups[r], sources[r], by_peer(plan.for_src(r), lambda t: d0 + t.dst)
            )
        i = r - d0
        ins = by_peer(plan.for_dst(i), lambda t: (d0 if t.relay else 0) + t.src)
        outs = by_peer(plan.relays_from(i), lambda t: d0 + t.dst)
        return transport.recv_all(groups[r], got[i], ins, blend, forward=outs)

    try:
        for _ in range(MOVES):  # a second move reuses the segments
            with ThreadPoolExecutor(n) as pool:
                list(pool.map(side, range(n)))
    finally:
        for g in groups:
            g.close()
    return got, groups


@pytest.mark.parametrize("remote", [set(), {2}, {0, 3}])
@pytest.mark.parametrize("ema", [False, True])
def test_relayed_moves_through_shared_memory_and_sockets_rebuild_every_destination(
    monkeypatch, remote, ema
):
    from realloc_support import _shards, _spec

    from rayhf.models.sharding import param_shards
    from rayhf.parallel.layout import Layout
    from rayhf.realloc import transport
    from rayhf.realloc.plan import plan_realloc

    monkeypatch.setattr(transport, "DIRECT_BYTES", 256)
    monkeypatch.setattr(transport, "CHUNK_BYTES", 1024)  # several messages per bucket
    spec = _spec("llama")
    full = {p.name: torch.randn(p.shape) for p in param_shards(spec)}
    src, dst = Layout((0, 1), 1, 2), Layout((0, 1, 2, 3), 4)  # two senders, relays, columns
    plan = plan_realloc(spec, src, dst)
    assert any(t.relay for t in plan.transfers)
    want = _shards(spec, full, dst)
    blend = transport.ema_into(0.5) if ema else transport.copy_into
    got, groups = _move_over_real_groups(plan, _shards(spec, full, src), want, remote, blend)
    for r in want:
        for k, w in want[r].items():
            expect = 0.25 * 1 + 0.75 * w if ema else w  # two blends of 0.5 from ones
            same = (
                torch.allclose(got[r][k], expect, atol=1e-6)
                if ema
                else torch.equal(got[r][k], expect)
            )
            assert same, (r, k)
    assert sum(g.shm_messages for g in groups) > 0
    assert all(g.local == set() for r, g in enumerate(groups) if r in remote)
