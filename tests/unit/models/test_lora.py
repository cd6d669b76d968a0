"""LoRA adapters in one process: how each adapted weight's pair splits over tp, the adapted
model against PEFT's, and PEFT's adapter files both ways (the layouts: test_lora_parity.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from rayhf.checks.common import Tok
from rayhf.checks.lora import ALPHA, RANK, peft_model, targets
from rayhf.checks.parity import _batch, _model
from rayhf.engines.rank_model import RankModel
from rayhf.errors import RayhfError
from rayhf.models.hf import model_files
from rayhf.models.lora import adapted, from_peft, load_adapter, read_adapter_config, save_adapter
from rayhf.models.sharding import adapter_pairs, param_shards
from rayhf.models.spec import Lora, model_spec


def _pairs(case: str):
    spec = model_spec(_model(case, False).config, value_head=False)
    spec = replace(spec, lora=Lora(RANK, ALPHA, targets(case)))
    return {p.weight.split(".")[-2]: p for p in adapter_pairs(spec, param_shards(spec))}


def test_a_column_parallel_weight_splits_b_and_a_row_parallel_one_splits_a():
    pairs = _pairs("llama")
    q, o = pairs["q_proj"], pairs["o_proj"]
    assert (q.split, q.a.tp_dim, q.b.tp_dim) == ("column", None, 0)
    assert (o.split, o.a.tp_dim, o.b.tp_dim) == ("row", 1, None)
    assert q.a.shape == (RANK, 32) and q.b.shape[1] == RANK
    assert q.a.name.endswith("q_proj.lora_A.weight") and q.b.name.endswith("q_proj.lora_B.weight")
    spec = model_spec(_model("llama", False).config, value_head=False)
    shards = param_shards(replace(spec, lora=Lora(RANK, ALPHA, ("q_proj",))))
    names = [p.name for p in shards]  # each pair right after its weight; only adapters train
    at = names.index(q.weight)
    assert names[at + 1 : at + 3] == [q.a.name, q.b.name]
    assert [p.name for p in shards if p.trained] == [n for n in names if ".lora_" in n]


def test_fused_and_conv1d_weights_split_their_adapters_by_the_same_blocks():
    qkv = _pairs("phi3")["qkv_proj"]  # q|k|v in one weight: B's rows split block by block
    assert qkv.split == "column" and qkv.b.blocks and sum(qkv.b.blocks) == qkv.b.shape[0]
    gpt2 = _pairs("gpt2")  # Conv1D keeps [in, out]: a column split is on its dim 1
    assert gpt2["c_attn"].split == "column" and gpt2["c_attn"].b.blocks
    assert gpt2["c_proj"].split == "row"


def _rayhf(case: str, full, lora: Lora, **kw) -> RankModel:
    config = _model(case, False).config
    return RankModel(adapted(model_files(config, False), lora), full, Tok(), **kw)


def _logits(model, ids, mask) -> torch.Tensor:
    with torch.no_grad():
        if isinstance(model, RankModel):
            return model.forward(ids, mask)
        return model(input_ids=ids, attention_mask=mask).logits


@pytest.mark.parametrize("case", ["llama", "gpt2", "qwen3_5_text"])
def test_the_adapted_model_gives_peft_s_logits_and_trains_only_its_adapters(case):
    ids, mask = _batch()
    ref = peft_model(case)
    model = _rayhf(case, from_peft(ref.state_dict()), Lora(RANK, ALPHA, targets(case)))
    keep = mask.bool()
    want, got = _logits(ref, ids, mask)[keep], _logits(model, ids, mask)[keep]
    assert (got - want).abs().max() < 1e-5 * want.abs().max()
    trained = {n for n, p in model.module.named_parameters() if p.requires_grad}
    assert trained and all("lora_" in n for n in trained)
    assert len(trained) == 2 * len(model.module.adapters)


def test_a_fresh_adapter_changes_nothing():
    ids, mask = _batch()
    base = _model("llama", False).state_dict()
    fresh = _rayhf("llama", base, Lora(8, 16, ("q_proj", "down_proj")))
    plain = RankModel(model_files(_model("llama", False).config, False), base, Tok())
    assert len(fresh.module.adapters) == 2 * 4  # two weights in each of 4 layers
    assert torch.equal(_logits(fresh, ids, mask), _logits(plain, ids, mask))


def test_base_weights_give_a_separate_base_copy_s_logits_with_trained_adapters_on_the_side():
    """A reference computed by the LoRA actor (``base_weights``) equals a copy of the base."""
    ids, mask = _batch()
    base = _model("llama", False).state_dict()
    model = _rayhf("llama", base, Lora(4, 16, ("q_proj", "o_proj", "down_proj")))
    with torch.no_grad():
        for pair in model.module.adapters.values():  # trained adapters: off the base
            b = model.module.param(pair.b.name)
            b.copy_(torch.randn_like(b))
    plain = RankModel(model_files(_model("llama", False).config, False), base, Tok())
    want = _logits(plain, ids, mask)
    assert not torch.allclose(_logits(model, ids, mask), want)
    with model.module.base_weights():
        assert torch.equal(_logits(model, ids, mask), want)
    assert not torch.allclose(_logits(model, ids, mask), want)  # on again after it


# qwen3_moe: attention alone (PEFT reads its MLP names as the experts); qwen3_next: the
# shared expert's gate too, and transformers' converted MoE config on PEFT's side
@pytest.mark.parametrize("case", ["qwen2", "qwen3_moe", "qwen3_next"])
def test_adapters_saved_by_rayhf_load_in_peft_and_peft_s_load_in_rayhf(tmp_path, case):
    from peft import PeftModel

    ids, mask = _batch()
    keep = mask.bool()
    ref = peft_model(case)
    lora = Lora(RANK, ALPHA, targets(case))
    model = _rayhf(case, from_peft(ref.state_dict()), lora)
    save_adapter(model.full_state(), lora, tmp_path / "ours")
    theirs = PeftModel.from_pretrained(_model(case, False), str(tmp_path / "ours"))
    assert {n for n, _ in theirs.named_parameters() if "lora_" in n} == {
        n for n, _ in ref.named_parameters() if "lora_" in n
    }  # PEFT adapts no expert of it beside them
    assert torch.allclose(
        _logits(theirs, ids, mask)[keep], _logits(model, ids, mask)[keep], atol=1e-5
    )

    ref.save_pretrained(str(tmp_path / "peft"))
    loaded, tensors = load_adapter(tmp_path / "peft")
    assert loaded == lora
    base = {k: v for k, v in _model(case, False).state_dict().items()}
    again = _rayhf(case, base | tensors, loaded)
    want = _logits(ref, ids, mask)[keep]
    assert (_logits(again, ids, mask)[keep] - want).abs().max() < 1e-5 * want.abs().max()


def test_a_directory_without_an_adapter_is_refused_in_one_line(tmp_path):
    with pytest.raises(RayhfError, match=r"no adapter_config\.json") as err:
        load_adapter(tmp_path)
    assert "\n" not in str(err.value)


def test_a_config_resolves_against_the_model_and_its_starting_adapter(tmp_path):
    from rayhf.models.lora import LoraConfig, lora_of

    spec = model_spec(_model("llama", True).config, value_head=True)
    lora = lora_of(LoraConfig(rank=2), spec, "models.critic.lora")
    assert lora.targets == targets("llama") and lora.trains == ("score",)  # the head trains
    save_adapter({}, Lora(4, 8.0, ("q_proj", "v_proj")), tmp_path)
    started = lora_of(LoraConfig(adapter=str(tmp_path)), spec, "f")  # the adapter's fields stand
    assert (started.rank, started.alpha, started.targets) == (4, 8.0, ("q_proj", "v_proj"))
    with pytest.raises(RayhfError, match=r"^f\.rank: 2 differs from adapter .*'s 4"):
        lora_of(LoraConfig(rank=2, adapter=str(tmp_path)), spec, "f")


def test_on_a_mixture_of_experts_model_the_experts_and_router_are_never_adapted():
    """All-linear on Qwen3-MoE is its attention: PEFT reads the MLP names as the routed experts
    (transformers 5 fused them), which rayhf does not adapt, and a target of one is refused."""
    from peft.utils import transformers_weight_conversion as peft_moe

    from rayhf.models.families import FAMILIES
    from rayhf.models.lora import LoraConfig, lora_of

    for family, traits in FAMILIES.items():  # each row names what PEFT maps to its experts
        pattern = peft_moe._MODEL_TO_CONVERSION_PATTERN.get(family, "")
        want = peft_moe._MOE_TARGET_MODULE_MAPPING.get(pattern, {})
        assert set(traits.moe.peft_fused if traits.moe else ()) == set(want), family
    spec = model_spec(_model("qwen3_moe", False).config, value_head=False)
    lora = lora_of(LoraConfig(rank=2), spec, "models.actor.lora")
    assert lora.targets == ("k_proj", "o_proj", "q_proj", "v_proj") == targets("qwen3_moe")
    with pytest.raises(RayhfError, match=r"^m\.targets: 'down_proj' is, to PEFT, .* experts") as e:
        lora_of(LoraConfig(targets=["down_proj"]), spec, "m")
    assert "\n" not in str(e.value)


def test_a_peft_adapter_of_routed_experts_is_refused_in_one_line(tmp_path):
    from peft import LoraConfig as PeftLora
    from peft import get_peft_model

    experts = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    config = PeftLora(r=2, target_modules=["q_proj"], target_parameters=experts)
    get_peft_model(_model("qwen3_moe", False), config).save_pretrained(str(tmp_path))
    with pytest.raises(RayhfError, match=r"^f: .* adapts parameters .* routed experts") as err:
        read_adapter_config(tmp_path, "f")
    assert "\n" not in str(err.value)


DROPOUT = 0.3


class _SameDraw(torch.nn.Module):
    """PEFT's ``lora_dropout`` drawing its mask as rayhf does: ``torch.rand`` over the input."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * (torch.rand(x.shape) >= DROPOUT) / (1 - DROPOUT)


