"""Moving planned slices inside the actors (``rayhf.realloc.transport``), over a fake transfer
group in one process: buckets, views of the shards, copies and blends."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

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

    def shares(self, peer, n_bytes) -> bool:
        return False

    def begin(self, outgoing) -> None:
        pass  # no shared memory here

    def isend(self, t, peer, tag):
        self.sent[(peer, tag)] = t.clone()
        return self

    def forward(self, received, t, peer, tag):
        return self.isend(t, peer, tag)

    def irecv(self, t, peer, tag):
        t.copy_(self.sent[(0, tag)].view_as(t))
        return self

    def wait(self) -> None:
        pass


class _Net:
    """A fake network between ranks of this process (one thread each): a message is keyed by
    (from, to, tag); a receive blocks until it has been sent. ``in_order``: as NCCL, which
    matches a pair's messages by order, not by tag: a receive must be of the pair's oldest."""

    def __init__(self, in_order: bool = False) -> None:
        self.messages: dict[tuple[int, int, int], torch.Tensor] = {}
        self.log: list[tuple[int, int, int, int]] = []
        self.cv = threading.Condition()
        self.in_order = in_order

    def port(self, rank: int) -> _Port:
        return _Port(self, rank)


class _Port:
    def __init__(self, net: _Net, rank: int) -> None:
        self.net, self.rank = net, rank

    def shares(self, peer, n_bytes) -> bool:
        return False

    def begin(self, outgoing) -> None:
        pass

    def isend(self, t, peer, tag):
        with self.net.cv:
            key = (self.rank, peer, tag)
            assert key not in self.net.messages, "a tag is used once per pair"
            self.net.messages[key] = t.clone()
            self.net.log.append((*key, t.numel() * t.element_size()))
            self.net.cv.notify_all()
        return self

    def forward(self, received, t, peer, tag):
        return self.isend(t, peer, tag)

    def irecv(self, t, peer, tag):
        return _Read(self.net, (peer, self.rank, tag), t)

    def wait(self) -> None:
        pass


class _Read:
    def __init__(self, net: _Net, key: tuple, target: torch.Tensor) -> None:
        self.net, self.key, self.target = net, key, target

    def wait(self) -> None:
        with self.net.cv:
            assert self.net.cv.wait_for(lambda: self.key in self.net.messages, timeout=30)
            if self.net.in_order:
                pair = [k for k in self.net.messages if k[:2] == self.key[:2]]
                assert pair[0] == self.key, f"{self.key} taken before {pair[0]} was"
            self.target.copy_(self.net.messages.pop(self.key).view_as(self.target))


def _run(plan, sources, want, s0: int, d0: int, blend=None, bucket=4096, in_order=False):
    """Every rank's side of ``plan`` at once, a thread each, over a fake network (sources as
    ranks ``s0 + r``, destinations ``d0 + r``): what each destination got and received."""
    import rayhf.realloc.transport as transport

    net = _Net(in_order)
    got = {r: {k: torch.zeros_like(v) for k, v in w.items()} for r, w in want.items()}
    received: dict[int, int] = {}

    def source(r: int) -> None:
        by_peer = _group(plan.for_src(r), lambda t: d0 + t.dst)
        transport.send_all(net.port(s0 + r), sources[r], by_peer, bucket)  # type: ignore[arg-type]

    def destination(r: int) -> None:
        ins = _group(plan.for_dst(r), lambda t: (d0 if t.relay else s0) + t.src)
        outs = _group(plan.relays_from(r), lambda t: d0 + t.dst)
        blended = blend or transport.copy_into
        port = net.port(d0 + r)
        received[r] = transport.recv_all(port, got[r], ins, blended, bucket, outs)  # type: ignore[arg-type]

    with ThreadPoolExecutor(len(want) + len(sources)) as pool:
        jobs = [pool.submit(destination, r) for r in want]
        jobs += [pool.submit(source, r) for r in sources]
        for job in jobs:
            job.result()
    assert not net.messages, "every message was received"
    return got, received, net.log


def _group(transfers, peer_of):
    out: dict[int, list] = {}
    for t in transfers:
        out.setdefault(peer_of(t), []).append(t)
    return out


@pytest.mark.parametrize("direct_bytes", [64, 2**30])
@pytest.mark.parametrize(
    "src, dst",
    [
        (Layout((0,), 1), Layout((1, 2), 1, 2, 1)),  # tp split: each its own slices
        (Layout((0,), 1), Layout((1, 2, 3), 3)),  # one source, three replicas: a relay chain
        (Layout((0, 1), 1, 2), Layout((0, 1, 2, 3), 4)),  # local copies, relays, two senders
    ],
)
def test_streams_rebuild_every_destination_through_relays(monkeypatch, direct_bytes, src, dst):
    import rayhf.realloc.transport as transport

    monkeypatch.setattr(transport, "DIRECT_BYTES", direct_bytes)
    monkeypatch.setattr(transport, "CHUNK_BYTES", 1024)  # several messages per bucket
    spec = _spec("gpt2")
    full = {p.name: torch.randn(p.shape) for p in param_shards(spec)}
    plan = plan_realloc(spec, src, dst)
    want = _shards(spec, full, dst)
    sources = _shards(spec, full, src)
    got, received, log = _run(plan, sources, want, 0, src.world_size, in_order=True)
    for r in want:
        assert all(torch.equal(got[r][k], want[r][k]) for k in want[r]), r
        assert received[r] == sum(t.nbytes for t in plan.for_dst(r))
    assert max(size for *_, size in log) <= max(1024, 4)
    # Blending: received slices are mixed into what is there; relays forward what they got.
    ones = {r: {k: torch.ones_like(v) for k, v in w.items()} for r, w in want.items()}
    mixed, _, _ = _run(plan, _shards(spec, full, src), ones, 0, 8, transport.ema_into(0.5))
    for r in want:
        assert all(torch.allclose(mixed[r][k], 0.5 * want[r][k]) for k in want[r]), r


def test_a_relay_forwards_the_source_s_bytes_once_down_the_chain():
    spec = _spec("llama")
    full = {p.name: torch.randn(p.shape) for p in param_shards(spec)}
    src, dst = Layout((0,), 1), Layout((1, 2, 3, 4), 4)
    plan = plan_realloc(spec, src, dst)
    _, _, log = _run(plan, _shards(spec, full, src), _shards(spec, full, dst), 0, 1)
    sent: dict[int, int] = {}
    for a, _, _, size in log:
        sent[a] = sent.get(a, 0) + size
    model = 4 * sum(v.numel() for v in full.values())
    assert sent[0] == model, "the source sends the model once"
    assert sorted(sent.values()) == [model] * 4, "three replicas forward it once each"


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
