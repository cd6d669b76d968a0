"""The analytic cost model (``rayhf.planner.cost``): how time and memory respond to layouts,
the decode step, launch floors and engines (no Ray)."""

from __future__ import annotations

import dataclasses

import pytest
from planner_support import GRAPH, SPECS, WORKS

from rayhf.engines.config import DeepSpeedEngineConfig, TorchEngineConfig, VllmEngineConfig
from rayhf.models.shapes import public_shape
from rayhf.parallel.layout import Layout
from rayhf.planner.cost import (
    VLLM_KV_BYTES,
    AnalyticCost,
    Rows,
    Workload,
    _sizes,
    max_shard_params,
    max_trained_params,
    scoring_bytes,
)
from rayhf.planner.hardware import parse_cluster
from rayhf.planner.plan import Plan
from rayhf.planner.problem import Problem
from rayhf.planner.simulate import simulate


def test_cost_model_responds_to_layout_as_expected():
    cost = AnalyticCost(parse_cluster("1x8xH100"))
    spec, work = SPECS["actor"], WORKS["actor_train"]
    one = cost.call(spec, Layout((0,), 1), work)
    eight_dp = cost.call(spec, Layout(tuple(range(8)), 8), work)
    eight_tp = cost.call(spec, Layout(tuple(range(8)), 1, 8), work)
    assert eight_dp.seconds < one.seconds / 4, "8 replicas cut compute time"
    assert eight_tp.memory < eight_dp.memory / 3, "tp=8 shards weights and optimizer state"
    assert one.memory > 80e9, "a 7B model with AdamW does not fit one 80 GB device"
    gen = cost.call(spec, Layout(tuple(range(8)), 8), WORKS["actor_gen"])
    assert gen.parts["decode"] > gen.parts["prefill"], "decoding 128 tokens is memory bound"


