"""AdamW on one rank (dp = tp = pp = 1): a step is torch's AdamW with global-norm clipping on the
Hugging Face model, stats are means over minibatches, and optimizer state round-trips."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from pydantic import ValidationError

from rayhf.checks.common import PAD, VOCAB, Tok, tiny_model
from rayhf.data.batch import PackedBatch
from rayhf.engines.config import TorchEngineConfig
from rayhf.engines.rank_model import RankModel
from rayhf.engines.torch_trainer import (
    NonFiniteGradients,
    OptimizerConfig,
    TorchTrainer,
    Totals,
    global_scales,
    micro_batches,
    response_tokens,
    samples,
)

SHAPE = {"n_heads": 4, "n_kv_heads": 2}


def _batch(seed: int, n: int = 4) -> PackedBatch:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(3, 8, (n,), generator=g).tolist()
    b = PackedBatch(list(range(n)))
    b.add("seq", torch.randint(3, VOCAB, (sum(lens),), generator=g), lens)
    return b


def _nll(logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy over the valid positions."""
    keep = mask[:, 1:].bool()
    return F.cross_entropy(logits[:, :-1][keep], ids[:, 1:][keep])


def _loss_fn(model: RankModel):
    def loss_fn(mb: PackedBatch):
        ids, mask = mb.to_padded("seq", PAD)
        loss = _nll(model.forward(ids, mask.long()), ids, mask)
        return loss, {"nll": loss.item()}

    return loss_fn


def _trainer(seed: int = 0, **cfg) -> tuple[TorchTrainer, torch.nn.Module]:
    hf = tiny_model("llama", SHAPE, seed=seed)
    model = RankModel.from_hf(hf, Tok(), False)
    return TorchTrainer(model, OptimizerConfig(**cfg)), hf


def test_steps_are_clipped_adamw_on_the_hugging_face_model():
    cfg = {"lr": 1e-2, "weight_decay": 0.1, "betas": (0.8, 0.9), "grad_clip": 0.5}
    trainer, hf = _trainer(**cfg)
    ref = copy.deepcopy(hf).train()
    batches = [_batch(1), _batch(11)]
    stats = trainer.train(batches, _loss_fn(trainer.model))
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, betas=(0.8, 0.9), weight_decay=0.1)
    norms, losses = [], []
    for batch in batches:
        opt.zero_grad()
        ids, mask = batch.to_padded("seq", PAD)
        loss = _nll(ref(ids, attention_mask=mask.long()).logits, ids, mask)
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5).item())
        losses.append(loss.item())
        opt.step()
    assert min(norms) > 0.5, "the case should clip"
    assert stats["grad_norm"] == pytest.approx(sum(norms) / 2, rel=1e-4)  # pre-clip norms
    assert stats["nll"] == pytest.approx(sum(losses) / 2, rel=1e-5)
    full = trainer.model.full_state()
    # Adam's first step ignores a gradient's scale, so the second one checks the clipping;
    # without it the weights would differ by ~4e-3
    for name, tensor in ref.state_dict().items():
        torch.testing.assert_close(full[name], tensor, rtol=0, atol=1e-4, msg=name)


def test_training_lowers_the_loss_and_bumps_the_version_once_per_call():
    trainer, _ = _trainer(lr=1e-2)
    batch, loss_fn = _batch(2), _loss_fn(trainer.model)
    with torch.no_grad():
        before = loss_fn(batch)[0].item()
    for _ in range(3):
        trainer.train([batch, batch], loss_fn)
    with torch.no_grad():
        after = loss_fn(batch)[0].item()
    assert after < before - 0.1
    assert trainer.model.version == 3
    assert not trainer.model.module.training and not trainer.model.pipe.record
    assert trainer.model.pipe.pending == []


