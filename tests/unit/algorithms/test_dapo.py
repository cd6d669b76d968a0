"""DAPO's parts (Yu et al., 2025) on hand-computed cases: the asymmetric clip, the soft overlong
punishment (eq. 13) and its default buffer, the groups dynamic sampling keeps, how a refill picks
them and when it stops, the loss aggregations the PPO family shares, and the settings DAPO
refuses."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

import rayhf
from rayhf.algorithms.dapo import DAPOConfig, overlong_shaping
from rayhf.algorithms.grpo import GRPOConfig, grpo_loss
from rayhf.algorithms.interface import InterfaceSettings
from rayhf.algorithms.ppo import PPOConfig, aggregate
from rayhf.algorithms.refill import GroupRefill, Progress
from rayhf.algorithms.seqs import informative_groups
from rayhf.config.registry import make_interface
from rayhf.data.batch import PackedBatch
from rayhf.sampling import GenerationConfig

REPO = Path(__file__).resolve().parents[3]

MASK = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.bool)


def test_clip_higher_lets_a_ratio_rise_further_than_it_may_fall():
    cfg = DAPOConfig(eps_clip=0.2, eps_clip_high=0.28)
    old = torch.zeros(2, 3)
    # ratios 1.25 (inside [0.8, 1.28]), 1.35 (above) and 0.7 (below) for A > 0; 0.7 for A < 0
    logp = torch.log(torch.tensor([[1.25, 1.35, 0.7], [0.7, 1.0, 1.0]])).requires_grad_(True)
    adv = torch.tensor([1.0, -1.0])
    loss, stats = grpo_loss(logp, old, old, adv, MASK, cfg)
    # A > 0: max(-r, -clip(r)); 1.35 is clipped to 1.28, 0.7 keeps -0.7 (the larger loss is
    # -0.7 against -0.8). A < 0 at 0.7: max(0.7, 0.8) = 0.8, clipped.
    per_token = [-1.25, -1.28, -0.7, 0.8]
    assert loss.item() == pytest.approx(sum(per_token) / 4)
    assert stats["clip_frac"] == pytest.approx(2 / 4)
    loss.backward()
    assert logp.grad[0, 0] != 0 and logp.grad[0, 1] == 0 and logp.grad[1, 0] == 0
    grpo = grpo_loss(logp, old, old, adv, MASK, GRPOConfig(eps_clip=0.2, kl_coef=0.0))[0]
    assert grpo.item() == pytest.approx((-1.2 - 1.2 - 0.7 + 0.8) / 4)  # symmetric: 1.25 clips


def test_overlong_shaping_by_hand():
    lengths = torch.tensor([10, 16, 17, 19, 20, 25])
    shaped = overlong_shaping(lengths, max_len=20, buffer=4, penalty=0.5)
    # 0 up to 20 - 4 = 16 tokens, then -0.5 * (len - 16) / 4, -0.5 from 20 on
    assert shaped.tolist() == pytest.approx([0.0, 0.0, -0.125, -0.375, -0.5, -0.5])
    assert overlong_shaping(lengths, 20, 0, 1.0).tolist() == [0.0] * 6


def test_the_overlong_buffer_is_a_fifth_of_the_limit_unless_set():
    assert DAPOConfig().overlong_buffer is None
    assert DAPOConfig().overlong_tokens(20480) == 4096  # the paper's recipe
    assert DAPOConfig().overlong_tokens(20) == 4
    assert DAPOConfig(overlong_buffer=0).overlong_tokens(20480) == 0  # off
    assert DAPOConfig(overlong_buffer=7).overlong_tokens(20480) == 7
    cfg = rayhf.load_config(REPO / "examples" / "dapo_tiny.yaml")
    unset = cfg.with_overrides({"algorithm.overlong_buffer": None})  # the experiment checks it
    assert unset.algorithm.overlong_tokens(unset.generation.max_new_tokens) == 4


class OneRank:
    """What DAPO's advantages need of an engine: the group members of every dp rank (one)."""

    def all_gather_object(self, obj):
        return [obj]


