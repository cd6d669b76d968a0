"""How a step's batch flows between calls (``rayhf.runtime.flow``): pure functions over packed
batches, no Ray."""

from __future__ import annotations

import pytest
import torch

from rayhf.data.batch import PackedBatch
from rayhf.runtime.flow import (
    assemble,
    balance_key,
    call_inputs,
    join_replicas,
    rename_outputs,
    replica_share,
    share_balance,
)


def _batch(ids: list[int], **lens: list[int]) -> PackedBatch:
    """Sample ``s`` owns rows ``100 * s + j`` of every key (so order is visible in the values)."""
    tensors = {
        key: torch.tensor([100 * s + j for s, n in zip(ids, ns, strict=True) for j in range(n)])
        for key, ns in lens.items()
    }
    return PackedBatch(list(ids), tensors, {k: list(v) for k, v in lens.items()})


def test_the_balance_key_is_the_first_preferred_one_present():
    batch = _batch([0, 1], prompts=[2, 3], seq=[4, 5])
    assert balance_key(batch, ("seq", "prompts")) == "seq"
    assert balance_key(batch, ("chosen", "prompts")) == "prompts"
    assert balance_key(batch, ("chosen",)) == "prompts", "else the batch's first key"
    assert balance_key(PackedBatch([0]), ("seq",)) is None


def test_replicas_of_the_same_samples_are_joined_in_the_step_s_order():
    parts = [_batch([2, 0], v=[1, 2]), _batch([], v=[]), _batch([1], v=[3])]
    joined = join_replicas(parts, order=[0, 1, 2])
    assert joined is not None and joined.sample_ids == [0, 1, 2]
    assert joined.tensors["v"].tolist() == [0, 1, 100, 101, 102, 200]
    new = join_replicas([_batch([7, 5], v=[1, 1]), _batch([6], v=[1])], order=[0, 1, 2])
    assert new is not None and new.sample_ids == [7, 5, 6], "new samples keep replica order"
    assert join_replicas([_batch([], v=[])], order=[0]) is None


def test_new_samples_start_a_new_batch_and_later_outputs_join_it():
    base = _batch([0, 1], prompts=[2, 2])
    grouped = assemble(
        base,
        [
            ("gen", [_batch([10, 11], seq=[3, 3]), _batch([12, 13], seq=[3, 3])]),
            ("score", [_batch([13, 12, 11, 10], scores=[1, 1, 1, 1])]),
        ],
    )
    assert grouped.sample_ids == [10, 11, 12, 13] and grouped.keys() == ["seq", "scores"]
    assert grouped.tensors["scores"].tolist() == [1000, 1100, 1200, 1300]
    same = assemble(base, [("inf", [_batch([1], v=[1]), _batch([0], v=[2])]), ("none", [])])
    assert same.keys() == ["prompts", "v"] and same.tensors["v"].tolist() == [0, 1, 100]
    assert base.keys() == ["prompts"], "the step input is left alone"


def test_calls_read_and_write_their_interface_s_names():
    batch = _batch([0, 1], seq=[2, 3], ref_logprobs=[1, 2])
    view = call_inputs(batch, {"seq": "seq", "logprobs": "ref_logprobs"}, "ref_inf")
    assert view.keys() == ["seq", "logprobs"]
    assert torch.equal(view.tensors["logprobs"], batch.tensors["ref_logprobs"])
    with pytest.raises(RuntimeError, match="call 'train' reads 'values', which is not in the"):
        call_inputs(batch, {"values": "values"}, "train")
    out = rename_outputs(view, {"logprobs": "ref_logprobs"}, "ref_inf")
    assert out.keys() == ["ref_logprobs"] and out.seqlens["ref_logprobs"] == [1, 2]
    with pytest.raises(RuntimeError, match="call 'ref_inf' did not produce 'values'"):
        rename_outputs(view, {"values": "values"}, "ref_inf")


def test_every_replica_takes_its_own_token_balanced_share():
    batch = _batch([0, 1, 2, 3, 4, 5], prompts=[1] * 6, seq=[5, 1, 1, 1, 1, 1])
    shares = [replica_share(batch, 2, r, ("seq",)) for r in range(2)]
    assert sorted(i for s in shares for i in s.sample_ids) == list(range(6))
    assert [s.n_tokens("seq") for s in shares] == [5, 5]
    by_prompts = [replica_share(batch, 2, r, ("prompts",)) for r in range(2)]
    assert [s.n_samples for s in by_prompts] == [3, 3]
    assert replica_share(batch, 1, 0, ("seq",)).sample_ids == list(range(6))


def test_the_balance_of_the_shares_against_a_split_by_rows():
    batch = _batch([0, 1, 2, 3, 4, 5], seq=[5, 1, 1, 1, 1, 1])  # 10 tokens: 5 a share
    assert share_balance(batch, 2, ("seq",)) == {"tokens": 1.0, "by_rows": 7 / 5}
    assert share_balance(batch, 1, ("seq",)) == {}
    long_tail = _batch([0, 1, 2], seq=[9, 1, 2])  # one row over the mean: no split evens it
    assert share_balance(long_tail, 2, ("seq",)) == {"tokens": 9 / 6, "by_rows": 10 / 6}


def test_row_extras_follow_their_samples_through_every_call():
    """A row's ground truth reaches the reward of each of its answers, whatever the splits."""
    base = _batch([0, 1, 2], prompts=[2, 2, 2])
    base.add_extra("answer", ["a0", "a1", "a2"])
    view = call_inputs(base, {"prompts": "prompts"}, "gen")
    shares = [replica_share(view, 2, r, ("prompts",)) for r in range(2)]
    assert sorted(i for s in shares for i in s.sample_ids) == [0, 1, 2]
    assert all(s.extras["answer"] == [f"a{i}" for i in s.sample_ids] for s in shares)
    answers = []
    for share in shares:  # each replica samples 2 answers per prompt: new sample ids 10 * p + j
        ids = [10 * p + j for p in share.sample_ids for j in range(2)]
        out = _batch(ids, seq=[3] * len(ids))
        out.add_extra("answer", [a for a in share.extras["answer"] for _ in range(2)])
        answers.append(rename_outputs(out, {"seq": "seq"}, "gen"))
    grouped = assemble(base, [("gen", answers)])
    assert sorted(grouped.sample_ids) == [0, 1, 10, 11, 20, 21]
    pairs = zip(grouped.sample_ids, grouped.extras["answer"], strict=True)
    assert all(a == f"a{sid // 10}" for sid, a in pairs)
    reward_view = call_inputs(grouped.reorder(sorted(grouped.sample_ids)), {"seq": "seq"}, "rew")
    assert reward_view.extras["answer"] == ["a0", "a0", "a1", "a1", "a2", "a2"]