def test_stats_are_means_over_the_minibatches_that_gave_them():
    trainer, _ = _trainer()
    seen = iter([{"a": 1.0, "b": 4.0}, {"a": 3.0}])

    def loss_fn(mb):
        ids, mask = mb.to_padded("seq", PAD)
        return _nll(trainer.model.forward(ids, mask.long()), ids, mask), next(seen)

    stats = trainer.train([_batch(3), _batch(4)], loss_fn)
    assert stats["a"] == 2.0 and stats["b"] == 4.0  # b: over the one minibatch that gave it
    assert stats["grad_norm"] > 0


def test_an_empty_minibatch_is_skipped_without_a_loss():
    trainer, _ = _trainer()
    calls = []

    def loss_fn(mb):
        calls.append(mb.n_samples)
        return _loss_fn(trainer.model)(mb)

    before = {k: v.clone() for k, v in trainer.model.full_state().items()}
    stats = trainer.train([_batch(5).select([])], loss_fn)
    assert calls == [] and stats == {"grad_norm": 0.0}
    after = trainer.model.full_state()
    assert all(torch.equal(before[k], after[k]) for k in before)  # no gradient, no update


def test_save_then_load_optimizer_continues_identically(tmp_path):
    first, _ = _trainer(lr=1e-2)
    for seed in (6, 7):
        first.train([_batch(seed)], _loss_fn(first.model))
    state = copy.deepcopy(first.save_optimizer(str(tmp_path)))  # the live state moves on
    assert len(state["state"]) == len(list(first.model.module.parameters()))
    weights = {k: v.clone() for k, v in first.model.full_state().items()}  # views of live params

    def resumed(load: bool) -> dict[str, torch.Tensor]:
        trainer, _ = _trainer(seed=1, lr=1e-2)  # other initial weights, replaced below
        trainer.model.load_full_state(weights)
        trainer.weights_loaded()
        if load:
            trainer.load_optimizer(str(tmp_path), copy.deepcopy(state))
        trainer.train([_batch(8)], _loss_fn(trainer.model))
        return trainer.model.full_state()

    first.train([_batch(8)], _loss_fn(first.model))
    expected = first.model.full_state()
    got, fresh = resumed(load=True), resumed(load=False)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=0, msg=name)
    assert any(not torch.equal(fresh[n], expected[n]) for n in expected)  # the state mattered


def test_an_offloaded_optimizer_steps_as_the_one_on_the_device_and_resumes(tmp_path):
    """``engines.<train>.offload``: AdamW's state and its copy of the weights in host memory
    (another tensor, on a CPU) give the same weights bit for bit, step after step, a skipped
    step included; its state saves and loads, and weights written from outside reach it."""
    cfg = {"lr": 1e-2, "weight_decay": 0.1}
    device, _ = _trainer(**cfg)
    model = RankModel.from_hf(tiny_model("llama", SHAPE), Tok(), False)
    host = TorchEngineConfig(offload=True).make_trainer(model, OptimizerConfig(**cfg))
    assert isinstance(host, TorchTrainer)
    assert host.host is not None and not host.optimizer.state
    for trainer in (device, host):
        for seed in (1, 2):
            trainer.train([_batch(seed), _batch(seed + 10)], _loss_fn(trainer.model))
        trainer.train([_batch(3)], _nonfinite(trainer, [True]))
    copies = {id(c) for c in host.host.copies}
    assert {id(p) for g in host.optimizer.param_groups for p in g["params"]} == copies
    want, got = device.model.full_state(), host.model.full_state()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=name)
    state = copy.deepcopy(host.save_optimizer(str(tmp_path)))
    again = TorchTrainer(RankModel.from_hf(tiny_model("llama", SHAPE, seed=1), Tok(), False),
                         OptimizerConfig(**cfg), offload=True)  # fmt: skip
    again.model.load_full_state({k: v.clone() for k, v in got.items()})
    again.weights_loaded()  # the host copy takes the loaded weights
    again.load_optimizer(str(tmp_path), state)
    for trainer in (host, again):
        trainer.train([_batch(4)], _loss_fn(trainer.model))
    want, got = host.model.full_state(), again.model.full_state()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=name)