def _full_rows() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows without padding (packed, rayhf's tokens are PEFT's in the same order), and their
    next-token targets."""
    from rayhf.checks.parity import VOCAB, _targets

    ids = torch.randint(3, VOCAB, (3, 8), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    return ids, mask, _targets(ids, mask)


def _dropout_grads(model: RankModel, seed: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The mean target log-prob and its adapters' gradients, in a train pass seeded ``seed``."""
    ids, mask, targets = _full_rows()
    model.module.train(True)
    torch.manual_seed(seed)
    scored = model.score(ids, mask, targets)[:, :-1, 0]
    scored.mean().backward()
    model.module.train(False)
    module = model.module
    grads = {n: module.param(n).grad for n in module.shards if ".lora_" in n}
    return scored.detach(), {n: g.clone() for n, g in grads.items() if g is not None}


def test_an_lm_head_named_as_a_target_is_adapted_as_peft_adapts_it():
    """Named, an untied LM head gets a vocab-parallel pair, PEFT's log-probs and its adapters'
    gradients, and its term in fp32 where the head computes in fp32; "all-linear" leaves it
    out, as PEFT's does, and a head tied to the embeddings is refused in one line."""
    from rayhf.models.lora import LoraConfig, lora_of
    from rayhf.models.precision import Numerics

    head = targets("llama", head=True)
    spec = model_spec(_model("llama", False).config, value_head=False)
    pairs = adapter_pairs(replace(spec, lora=Lora(RANK, ALPHA, head)), param_shards(spec))
    (pair,) = [p for p in pairs if p.weight == "lm_head.weight"]
    assert (pair.split, pair.a.tp_dim, pair.b.tp_dim) == ("column", None, 0)
    assert pair.b.shape == (spec.vocab_size, RANK)
    assert "lm_head" not in lora_of(LoraConfig(), spec, "lora").targets
    assert "lm_head" in lora_of(LoraConfig(targets=["lm_head"]), spec, "lora").targets
    tied = model_spec(_model("gemma2", False).config, value_head=False)
    with pytest.raises(RayhfError, match=r"^lora\.targets: .* LM head is its embedding table"):
        lora_of(LoraConfig(targets=["lm_head"]), tied, "lora")

    ids, mask, tgt = _full_rows()
    for case in ("llama", "gpt2"):  # GPT-2's decoder keeps [in, out]; its head is [out, in]
        ref = peft_model(case, head=True)
        lora = Lora(RANK, ALPHA, targets(case, head=True))
        model = _rayhf(case, from_peft(ref.state_dict()), lora)
        logp = torch.log_softmax(ref(input_ids=ids, attention_mask=mask).logits, dim=-1)
        want = logp[:, :-1].gather(-1, tgt[:, :-1, None]).squeeze(-1)
        want.mean().backward()
        got = model.score(ids, mask, tgt)[:, :-1, 0]
        got.mean().backward()
        assert (got - want).abs().max() < 1e-5, case
        grads = {n: p.grad for n, p in ref.named_parameters() if "lm_head.lora_" in n}
        theirs = from_peft(grads)
        assert sorted(theirs) == [pair.a.name, pair.b.name], case
        for name, g in theirs.items():
            torch.testing.assert_close(model.module.param(name).grad, g, rtol=1e-4, atol=1e-7)

    low = Numerics("bf16", master=True, fp32_lm_head=True)
    ref = peft_model("llama", head=True)
    model = _rayhf("llama", from_peft(ref.state_dict()), Lora(RANK, ALPHA, head), numerics=low)
    x = torch.randn(5, spec.hidden_size)
    with torch.no_grad():
        on = model.module.lm_logits(x)
        with model.module.base_weights():
            off = model.module.lm_logits(x)
        a, b = (model.module.param(n).float() for n in (pair.a.name, pair.b.name))
    assert on.dtype == torch.float32
    torch.testing.assert_close(on - off, (x @ a.T) @ b.T * ALPHA / RANK, rtol=1e-4, atol=1e-5)