def test_a_captured_decode_step_reads_weights_and_filled_keys_once():
    """The native decode step is one graph per stage: a 7B model's step at 16 rows costs the
    bytes it reads (its weight shard, the filled keys and values once, however many query heads
    share a key head), not the host's launches; a tiny model's costs the graph launch."""
    cost = AnalyticCost(parse_cluster("1x8xH100"))
    spec, lay = SPECS["actor"], Layout(tuple(range(2)), 2)
    step = cost.decode_seconds(spec, lay, 16, 256)
    bw = cost.cluster.device.memory_bandwidth * cost.eff.memory
    kv = 2 * spec.n_layers * 16 * 256 * spec.n_kv_heads * spec.head_dim * 2
    assert step == pytest.approx((2 * 6.5e9 + kv) / bw, rel=0.05)
    longer = cost.decode_seconds(spec, lay, 16, 512)
    assert longer - step == pytest.approx(kv / bw, rel=0.05), "each filled key is read once"
    grouped = dataclasses.replace(spec, n_kv_heads=spec.n_heads // 8)
    saved = step - cost.decode_seconds(grouped, lay, 16, 256)
    # 7/8 of the keys and values go (and the k/v projections shrink too)
    assert saved >= kv * 7 / 8 / bw, "grouped query heads share their key head"
    tiny = dataclasses.replace(spec, hidden_size=64, n_layers=2, intermediate_size=128)
    assert cost.decode_seconds(tiny, Layout((0,), 1), 1, 8) >= cost.eff.replay_seconds
    tp8 = cost.decode_seconds(spec, Layout(tuple(range(8)), 1, 8), 16, 256)
    assert tp8 < step, "tp=8 reads a quarter of tp=2's shard per device"
    one_seq = cost.forward_seconds(spec, Layout((0,), 1), Rows(1, 1))
    assert one_seq >= 2 * 6.5e9 / bw, "a one-token forward still reads every weight"


def test_engines_change_the_memory_the_planner_counts():
    cost = AnalyticCost(parse_cluster("1x8xH100"))
    spec, lay = SPECS["actor"], Layout(tuple(range(8)), dp=8)
    train = WORKS["actor_train"]
    torch_b = cost.resident(spec, lay, True, train)
    ds = DeepSpeedEngineConfig()
    by_stage = [
        cost.resident(spec, lay, True, dataclasses.replace(train, engine=ds, zero_stage=z))
        for z in (1, 2, 3)
    ]
    assert torch_b > by_stage[0] > by_stage[1] > by_stage[2]
    weights = cost.resident(spec, lay, False)
    assert by_stage[2] == pytest.approx(weights * 2 / 8 + (torch_b - 2 * weights) / 8)
    offload = dataclasses.replace(train, engine=DeepSpeedEngineConfig(), zero_stage=2, offload=True)
    # DeepSpeed's bf16 mode: bf16 weights and gradients (the fp32 master offloaded)
    assert cost.resident(spec, lay, True, offload) == pytest.approx(weights + weights / 8)
    # ... and what it saves in memory costs time: the state's pass in host memory, the gradients
    # down and the weights up PCIe (2 bytes each way a parameter, 16 read and written)
    on_gpu = dataclasses.replace(offload, offload=False)
    owned = cost.call(spec, lay, on_gpu).parts["optimizer"]
    moved = cost.call(spec, lay, offload).parts["optimizer"]
    params = max_shard_params(spec, 1, 1) / 8  # ZeRO-2: this rank's eighth of the state
    host = 2 * 2 / 64e9 + 2 * 16 / (614e9 / 8 * cost.eff.memory)
    gpu = 2 * 16 / (3.35e12 * cost.eff.memory)
    steps = train.epochs * train.n_minibatches
    assert moved - owned == pytest.approx(steps * params * (host - gpu), rel=1e-6)
    gen = WORKS["actor_gen"]
    vllm = dataclasses.replace(gen, engine=VllmEngineConfig())
    extra = cost.memory(spec, lay, vllm) - cost.memory(spec, lay, gen)
    assert extra == pytest.approx(weights + VLLM_KV_BYTES)  # its own weights and KV cache
    plan = Plan({c.name: lay for c in GRAPH.calls}, "colocated")
    works = {**WORKS, "actor_gen": vllm}
    plain, with_vllm = (simulate(Problem(GRAPH, SPECS, w, cost), plan) for w in (WORKS, works))
    assert max(with_vllm.peak_memory.values()) == pytest.approx(
        max(plain.peak_memory.values()) + extra
    )


def test_the_role_s_precision_sets_the_bytes_priced():
    """Frozen copies at the role's dtype, moving-average roles and trained roles with fp32
    weights, gradients and moments (16 bytes a parameter at any precision)."""
    from rayhf.models.precision import priced
    from rayhf.models.sharding import shard_numel

    cost = AnalyticCost(parse_cluster("1x8xH100"))  # the device's default: bf16
    lay = Layout((0,), 1)
    base = public_shape("llama2-7b")
    n = shard_numel(base, 1, 1, 0, 0)
    fp32, bf16, auto = (priced(base, p, False) for p in ("fp32", "bf16", "auto"))
    assert cost.resident(fp32, lay, False) == 4 * n
    assert cost.resident(bf16, lay, False) == cost.resident(auto, lay, False) == 2 * n
    assert cost.resident(priced(base, "bf16", True), lay, False) == 4 * n  # EMA: fp32
    for spec in (fp32, bf16):
        assert cost.resident(spec, lay, True, WORKS["actor_train"]) == 16 * n
    # ZeRO-3 over 8: the torch engine's fp32 weights, DeepSpeed's bf16 ones (+ fp32 master)
    dp8 = Layout(tuple(range(8)), 8)
    z3 = dataclasses.replace(WORKS["actor_train"], engine=DeepSpeedEngineConfig(), zero_stage=3)
    m = shard_numel(base, 1, 1, 0, 0)
    assert cost.resident(bf16, dp8, True, z3) == pytest.approx((2 + 2 + 12) * m / 8)
    assert cost.resident(fp32, dp8, True, z3) == pytest.approx((4 + 4 + 8) * m / 8)
    assert cost._gather_seconds(bf16, dp8, z3) < cost._gather_seconds(fp32, dp8, z3)
    gen = Workload("generate", 64, 128, 128)
    assert cost.memory(fp32, lay, gen) > cost.memory(bf16, lay, gen)  # weights and KV cache
    train = Workload("train", 64, 128, 128)
    assert cost.call(fp32, lay, train).seconds > cost.call(bf16, lay, train).seconds


def test_checkpointing_and_token_budgets_trade_time_for_memory():
    cost = AnalyticCost(parse_cluster("1x8xH100"))
    spec, lay = public_shape("llama2-7b"), Layout(tuple(range(8)), 8)
    train = Workload("train", 512, 512, 1024, 4, zero_stage=1)
    plain = cost.call(spec, lay, train)
    ckpt = cost.call(spec, lay, dataclasses.replace(train, checkpointing=True))
    assert ckpt.memory < plain.memory and ckpt.seconds > plain.seconds
    # a budget of a quarter of a minibatch's tokens (16 rows of 1536): 4 micro-batches
    budget = dataclasses.replace(train, token_budget=4 * 1536)
    assert budget.micro_batches(16, 1536) == 4 and train.micro_batches(16, 1536) == 1
    cut = cost.call(spec, lay, budget)
    assert cut.memory < plain.memory and cut.seconds >= plain.seconds
    infer = Workload("inference", 512, 512, 1024)
    assert cost.memory(spec, lay, dataclasses.replace(infer, token_budget=1536)) < cost.memory(
        spec, lay, infer
    )


def test_zero_stages_trade_memory_for_time():
    """Stages 1-2 split the optimizer (less memory, a shorter AdamW step); stage 3 also splits
    the weights and pays its gathers, which hide under the compute only while that is longer.
    (Stage 1 on the torch engine reduces fp32 gradients, DeepSpeed's 2 and 3 bf16 ones.)"""
    cost = AnalyticCost(parse_cluster("2x8xH100"))
    spec, lay = public_shape("llama2-7b"), Layout(tuple(range(16)), 16)
    work = Workload("train", 512, 128, 128, 4)
    by_stage = {z: cost.call(spec, lay, work.with_stage(z)) for z in range(4)}
    mem = [by_stage[z].memory for z in range(4)]
    assert mem[0] > mem[1] > mem[2] > mem[3]
    assert by_stage[1].parts["optimizer"] < by_stage[0].parts["optimizer"]
    assert by_stage[3].seconds >= by_stage[2].seconds
    assert by_stage[2].parts["optimizer"] < by_stage[1].parts["optimizer"]  # bf16 gradients
    assert work.with_stage(3).engine == DeepSpeedEngineConfig(zero_stage=3)
    assert work.with_stage(1).engine == TorchEngineConfig()
    small = Workload("train", 16, 16, 16, 4).with_stage(3)  # little compute: the gathers show
    gathers = 4 * 3 * cost._gather_seconds(spec, lay, small)
    assert cost.call(spec, lay, small).parts["forward_backward"] == pytest.approx(gathers)


def test_a_train_call_pays_for_its_epochs_and_its_forward_without_gradients():
    cost = AnalyticCost(parse_cluster("1x8xH100"))
    spec, lay, train = SPECS["actor"], Layout(tuple(range(8)), 8), WORKS["actor_train"]
    one = cost.call(spec, lay, train)
    two = cost.call(spec, lay, dataclasses.replace(train, epochs=2))
    assert two.parts["forward_backward"] == pytest.approx(2 * one.parts["forward_backward"])
    assert two.parts["optimizer"] == pytest.approx(2 * one.parts["optimizer"])
    prox = cost.call(spec, lay, dataclasses.replace(train, forward_share=0.75))
    share = -(-train.n_seqs // lay.dp * 3 // 4)  # 3/4 of a replica's sequences, rounded up
    seq = train.prompt_len + train.gen_len
    forward = cost.forward_seconds(spec, lay, Rows(share, seq), work=train)
    assert prox.seconds == pytest.approx(one.seconds + forward) and forward > 0


def test_a_token_multiplies_only_its_experts_and_a_decode_step_reads_the_chosen_ones():
    """Qwen3-30B-A3B: 30.5B parameters, of which a token multiplies about 3B (8 of 128 experts
    a layer). A one-row decode step reads the experts it chooses; 64 rows choose nearly all."""
    cost = AnalyticCost(parse_cluster("1x8xH100"))
    spec, lay = public_shape("qwen3-30b-a3b"), Layout(tuple(range(8)), 8)
    total, active, _ = _sizes(spec)
    assert total == pytest.approx(30.5e9, rel=0.01) and active == pytest.approx(3.04e9, rel=0.01)
    bw = cost.cluster.device.memory_bandwidth * cost.eff.memory
    one, many = cost.decode_seconds(spec, lay, 1, 64), cost.decode_seconds(spec, lay, 64, 64)
    assert one == pytest.approx(2 * active / bw, rel=0.1)  # bf16: 2 bytes a parameter
    assert many == pytest.approx(2 * (total - 0.31e9) / bw, rel=0.1)  # all but the embedding
    assert spec.moe is not None
    every = dataclasses.replace(spec, moe=dataclasses.replace(spec.moe, top_k=128))
    train = Workload("train", 64, 512, 512)
    sparse, full = (cost.call(s, lay, train).parts for s in (spec, every))
    assert sparse["forward_backward"] < full["forward_backward"] / 8
    assert sparse["optimizer"] == full["optimizer"]  # every expert's weights step


def test_experts_split_over_ep_ranks_cost_exchanges_and_save_memory():
    """Qwen3-30B-A3B's train call on 16 H100s: ep = 8 holds an eighth of the experts (memory
    and optimizer time shrink), pays an exchange per MoE layer, over NVLink within a node and
    far more across the two nodes (ep = 16); a dense model's layouts have no ep to price."""
    cost = AnalyticCost(parse_cluster("2x8xH100"))
    spec, mesh = public_shape("qwen3-30b-a3b"), tuple(range(16))
    train = Workload("train", 512, 256, 1024, 4)
    plain, ep8, ep16 = (cost.call(spec, Layout(mesh, 16, ep=ep), train) for ep in (1, 8, 16))
    assert ep8.memory < plain.memory / 4 and ep16.memory < ep8.memory
    assert ep8.parts["optimizer"] < plain.parts["optimizer"] / 4
    assert ep8.parts["forward_backward"] > plain.parts["forward_backward"]  # the exchanges
    across = ep16.parts["forward_backward"] - plain.parts["forward_backward"]
    within = ep8.parts["forward_backward"] - plain.parts["forward_backward"]
    assert across > 4 * within, "an ep group across nodes exchanges over the slower links"
    assert cost.exchange_seconds(SPECS["actor"], Layout(mesh, 16), 1000.0, True) == 0.0


def test_sequences_split_over_cp_ranks_cost_exchanges_and_save_activation_memory():
    """Qwen2.5-7B's train call at 16k tokens a sequence on 8 H100s, micro-batches cut at two
    sequences' tokens: cp = 4 over dp = 8 takes 2 shares of the batch, so each device computes
    the tokens of a quarter of a share, as dp = 8 does an eighth of the batch, plus attention's
    exchanges; a device holds a quarter of each micro-batch's activations."""
    cost = AnalyticCost(parse_cluster("1x8xH100"))
    spec, mesh = public_shape("qwen2.5-7b"), tuple(range(8))
    train = Workload("train", 16, 1024, 16384, 1, checkpointing=True, token_budget=2 * 17408)
    plain, cp2, cp4 = (cost.call(spec, Layout(mesh, 8, cp=cp), train) for cp in (1, 2, 4))
    exchanges = cost.context_seconds(spec, Layout(mesh, 8, cp=4), 4 * 17408, True)
    assert exchanges > 0 and cost.context_seconds(spec, Layout(mesh, 8), 1000.0, True) == 0.0
    assert cp4.parts["forward_backward"] > plain.parts["forward_backward"]  # the exchanges
    assert cp4.parts["forward_backward"] < 1.2 * plain.parts["forward_backward"]
    # beside the weights, one LM-head slice's logits (the same at every cp)
    resident = cost.resident(spec, Layout(mesh, 8), True, train) + scoring_bytes(spec, 1e9)
    acts = [c.memory - resident for c in (plain, cp2, cp4)]
    assert acts[1] == pytest.approx(acts[0] / 2, rel=0.02)
    assert acts[2] == pytest.approx(acts[0] / 4, rel=0.02)


def _hybrid_spec(hybrid: bool):
    from rayhf.models.hf import ModelInit, hf_config
    from rayhf.models.spec import model_spec

    kinds = ["linear_attention"] * 3 + ["full_attention"] if hybrid else ["full_attention"] * 4
    init = ModelInit(
        family="qwen3_5_text", hidden_size=1024, n_layers=16, n_heads=8, n_kv_heads=2,
        max_positions=40000,
        config={"linear_num_key_heads": 8, "linear_num_value_heads": 16,
                "linear_key_head_dim": 128, "linear_value_head_dim": 128,
                "layer_types": kinds * 4},
    )  # fmt: skip
    return model_spec(hf_config(init, 32000, 0, 1, 2), False)


def test_a_hybrid_model_s_deltanet_layers_cost_linear_in_length():
    """Three DeltaNet layers in four: a generate call at 32k tokens holds about a quarter of the
    cache of the same model with attention everywhere, its decode step reads less, and its
    train call's time grows more slowly with length."""
    cost = AnalyticCost(parse_cluster("1x8xH100"))
    hybrid, full = _hybrid_spec(True), _hybrid_spec(False)
    assert len(hybrid.delta_layers) == 12 and not full.delta_layers
    lay = Layout(tuple(range(1)), 1)
    gen = Workload("generate", 64, 1024, 31 * 1024)
    kv_h, kv_f = (cost.memory(s, lay, gen) - cost.resident(s, lay, False) for s in (hybrid, full))
    assert 3.5 < kv_f / kv_h < 4.0
    step_h, step_f = (cost.decode_seconds(s, lay, 64, 32768) for s in (hybrid, full))
    assert step_h < step_f / 2
    short, long = Workload("train", 64, 256, 256), Workload("train", 64, 256, 8 * 1024 - 256)
    growth_h, growth_f = (
        cost.call(s, lay, long).seconds / cost.call(s, lay, short).seconds for s in (hybrid, full)
    )
    assert growth_h < growth_f


def test_a_lora_role_steps_and_reduces_only_its_adapters_and_skips_frozen_weight_gradients():
    """Qwen2.5-7B with rank-16 adapters on every linear layer: 40.4M of 7.6B parameters train.
    Its train call keeps gradients and AdamW state for those alone, reduces them alone over dp,
    and its backward computes no frozen weight's gradient (two passes of the frozen matmuls
    where full fine-tuning runs three); its other calls cost what the base model's do."""
    from rayhf.models.lora import LoraConfig, with_lora

    cost = AnalyticCost(parse_cluster("1x8xH100"))
    full = public_shape("qwen2.5-7b")
    lora = with_lora(full, LoraConfig(rank=16), "models.actor.lora")
    lay, work = Layout(tuple(range(8)), 8), Workload("train", 64, 256, 256, checkpointing=True)
    trained = max_trained_params(lora, 1, 1)
    assert trained == pytest.approx(40.4e6, rel=0.01)
    assert max_trained_params(full, 2, 2) == max_shard_params(full, 2, 2)
    assert max_shard_params(lora, 1, 1) == max_shard_params(full, 1, 1) + trained
    saved = cost.call(full, lay, work).memory - cost.call(lora, lay, work).memory
    # the base's fp32 gradients and two moments, less the adapters' weights, grads and moments
    assert saved == pytest.approx(12 * max_shard_params(full, 1, 1) - 16 * trained, rel=1e-6)
    a, b = cost.call(full, lay, work).parts, cost.call(lora, lay, work).parts
    assert b["optimizer"] < a["optimizer"] / 50
    assert 0.6 < b["forward_backward"] / a["forward_backward"] < 0.85  # (2 + 1) / (3 + 1)
    gen = Workload("generate", 64, 256, 256)
    assert cost.call(lora, lay, gen).seconds == pytest.approx(
        cost.call(full, lay, gen).seconds, rel=0.01
    )