def test_one_rank_holds_everything_itself():
    trainer, _ = _trainer()
    assert trainer.name == "torch" and trainer.gathers_over_dp is False
    assert trainer.shard_source() is trainer.model
    with trainer.gathered():
        pass
    assert isinstance(trainer.optimizer, torch.optim.AdamW)


def test_optimizer_config_defaults_and_bad_values():
    cfg = OptimizerConfig()
    assert (cfg.lr, cfg.weight_decay, cfg.betas, cfg.eps, cfg.grad_clip, cfg.zero1) == (
        1e-4, 0.0, (0.9, 0.95), 1e-8, 1.0, False
    )  # fmt: skip
    for bad in ({"lr": 0.0}, {"weight_decay": -1.0}, {"grad_clip": 0.0}, {"eps": 0}, {"x": 1}):
        with pytest.raises(ValidationError):
            OptimizerConfig(**bad)


class _Ranks:
    """A dp group whose other ranks hold the given totals."""

    def __init__(self, *others: Totals) -> None:
        self.others = others

    def all_gather_object(self, obj):
        return [obj, *((o.sums, o.seen, o.maxima, o.counts) for o in self.others)]


def test_totals_average_each_stat_over_the_minibatches_that_gave_it():
    """Two dp ranks, 4 minibatches each; this rank's last two are empty (too few samples)."""
    mine, other = Totals(4), Totals(4)
    mine.add({"loss": 2.0, "is_weight_max": 3.0})
    mine.add({"loss": 1.0}, share=0.5)  # a minibatch of two micro-batches, each scaled by 1/2
    mine.add({"loss": 7.0}, share=0.5)
    for v in (1.0, 1.0, 1.0, 5.0):
        other.add({"loss": v, "is_weight_max": 2.0})
    for t, norm in ((mine, 1.0), (other, 3.0)):
        for _ in range(4):
            t.add({"grad_norm": norm})  # every minibatch, empty or not, takes a step
        t.count("skipped_steps")
    got = mine.reduced(_Ranks(other))  # type: ignore[arg-type]
    assert got["loss"] == pytest.approx((2.0 + 4.0 + 1.0 + 1.0 + 1.0 + 5.0) / 6)
    assert got["grad_norm"] == pytest.approx(2.0)
    assert got["is_weight_max"] == 3.0 and got["skipped_steps"] == 1.0


def test_with_no_empty_minibatch_totals_are_the_plain_mean_bit_for_bit():
    values = [0.1, 0.7, 0.3]
    shares = [0.1] * 10  # one minibatch's micro-batches: they add up to 1 but for rounding
    assert sum(shares) != 1.0
    totals = Totals(len(values) + 1)
    want = 0.0
    for v in values:  # what each step of the sum was before empty minibatches were left out
        totals.add({"loss": v})
        want += v / (len(values) + 1)
    for share in shares:
        totals.add({"loss": 0.5}, share)
        want += 0.5 * share / (len(values) + 1)
    assert totals.reduced(_Ranks())["loss"] == want  # type: ignore[arg-type]


def _with_prompt_lens(batch: PackedBatch) -> PackedBatch:
    """``_nll`` predicts every token after the first: a one-token prompt."""
    batch.add("prompt_lens", torch.ones(batch.n_samples, dtype=torch.long), [1] * batch.n_samples)
    return batch