def test_adapter_dropout_draws_peft_s_masks_in_training_and_none_in_inference():
    ids, mask, _ = _full_rows()
    ref = peft_model("llama")
    for m in ref.modules():
        if hasattr(m, "lora_dropout"):
            m.lora_dropout["default"] = _SameDraw()
    lora = Lora(RANK, ALPHA, targets("llama"), dropout=DROPOUT)
    model = _rayhf("llama", from_peft(ref.state_dict()), lora)
    torch.manual_seed(5)
    logp = ref(input_ids=ids, attention_mask=mask).logits[:, :-1].log_softmax(-1)
    logp = logp.gather(-1, ids[:, 1:, None]).squeeze(-1)
    logp.mean().backward()
    want = from_peft({n: p.grad for n, p in ref.named_parameters() if p.grad is not None})
    got, grads = _dropout_grads(model, 5)
    torch.testing.assert_close(got, logp.detach(), rtol=1e-5, atol=1e-5)
    assert grads.keys() == want.keys() and len(grads) == 2 * len(model.module.adapters)
    for name, g in grads.items():
        torch.testing.assert_close(g, want[name], rtol=1e-4, atol=1e-6, msg=name)
    again, _ = _dropout_grads(model, 6)
    assert not torch.allclose(again, got), "another seed, other masks"

    plain = _rayhf("llama", from_peft(ref.state_dict()), replace(lora, dropout=0.0))
    assert torch.equal(_logits(model, ids, mask), _logits(plain, ids, mask)), "not in inference"


