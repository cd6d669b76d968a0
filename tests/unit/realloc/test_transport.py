"""Moving planned slices inside the actors (``rayhf.realloc.transport``), over a fake transfer
group in one process: buckets, views of the shards, copies and blends."""

from __future__ import annotations

import pytest
import torch
from realloc_support import _shards, _spec

from rayhf.models.sharding import param_shards
from rayhf.parallel.layout import Layout
from rayhf.realloc.plan import Transfer, plan_realloc


class _Mailbox:
    """A fake transfer group: sends land in a dict, receives read from it (one process)."""

    def __init__(self) -> None:
        self.sent: dict[tuple[int, int], torch.Tensor] = {}

    def isend(self, t, peer, tag):
        self.sent[(peer, tag)] = t.clone()
        return self

    def irecv(self, t, peer, tag):
        self.pending = (t, peer, tag)
        t.copy_(self.sent[(0, tag)].view_as(t))
        return self

    def wait(self) -> None:
        pass


@pytest.mark.parametrize("direct_bytes", [64, 2**30])
def test_bucketed_send_and_receive_rebuild_the_shards(monkeypatch, direct_bytes):
    import rayhf.realloc.transport as transport

    monkeypatch.setattr(transport, "DIRECT_BYTES", direct_bytes)
    spec = _spec("gpt2")
    full = {p.name: torch.randn(p.shape) for p in param_shards(spec)}
    src, dst = Layout((0,), 1), Layout((1, 2), 1, 2, 1)
    plan = plan_realloc(spec, src, dst)
    source = _shards(spec, full, src)[0]
    for d_rank, want in _shards(spec, full, dst).items():
        box = _Mailbox()
        mine = [t for t in plan.for_src(0) if t.dst == d_rank]
        transport.send_all(box, source, {0: mine}, bucket_bytes=4096)  # type: ignore[arg-type]
        got = {k: torch.zeros_like(v) for k, v in want.items()}
        n = transport.recv_all(box, got, {0: mine}, bucket_bytes=4096)  # type: ignore[arg-type]
        assert n == sum(t.nbytes for t in mine)
        assert all(torch.equal(got[k], want[k]) for k in want)
        # Blending: received slices are mixed into what is there.
        mixed = {k: torch.ones_like(v) for k, v in want.items()}
        transport.recv_all(box, mixed, {0: mine}, transport.ema_into(0.5), 4096)  # type: ignore[arg-type]
        assert all(torch.allclose(mixed[k], 0.5 * want[k] + 0.5) for k in want)


def test_slices_are_cast_to_the_dtype_they_travel_in():
    """fp32 master weights to a bf16 copy: the wire and the copy hold bf16, rounded once."""
    import rayhf.realloc.transport as transport

    spec = _spec("llama")
    full = {p.name: torch.randn(p.shape) for p in param_shards(spec)}
    layout = Layout((0,), 1)
    plan = plan_realloc(spec, layout, layout, itemsize=2)
    source = _shards(spec, full, layout)[0]
    box = _Mailbox()
    transport.send_all(box, source, {0: plan.transfers}, dtype=torch.bfloat16)  # type: ignore[arg-type]
    assert {t.dtype for t in box.sent.values()} == {torch.bfloat16}
    got = {k: torch.zeros_like(v, dtype=torch.bfloat16) for k, v in source.items()}
    n = transport.recv_all(box, got, {0: plan.transfers})  # type: ignore[arg-type]
    assert n == plan.total_bytes == sum(v.numel() for v in full.values()) * 2
    assert all(torch.equal(got[k], source[k].to(torch.bfloat16)) for k in got)


def _t(name: str, nbytes: int) -> Transfer:
    return Transfer(name, 0, 0, nbytes // 4, 0, 0, 0, 0, nbytes)


def test_small_transfers_share_buckets_in_order_and_large_ones_travel_alone(monkeypatch):
    import rayhf.realloc.transport as transport

    monkeypatch.setattr(transport, "DIRECT_BYTES", 100)
    a, b, c, big, d, e = (_t(n, s) for n, s in zip("abcXde", (40, 40, 40, 100, 8, 60), strict=True))
    got = transport.buckets([a, b, c, big, d, e], bucket_bytes=80)
    assert got == [[a, b], [c], [big], [d, e]]
    assert transport.buckets([], bucket_bytes=80) == []


def test_pieces_are_views_of_the_shards():
    from rayhf.realloc.transport import dst_piece, src_piece

    shard = {"w": torch.arange(20.0).view(5, 4)}
    rows = Transfer("w", 0, 2, 4, 0, 0, 1, 3, 32)
    assert torch.equal(src_piece(shard, rows), shard["w"][1:3])
    assert torch.equal(dst_piece(shard, rows), shard["w"][3:5])
    corner = Transfer("w", 0, 2, 4, 0, 0, 1, 0, 16, cross=(1, 3))
    assert torch.equal(src_piece(shard, corner), shard["w"][1:3, 1:3])
    flat = {"w": torch.arange(12.0)}
    strided = Transfer("w", 0, 0, 2, 0, 0, 1, 0, 24, src_view=((2, 3), (4, 1)))
    piece = src_piece(flat, strided)
    assert piece.tolist() == [[1.0, 2.0, 3.0], [5.0, 6.0, 7.0]]
    flat["w"][5] = -1.0
    assert piece[1, 0] == -1.0, "a view, not a copy"


class _Source:
    def __init__(self, shards: dict[str, torch.Tensor]) -> None:
        self.shards = shards

    def source_shards(self) -> dict[str, torch.Tensor]:
        return self.shards


class _Sink:
    def __init__(self, buffers: dict[str, torch.Tensor]) -> None:
        self.buffers, self.calls = buffers, 0

    def receive_buffers(self) -> dict[str, torch.Tensor]:
        return self.buffers

    def received(self) -> None:
        self.calls += 1


def test_a_rank_s_side_of_a_move_fills_its_sink_and_tells_it():
    from rayhf.realloc.transport import ema_into, receive_into, send_from

    spec = _spec("llama")
    full = {p.name: torch.randn(p.shape) for p in param_shards(spec)}
    src, dst = Layout((0, 1), 1, 2), Layout((2,), 1)
    plan = plan_realloc(spec, src, dst)
    sources = _shards(spec, full, src)
    want = _shards(spec, full, dst)[0]
    sink = _Sink({k: torch.zeros_like(v) for k, v in want.items()})
    for s_rank in range(2):
        box = _Mailbox()
        mine = [t for t in plan.for_src(s_rank) if t.dst == 0]
        sent = send_from(box, _Source(sources[s_rank]), {0: mine})  # type: ignore[arg-type]
        assert sent == sum(t.nbytes for t in mine) > 0
        assert receive_into(box, sink, {0: mine}) == sent  # type: ignore[arg-type]
    assert sink.calls == 2
    assert all(torch.equal(sink.buffers[k], want[k]) for k in want)
    blend = ema_into(0.25)
    dst_t = torch.ones(3)
    blend(dst_t, torch.full((3,), 5.0))
    assert dst_t.tolist() == [2.0, 2.0, 2.0]