@pytest.mark.parametrize("budget", [7, 12, 20])
def test_a_token_budget_accumulates_the_same_step_as_the_whole_minibatch(budget):
    batches = [_with_prompt_lens(_batch(5, n=6)), _with_prompt_lens(_batch(6, n=6))]
    whole, _ = _trainer(lr=1e-2)
    cut, _ = _trainer(lr=1e-2)
    parts = [len(micro_batches(b, budget, response_tokens)) for b in batches]
    assert min(parts) > 1, "the budget should cut these minibatches"
    stats_whole = whole.train(batches, _loss_fn(whole.model))
    stats_cut = cut.train(batches, _loss_fn(cut.model), token_budget=budget)
    assert stats_cut["nll"] == pytest.approx(stats_whole["nll"], rel=1e-5)
    assert stats_cut["micro_batches"] == sum(parts) / 2 and "micro_batches" not in stats_whole
    assert stats_cut["grad_norm"] == pytest.approx(stats_whole["grad_norm"], rel=1e-4)
    a, b = whole.model.full_state(), cut.model.full_state()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=1e-4, msg=name)


def test_micro_batches_keep_order_and_their_shares_add_up():
    batch = _with_prompt_lens(_batch(7, n=8))
    lens = batch.seqlens["seq"]
    parts = micro_batches(batch, max(lens) + 1, response_tokens)
    assert all(p.n_tokens("seq") <= max(lens) + 1 for p, _ in parts)
    assert PackedBatch.concat([p for p, _ in parts]).sample_ids == batch.sample_ids
    assert sum(share for _, share in parts) == pytest.approx(1.0)
    shares = [s for _, s in micro_batches(batch, max(lens) + 1, samples)]
    assert shares == pytest.approx([p.n_samples / 8 for p, _ in parts])
    assert micro_batches(batch, None, response_tokens) == [(batch, 1.0)]
    with pytest.raises(ValueError, match=f"a {lens[0]}-token sample is over the 2-token budget"):
        batch.token_chunks(2)


def _fp16_trainer(seed: int = 0) -> TorchTrainer:
    from rayhf.models.precision import Numerics

    hf = tiny_model("llama", SHAPE, seed=seed)
    model = RankModel.from_hf(hf, Tok(), False, numerics=Numerics("fp16", master=True))
    return TorchTrainer(model, OptimizerConfig(lr=1e-2))


def test_fp16_scales_the_loss_and_steps_fp32_weights_like_fp32_training():
    trainer = _fp16_trainer()
    fp32, _ = _trainer(lr=1e-2)
    before = {k: v.detach().clone() for k, v in trainer.model.module.local_state().items()}
    stats = trainer.train([_batch(1)], _loss_fn(trainer.model))
    fp32.train([_batch(1)], _loss_fn(fp32.model))
    assert stats["loss_scale"] == 2.0**16 and "skipped_steps" not in stats
    after = {k: v.detach() for k, v in trainer.model.module.local_state().items()}
    assert {p.dtype for p in after.values()} == {torch.float32}
    assert max(float((after[k] - v).abs().max()) for k, v in before.items()) > 5e-3
    # AdamW's first step moves each weight by about lr: count the weights moved another way
    reference = fp32.model.module.local_state()
    off = sum(int(((after[k] - reference[k]).abs() > 5e-3).sum()) for k in after)
    assert off / sum(v.numel() for v in after.values()) < 0.01


def test_fp16_skips_a_step_whose_gradients_overflow_and_backs_off_the_scale():
    trainer = _fp16_trainer()
    before = {k: v.detach().clone() for k, v in trainer.model.module.local_state().items()}
    inner = _loss_fn(trainer.model)

    def overflowing(mb: PackedBatch):
        loss, stats = inner(mb)
        return loss * 1e35, stats  # scaled by 2**16: beyond fp32's range

    stats = trainer.train([_batch(1)], overflowing)
    assert stats["skipped_steps"] == 1.0
    after = trainer.model.module.local_state()
    assert all(torch.equal(after[k], v) for k, v in before.items()), "a skipped step moved"
    assert trainer.scaler is not None and trainer.scaler.get_scale() == 2.0**15
    saved = trainer.save_optimizer("")
    fresh = _fp16_trainer()
    fresh.load_optimizer("", saved)
    assert fresh.scaler is not None and fresh.scaler.get_scale() == 2.0**15