def _tp_rank(rank: int, path: str, full: dict, out: dict) -> None:
    import torch.distributed as dist

    from rayhf.parallel.groups import build_groups

    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=2)
    try:
        lora = Lora(RANK, ALPHA, targets("llama"), dropout=DROPOUT)
        model = _rayhf("llama", full, lora, groups=build_groups(1, 2, 1, rank))
        out[rank] = _dropout_grads(model, 5)
    finally:
        dist.destroy_process_group()


def test_tp_ranks_draw_the_masks_one_rank_draws_and_keep_their_columns(tmp_path):
    """Column-parallel adapters read the whole input, row-parallel ones their columns of it:
    with dropout, tp = 2 gives tp = 1's log-probs and adapter gradients."""
    import torch.multiprocessing as mp

    from rayhf.models.sharding import take_shard

    full = from_peft(peft_model("llama").state_dict())
    lora = Lora(RANK, ALPHA, targets("llama"), dropout=DROPOUT)
    one = _rayhf("llama", full, lora)
    want, grads = _dropout_grads(one, 5)
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_tp_rank, args=(str(tmp_path / "store"), full, out), nprocs=2)
        got = dict(out)
    rows = {p.name: p for p in param_shards(one.spec)}
    for rank in (0, 1):
        logp, mine = got[rank]
        torch.testing.assert_close(logp, want, rtol=1e-5, atol=1e-5)
        assert mine.keys() == grads.keys()
        for name, g in mine.items():
            shard = take_shard(grads[name], rows[name], 2, rank)
            torch.testing.assert_close(g, shard, rtol=1e-4, atol=1e-6, msg=name)