def test_the_default_buffer_shapes_the_advantages():
    # one group, equal scores; responses of 7, 8, 9 and 10 tokens against max_new_tokens 10:
    # the default buffer (10 // 5 = 2) takes 0, 0, 0.5 and 1 off, so the longer ones lose
    batch = PackedBatch([0, 1, 2, 3])
    batch.add("seq", torch.zeros(38, dtype=torch.long), [8, 9, 10, 11])
    batch.add("prompt_lens", torch.ones(4, dtype=torch.long), [1] * 4)
    batch.add("scores", torch.ones(4), [1] * 4)
    batch.add("group_ids", torch.zeros(4, dtype=torch.long), [1] * 4)

    def advantages(cfg: DAPOConfig) -> list[float]:
        actor = make_interface(
            "dapo_actor", InterfaceSettings(cfg, GenerationConfig(max_new_tokens=10))
        )
        return actor.advantages(OneRank(), batch, rank=0).tolist()  # type: ignore[attr-defined]

    adv = advantages(DAPOConfig())
    assert adv[0] == adv[1] > 0 > adv[2] > adv[3]
    assert advantages(DAPOConfig(overlong_buffer=0)) == [0.0] * 4


def test_the_groups_dynamic_sampling_keeps():
    scores = torch.tensor([1.0, 1.0, 0.0, 0.5, 0.5, 0.5, 0.0, 0.2, 7.0])
    groups = torch.tensor([4, 4, 4, 9, 9, 9, 2, 2, 5])
    # group 4 differs, group 9 scores alike, group 2 differs, group 5 is one sample
    expected = [True] * 3 + [False] * 3 + [True] * 2 + [False]
    assert informative_groups(scores, groups).tolist() == expected


def test_a_refill_keeps_the_first_informative_groups_it_needs():
    scores = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.3, 0.1, 0.9, 0.2])
    groups = torch.tensor([7, 7, 3, 3, 8, 8, 1, 1])
    batch = PackedBatch(list(range(10, 18)))
    batch.add("scores", scores, [1] * 8)
    batch.add("group_ids", groups, [1] * 8)
    part, n, useful = GroupRefill(3).keep(batch, 2)
    assert (n, useful) == (4, 3)  # group 3 scores alike; 7, 8 and 1 differ
    assert part.sample_ids == [10, 11, 14, 15]  # the first two that differ, in batch order
    assert GroupRefill(3).keep(batch, 5)[0].n_samples == 6


def test_dynamic_sampling_refills_until_full_by_default():
    cfg = DAPOConfig()
    assert (cfg.max_rounds, cfg.short_batch) == (None, "error")
    assert cfg.refill() == GroupRefill(None, "error")
    assert DAPOConfig(max_rounds=3, short_batch="train").refill() == GroupRefill(3, "train")
    assert DAPOConfig(dynamic_sampling=False).refill() is None
    with pytest.raises(ValidationError, match="max_rounds"):
        DAPOConfig(max_rounds=0)
    with pytest.raises(ValidationError, match="short_batch"):
        DAPOConfig(short_batch="skip")


# the rule, where a step stands (step, groups kept, rounds run, rows drawn) -> its next move,
# at batch_size 4 and a dataset of 16 rows
@pytest.mark.parametrize(
    ("rule", "now", "move"),
    [
        (GroupRefill(3), Progress(1, 4, 1, 4), "full"),
        (GroupRefill(3), Progress(1, 2, 2, 8), "refill"),
        (GroupRefill(3, "train"), Progress(1, 2, 3, 12), "short"),
        (GroupRefill(None), Progress(1, 2, 3, 12), "refill"),  # 12 of the dataset's 16 rows
        (GroupRefill(None), Progress(1, 4, 9, 36), "full"),
        (GroupRefill(None, "train"), Progress(1, 1, 4, 16), "short"),
        (GroupRefill(100), Progress(1, 2, 5, 20), "refill"),  # a set limit ignores the dataset
    ],
)
def test_what_a_step_does_after_a_round(rule, now, move):
    assert rule.next_move(now, batch_size=4, dataset_rows=16) == move