def test_a_token_mean_weighs_every_trained_token_alike_across_micro_batches():
    """Two samples of 10 response tokens, 1 and 10 of them trained (a multi-turn loss mask),
    cut by a 12-token budget: each trained token weighs 1/11 of the minibatch's token mean,
    as in the whole minibatch; counting the environment's tokens gave 1/2 and 1/20."""
    batch = PackedBatch([0, 1])
    batch.add("seq", torch.arange(3, 25) % (VOCAB - 3) + 3, [11, 11])
    batch.add("prompt_lens", torch.tensor([1, 1]), [1, 1])
    batch.add("loss_mask", torch.tensor([1] + [0] * 9 + [1] * 10), [10, 10])
    parts = micro_batches(batch, 12, response_tokens)
    assert [p.sample_ids for p, _ in parts] == [[0], [1]]
    assert [share for _, share in parts] == pytest.approx([1 / 11, 10 / 11])
    assert response_tokens(batch) == 11.0


class _TwoRanks:
    """A dp group of two replicas whose other rank holds ``other`` of each weight."""

    size = 2

    def __init__(self, other: list[float]) -> None:
        self.other = torch.tensor(other, dtype=torch.float64)

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        return t + self.other


def test_a_token_mean_is_over_every_dp_ranks_tokens_and_an_empty_rank_scales_nothing():
    """This rank holds 3 response tokens of a minibatch, the other 9: the gradients the
    replicas average are then those of the mean over 12 tokens (this rank's mean times
    2 * 3 / 12); in a minibatch the other rank has none of, this rank's mean counts whole
    (2 * 3 / 3 = 2 before the average halves it), not halved by the empty rank."""
    batch = PackedBatch([0])
    batch.add("seq", torch.arange(3, 7), [4])
    batch.add("prompt_lens", torch.tensor([1]), [1])
    empty = batch.select([])
    scales = global_scales(_TwoRanks([9.0, 0.0, 5.0]), [batch, batch, empty], response_tokens)  # type: ignore[arg-type]
    assert scales == pytest.approx([2 * 3 / 12, 2.0, 0.0])


def test_the_ranks_of_a_cp_group_count_their_shared_rows_once():
    """Two ranks of one cp group hold the same 3 tokens: each counts them, so the total is 6,
    and each rank's gradient is its own tokens' share of the group's. Scaled by 2 * 3 / 6 * 2,
    the two ranks' average is the mean over the 3 tokens, as one rank holding them all."""
    batch = PackedBatch([0])
    batch.add("seq", torch.arange(3, 7), [4])
    batch.add("prompt_lens", torch.tensor([1]), [1])
    scales = global_scales(_TwoRanks([3.0]), [batch], response_tokens, cp=2)  # type: ignore[arg-type]
    assert scales == pytest.approx([2.0])


def _nonfinite(trainer: TorchTrainer, poison: list[bool]):
    inner = _loss_fn(trainer.model)
    calls = iter(poison)

    def loss_fn(mb: PackedBatch):
        loss, stats = inner(mb)
        return (loss * float("nan") if next(calls) else loss), stats

    return loss_fn


def test_a_non_finite_gradient_skips_the_step_at_fp32_and_leaves_the_weights():
    trainer, _ = _trainer(lr=1e-2, max_skipped_steps=3)
    before = {k: v.detach().clone() for k, v in trainer.model.module.local_state().items()}
    stats = trainer.train([_batch(1)], _nonfinite(trainer, [True]))
    assert stats["skipped_steps"] == 1.0 and trainer.skipped_in_a_row == 1
    after = trainer.model.module.local_state()
    assert all(torch.isfinite(v).all() for v in after.values())
    assert all(torch.equal(after[k], v) for k, v in before.items()), "a skipped step moved"
    assert not trainer.optimizer.state, "the optimizer's moments saw the step"
    # a finite step resets the count; then three in a row stop the run, naming the setting
    trainer.train([_batch(2), _batch(3)], _nonfinite(trainer, [True, False]))
    assert trainer.skipped_in_a_row == 0
    with pytest.raises(NonFiniteGradients, match=r"3 optimizer steps in a row.*max_skipped_steps"):
        trainer.train([_batch(4)] * 3, _nonfinite(trainer, [True] * 3))


