import random

import torch

from rayhf.data.batch import PackedBatch, balanced_partition


def _batch(lengths):
    b = PackedBatch(list(range(100, 100 + len(lengths))))
    b.add("seq", torch.arange(sum(lengths)), lengths)
    b.add("score", torch.arange(len(lengths), dtype=torch.float32), [1] * len(lengths))
    return b


def test_split_concat_reorder_roundtrip():
    lengths = [5, 1, 7, 3, 3, 9, 2]
    b = _batch(lengths)
    parts = b.split(3, by_key="seq")
    assert sum(p.n_samples for p in parts) == len(lengths)
    joined = PackedBatch.concat(parts).reorder(b.sample_ids)
    assert joined.sample_ids == b.sample_ids
    assert torch.equal(joined.tensors["seq"], b.tensors["seq"])
    assert joined.seqlens == b.seqlens
    # each sample keeps its own rows
    for p in parts:
        for i, sid in enumerate(p.sample_ids):
            j = b.sample_ids.index(sid)
            assert torch.equal(p.sample("seq", i), b.sample("seq", j))


def test_balanced_partition_bound():
    rng = random.Random(0)
    for _ in range(200):
        costs = [rng.randint(1, 50) for _ in range(rng.randint(1, 40))]
        n = rng.randint(1, 6)
        groups = balanced_partition(costs, n)
        assert sorted(i for g in groups for i in g) == list(range(len(costs)))
        loads = [sum(costs[i] for i in g) for g in groups]
        assert max(loads) <= sum(costs) / n + max(costs)


def test_padded_roundtrip():
    b = _batch([2, 4, 1])
    padded, mask = b.to_padded("seq", -1)
    assert padded.shape == (3, 4)
    assert padded[0, 2].item() == -1 and mask.sum().item() == 7
    assert torch.equal(padded[mask], b.tensors["seq"])  # the valid rows, in order


def test_split_more_parts_than_samples_gives_empty_parts():
    b = _batch([3, 2])
    parts = b.split(4, by_key="seq")
    assert [p.n_samples for p in parts].count(0) == 2
    assert sum(p.n_tokens("seq") for p in parts) == 5