SHORT = [  # the rule, where its step stands, and what the error says
    (GroupRefill(3), Progress(5, 2, 3, 12), r"^algorithm\.max_rounds: step 5 kept 2 of batch_"),
    (GroupRefill(3), Progress(5, 2, 3, 12), r"differ after 3 rounds; raise max_rounds, set it to"),
    (GroupRefill(3, "train"), Progress(5, 0, 3, 12), r"^algorithm\.max_rounds: .* nothing to"),
    (GroupRefill(None), Progress(5, 3, 4, 16), r"^algorithm\.dynamic_sampling \(max_rounds: null"),
    (GroupRefill(None), Progress(5, 3, 4, 16), r"16 rows, the whole dataset's 16; .*short_batch"),
    (GroupRefill(None, "train"), Progress(5, 0, 4, 16), r"kept 0 .* apart or set dynamic_sampl"),
]


@pytest.mark.parametrize(("rule", "now", "says"), SHORT)
def test_a_short_batch_at_the_limit_stops_the_run_naming_the_setting(rule, now, says):
    with pytest.raises(rayhf.RayhfError, match=says):
        rule.next_move(now, batch_size=4, dataset_rows=16)


def test_loss_aggregations_by_hand():
    per_token = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0], [9.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]], dtype=torch.bool)
    assert aggregate(per_token, mask, "token_mean").item() == pytest.approx(10 / 4)
    # row means 2 and 4, the empty row 0, over three rows; row sums 6 and 4
    assert aggregate(per_token, mask, "seq_mean_token_mean").item() == pytest.approx(6 / 3)
    assert aggregate(per_token, mask, "seq_mean_token_sum").item() == pytest.approx(10 / 3)


@pytest.mark.parametrize("how", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"])
def test_grpo_and_ppo_share_the_setting(how):
    logp = torch.zeros(2, 3)
    adv = torch.tensor([1.0, 2.0])
    loss, _ = grpo_loss(logp, logp, logp, adv, MASK, GRPOConfig(kl_coef=0.0, loss_agg=how))
    # ratio 1, so each token's loss is -A: tokens -1, -1, -1, -2
    want = {"token_mean": -5 / 4, "seq_mean_token_mean": -3 / 2, "seq_mean_token_sum": -5 / 2}
    assert loss.item() == pytest.approx(want[how])
    assert PPOConfig(loss_agg=how).loss_agg == how


def test_settings_dapo_refuses():
    with pytest.raises(ValidationError, match=r"eps_clip_high \(0.1\) is below"):
        DAPOConfig(eps_clip_high=0.1)
    with pytest.raises(ValidationError, match="dynamic_sampling"):
        DAPOConfig(max_staleness=1)
    assert DAPOConfig(max_staleness=1, dynamic_sampling=False).max_staleness == 1
    with pytest.raises(ValidationError, match="loss_agg"):
        GRPOConfig(dr_grpo=True, loss_agg="seq_mean_token_sum")
    with pytest.raises(ValidationError, match="loss_agg"):
        PPOConfig(loss_agg="sum")


@pytest.mark.parametrize(
    ("override", "says"),
    [
        ({"algorithm.eps_clip_high": 0.1}, r"algorithm.eps_clip_high \(0.1\) is below"),
        ({"algorithm.overlong_buffer": 20}, "algorithm.overlong_buffer: 20 is not below "),
        ({"algorithm.loss_agg": "sum"}, "algorithm.loss_agg"),
        ({"algorithm.max_staleness": 1}, "algorithm.dynamic_sampling"),
    ],
)
def test_bad_dapo_settings_are_refused_naming_the_field(override, says):
    with pytest.raises((ValidationError, rayhf.RayhfError), match=says):
        rayhf.load_config(REPO / "examples" / "dapo_tiny.yaml").with_overrides(override)


def test_dynamic_sampling_needs_group_scores():
    refill = rayhf.load_config(REPO / "examples" / "dapo_tiny.yaml").algorithm.refill()
    assert refill == GroupRefill(3)
    graph = rayhf.load_graph(REPO / "graphs" / "sft.yaml")
    with pytest.raises(rayhf.RayhfError, match=r"dynamic_sampling filters groups .* no 'scores'"):
        refill.check(graph)