def test_fp16_overflows_while_the_scale_backs_off_do_not_stop_the_run():
    """GradScaler starts at 2**16 and halves on each overflow: ten overflows in a row there
    are it finding its scale, skipped and counted but not towards max_skipped_steps (2)."""
    from rayhf.models.precision import Numerics

    hf = tiny_model("llama", SHAPE, seed=0)
    model = RankModel.from_hf(hf, Tok(), False, numerics=Numerics("fp16", master=True))
    trainer = TorchTrainer(model, OptimizerConfig(lr=1e-2, max_skipped_steps=2))
    inner = _loss_fn(trainer.model)

    def overflowing(mb: PackedBatch):
        loss, stats = inner(mb)
        return loss * 1e35, stats

    stats = trainer.train([_batch(1)] * 10, overflowing)
    assert stats["skipped_steps"] == 10.0 and trainer.skipped_in_a_row == 0
    assert trainer.scaler is not None and trainer.scaler.get_scale() == 2.0**6


def test_an_moe_model_s_train_step_reports_how_unevenly_its_experts_are_loaded():
    """The busiest expert's tokens over the mean expert's, per MoE layer and pass, averaged:
    between 1 (even) and the number of experts; a dense model reports none."""
    from rayhf.models.families import FAMILIES

    shape = dict(FAMILIES["qwen3_moe"].check_shape)
    model = RankModel.from_hf(tiny_model("qwen3_moe", shape), Tok(), False)
    trainer = TorchTrainer(model, OptimizerConfig())
    batches = [_batch(3), _batch(4)]
    stats = trainer.train(batches, _loss_fn(model))
    assert 1.0 < stats["expert_load_max_over_mean"] <= 8
    # by hand: the first minibatch's forward, the same weights before the step
    again = RankModel.from_hf(tiny_model("qwen3_moe", shape), Tok(), False)
    again.module.train(True)
    ids, mask = batches[0].to_padded("seq", PAD)
    again.forward(ids, mask.long())
    assert len(again.module.expert_loads) == 3  # the sparse layers: 0, 2 and 3
    counts = torch.stack(again.module.expert_loads).float()
    assert counts.sum(dim=1).tolist() == [2.0 * int(mask.sum())] * 3  # every token, twice
    first = again.module.take_expert_loads()
    assert first == pytest.approx(float((counts.max(1).values / counts.mean(1)).mean()))
    assert again.module.expert_loads == [] and again.module.take_expert_loads() is None
    dense, _ = _trainer()
    assert "expert_load_max_over_mean" not in dense.train([_batch(3)], _loss_fn(dense.model))