def test_a_train_call_with_dropout_seeds_the_generator_by_step_and_replica_then_restores_it():
    from rayhf.parallel.lora import dropout_seeded

    full = from_peft(peft_model("llama").state_dict())
    module = _rayhf("llama", full, Lora(RANK, ALPHA, targets("llama"), dropout=DROPOUT)).module

    def drawn(step: int, replica: int) -> torch.Tensor:
        with dropout_seeded(module, 1, step, replica):
            return torch.rand(4)

    torch.manual_seed(0)
    first = drawn(3, 0)
    after = torch.rand(4)
    assert torch.equal(drawn(3, 0), first), "a call's ranks and a rerun draw the same"
    assert not torch.equal(drawn(4, 0), first) and not torch.equal(drawn(3, 1), first)
    torch.manual_seed(0)
    assert torch.equal(torch.rand(4), after), "the generator as if nothing was drawn"
    plain = _rayhf("llama", full, Lora(RANK, ALPHA, targets("llama"))).module
    torch.manual_seed(0)
    with dropout_seeded(plain, 1, 3, 0):
        assert torch.equal(torch.rand(4), after), "without dropout, left as it was"


@pytest.mark.parametrize("case", ["llama", "gpt2"])  # gpt2: Conv1D weights kept [in, out]
def test_merged_weights_are_peft_s_merge_and_unload(case):
    from rayhf.models.lora import merged

    ref = peft_model(case, head=True)  # the head too: a linear layer in GPT-2 as well
    lora = Lora(RANK, ALPHA, targets(case, head=True))
    state = merged(from_peft(ref.state_dict()), lora, conv1d=case == "gpt2")
    want = ref.merge_and_unload().state_dict()
    assert state.keys() == want.keys()
    for name, w in want.items():
        torch.testing.assert_close(state[name], w, rtol=1e-6, atol=1e-6, msg=name)
    assert any(not torch.equal(state[n], _model(case, False).state_dict()[n]) for n in state)


def _greedy(engine, prompts: list[list[int]], model: RankModel):
    from rayhf.sampling import DecodeRules, GenerationConfig

    cfg = GenerationConfig(max_new_tokens=6, min_new_tokens=6, greedy=True)
    out = engine.generate(prompts, DecodeRules.of(cfg, model.eos_id, model.pad_id), 0)
    return out.tokens, torch.tensor(out.logprobs)


# gpt2: Conv1D weights and an untied head; qwen3_next: a shared expert's gate; qwen3_5_text:
# Gated DeltaNet projections
@pytest.mark.parametrize("case", ["llama", "gpt2", "qwen3_next", "qwen3_5_text"])
def test_the_decode_step_lends_adapted_weights_merged_and_samples_the_unmerged_tokens(case):
    from rayhf.parallel.decode import DecodeEngine, DecodeOptions

    full = from_peft(peft_model(case, head=True).state_dict())
    model = _rayhf(case, full, Lora(RANK, ALPHA, targets(case, head=True)))
    module, prompts = model.module, [[3, 5, 7, 9], [4, 6], [8, 3, 11]]
    merging = [DecodeEngine(model.pipe, DecodeOptions(pack=p)) for p in (True, False)]
    unmerged = DecodeEngine(model.pipe, DecodeOptions(merge_adapters=False))
    base = RankModel(model_files(_model(case, False).config, False), full, Tok())
    for round_ in range(2):  # the second after the adapters changed in place (a train step)
        tokens, logprobs = _greedy(unmerged, prompts, model)
        for engine in merging:
            got, got_logprobs = _greedy(engine, prompts, model)
            assert engine.lent is not None and engine.merges
            assert got == tokens, (case, round_)
            torch.testing.assert_close(got_logprobs, logprobs, rtol=1e-4, atol=1e-4)
        with module.base_weights():  # the reference's weights: the adapters neither on nor in
            assert not merging[1].merges
            assert (
                _greedy(merging[1], prompts, model)[0]
                == _greedy(DecodeEngine(base.pipe), prompts, base)[0]
            )
        with torch.no_grad():
            for pair in module.adapters.values():
                module.param(pair.b.name).mul_(-1.0)
    assert tokens != _greedy(DecodeEngine(base.pipe), prompts, base)[0]  # the adapters matter