@pytest.mark.parametrize("replay", [False, True])
def test_a_train_step_given_a_generator_s_experts_reports_how_often_its_router_differs(replay):
    """Given other experts than the router's for half the tokens (-1: the other half), the
    step reports the share of given tokens whose router chose another set; replayed, none of
    them went to another set, and the loss is not the router's own."""
    from rayhf.models.families import FAMILIES

    shape = dict(FAMILIES["qwen3_moe"].check_shape)
    model = RankModel.from_hf(tiny_model("qwen3_moe", shape), Tok(), False)
    spec = model.spec
    assert spec.moe is not None
    batch = _batch(3)
    ids, mask = batch.to_padded("seq", PAD)
    targets = torch.where(mask, ids, -1)
    draw = torch.rand(*ids.shape, len(spec.moe_layers), spec.moe.n_experts)
    given = draw.argsort(dim=-1)[..., : spec.moe.top_k].to(torch.int16)
    given[:, 1::2] = -1
    with torch.no_grad():
        own = -model.score(ids, mask.long(), targets)[..., 0].sum() / mask.sum()
    losses = []

    def loss_fn(routes):
        def fn(mb: PackedBatch):
            scored = model.score(ids, mask.long(), targets, 1.0, routes, replay)
            loss = -scored[..., 0].sum() / mask.sum()
            losses.append(loss.detach())
            return loss, {}

        return fn

    trainer = TorchTrainer(model, OptimizerConfig())
    stats = trainer.train([batch], loss_fn(given))
    assert 0.5 < stats["routes_differ_own"] <= 1.0  # random pairs of 8 experts: mostly others
    assert stats["routes_differ"] == (0.0 if replay else stats["routes_differ_own"])
    assert torch.equal(losses[0], own) != replay  # the first forward: the weights of ``own``
    assert "routes_differ" not in trainer.train([batch], loss_fn(None))  # none given


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_the_load_balancing_losses_are_hugging_face_s_and_train_the_router(family):
    """Over a padded batch (packed here, masked there): the auxiliary loss is Hugging Face's
    ``aux_loss``, the z-loss each layer's mean squared router logsumexp summed, and with both
    on, the routers' gradients change."""
    from rayhf.models.families import FAMILIES

    shape = dict(FAMILIES[family].check_shape)
    hf = tiny_model(family, shape)
    batch = _batch(5)
    ids, mask = batch.to_padded("seq", PAD)
    with torch.no_grad():
        out = hf(input_ids=ids, attention_mask=mask.long(), output_router_logits=True)
    keep = mask.flatten()
    want_z = sum(torch.logsumexp(g[keep].float(), -1).square().mean() for g in out.router_logits)
    grads = {}
    for aux, z in ((0.0, 0.0), (0.5, 0.25)):
        model = RankModel.from_hf(tiny_model(family, shape), Tok(), False)
        cfg = OptimizerConfig(router_aux_loss=aux, router_z_loss=z)
        trainer = TorchTrainer(model, cfg)
        trainer.optimizer.step = lambda: None  # keep the gradients to compare, not the step
        stats = trainer.train([batch], _loss_fn(model))
        gate = next(k for k in model.module.shards if k.endswith("mlp.gate.weight"))
        grads[aux] = model.module.param(gate).grad.clone()
        if aux:
            assert stats["router_aux_loss"] == pytest.approx(float(out.aux_loss), rel=1e-5)
            assert stats["router_z_loss"] == pytest.approx(float(want_z), rel=1e-5)
        else:
            assert "router_aux_loss" not in stats
    assert not torch.equal(grads[0.0], grads[0.5])


def test_a_sigmoid_router_s_correction_bias_moves_toward_an_even_load():
    """GLM-4.5's score-correction bias, after a step with ``router_bias_rate``: up by the rate
    for each expert that took fewer tokens than the mean, down for each that took more."""
    from rayhf.models.families import FAMILIES

    shape = dict(FAMILIES["glm4_moe"].check_shape)
    rate = 0.01
    model = RankModel.from_hf(tiny_model("glm4_moe", shape), Tok(), False)
    again = RankModel.from_hf(tiny_model("glm4_moe", shape), Tok(), False)
    batch = _batch(6)
    ids, mask = batch.to_padded("seq", PAD)
    again.module.train(True)
    again.module.balances_bias = True
    again.forward(ids, mask.long())  # the step's forward, by hand: the loads it saw
    loads = again.module.layer_loads
    assert loads, "no sigmoid-routed layer"
    before = {m: model.module.param(f"{m}.gate.e_score_correction_bias").clone() for m in loads}
    TorchTrainer(model, OptimizerConfig(router_bias_rate=rate)).train([batch], _loss_fn(model))
    for m, counts in loads.items():
        moved = model.module.param(f"{m}.gate.e_score_correction_bias") - before[m]
        want = rate * torch.sign(counts.float().mean() - counts.float())
        torch.testing.assert_close(moved, want, atol=1e-7, rtol=0)
        assert moved.abs().sum() > 0
