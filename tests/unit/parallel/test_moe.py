"""A Mixture-of-Experts layer on one rank (``rayhf.parallel.moe``): routing as Hugging Face's
routers route, experts as its per-expert loop computes them, and the grouped GEMM and its
batched stand-in giving the same values and gradients."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rayhf.checks.parity import CASES, _model
from rayhf.models.families import FAMILIES
from rayhf.models.spec import model_spec
from rayhf.parallel import moe


def _block(case: str):
    """The first sparse MoE block of the case's tiny model (eager experts), and its spec."""
    hf = _model(case, False)
    hf.config._experts_implementation = "eager"
    spec = model_spec(hf.config, False)
    block = hf.model.layers[spec.moe_layers[0]].mlp
    block.experts.config = hf.config
    return block, spec


def _route(block, h: torch.Tensor, spec, case: str, replay: torch.Tensor | None = None):
    """rayhf's routing of ``h`` with the block's router, as ``ShardedModel._moe_mlp`` calls it:
    weights, experts, the router's own experts."""
    traits = FAMILIES[case].moe
    assert spec.moe is not None and traits is not None
    if traits.router == "topk_softmax":  # gpt-oss: a router with a bias
        logits = F.linear(h, block.router.weight, block.router.bias)
        return moe.route(logits, spec.moe, traits, replay=replay)
    if traits.router == "sigmoid_grouped":  # from fp32 inputs, with the correction bias
        logits = F.linear(h.float(), block.gate.weight.float())
        bias = block.gate.e_score_correction_bias
        return moe.route(logits, spec.moe, traits, bias, replay)
    return moe.route(F.linear(h, block.gate.weight), spec.moe, traits, replay=replay)


def _hidden(n: int = 24, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(n, 32, generator=torch.Generator().manual_seed(3)).to(dtype)


CASES_MOE = ["qwen3_moe", "mixtral", "glm4_moe", "gpt_oss"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES_MOE)
def test_routing_chooses_and_weighs_the_experts_hugging_face_does(case, dtype):
    """GLM-4.5's sigmoid scores, chosen within groups with a (randomized) correction bias."""
    block, spec = _block(case)
    block.to(dtype)
    h = _hidden(dtype=dtype)
    router = block.router if case == "gpt_oss" else block.gate
    _, want_weights, want_ids = router(h)
    weights, ids, _ = _route(block, h, spec, case)
    order, want_order = ids.sort(-1), want_ids.sort(-1)  # GLM's top-k is unsorted
    assert torch.equal(order.values, want_order.values)
    got = weights.gather(1, order.indices)
    assert got.dtype == want_weights.dtype
    assert torch.equal(got, want_weights.gather(1, want_order.indices))


@pytest.mark.parametrize("case", CASES_MOE)
def test_the_experts_give_hugging_face_s_per_expert_loop_to_rounding(case):
    block, spec = _block(case)
    h = _hidden()
    with torch.no_grad():
        want = block(h[None])[0]
        if spec.moe is not None and spec.moe.shared_size:  # GLM-4.5's shared experts
            want = want - block.shared_experts(h[None])[0]
        weights, ids, _ = _route(block, h, spec, case)
        e = block.experts
        if case == "gpt_oss":  # [E, in, out], biased, a clamped SwiGLU
            gated = moe.clamped_swiglu(spec.moe.limit, spec.moe.alpha)
            up, down = e.gate_up_proj.transpose(1, 2), e.down_proj.transpose(1, 2)
            got = moe.experts(h, weights, ids, up, down, gated, gate_up_bias=e.gate_up_proj_bias)
            got = got + (weights.unsqueeze(-1) * e.down_proj_bias[ids]).sum(dim=1)
        else:
            got = moe.experts(h, weights, ids, e.gate_up_proj, e.down_proj, moe.glu(F.silu))
    assert (got - want).abs().max() < 1e-6 * want.abs().max()


@pytest.mark.parametrize("case", CASES_MOE)
def test_a_replayed_route_sends_each_token_where_it_says_weighed_by_the_router(case):
    """Replaying the router's own choice changes nothing, to the bit; replaying another choice
    (a token left at -1 keeps its own) weighs the given experts by the router's scores, as
    the router would have had it chosen them, with the router's gradient."""
    block, spec = _block(case)
    h = _hidden()
    weights, ids, own = _route(block, h, spec, case)
    assert torch.equal(ids, own)
    same = _route(block, h, spec, case, replay=ids.to(torch.int16))
    assert torch.equal(same[0], weights) and torch.equal(same[1], ids)
    other = (ids + 1) % spec.moe.n_experts  # every token to other experts
    other[:2] = -1
    router = block.router if case == "gpt_oss" else block.gate
    router.weight.grad = None
    got, got_ids, got_own = _route(block, h, spec, case, replay=other)
    assert torch.equal(got_own, own) and torch.equal(got_ids[2:], other[2:])
    assert torch.equal(got_ids[:2], ids[:2]) and torch.equal(got[:2], weights[:2])
    traits = FAMILIES[case].moe
    logits = F.linear(h, router.weight.float(), getattr(router, "bias", None))
    if traits.router == "topk_softmax":  # a softmax over the chosen logits
        want = logits[2:].gather(1, other[2:]).softmax(-1)
    else:
        scores = logits.sigmoid() if traits.router == "sigmoid_grouped" else logits.softmax(-1)
        want = scores[2:].gather(1, other[2:])
        if spec.moe.renormalize:
            want = want / want.sum(dim=-1, keepdim=True)
    assert torch.allclose(got[2:], want * spec.moe.scaling, atol=1e-6)
    (got * torch.arange(1, got.shape[1] + 1)).sum().backward()  # (each row's sum may be 1)
    assert router.weight.grad is not None and router.weight.grad.abs().sum() > 1e-3


def test_route_differs_counts_tokens_whose_expert_set_is_not_the_given_one():
    ids = torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7]])
    given = torch.tensor([[1, 0], [2, 4], [-1, -1], [6, 7]], dtype=torch.int16)
    assert moe.route_differs(ids, given).tolist() == [1, 3]  # order within the set is no change


def _run(grouped: bool, monkeypatch) -> tuple[torch.Tensor, ...]:
    """Output and gradients of 8 experts over 24 tokens (2 each), one expert chosen by none."""
    if not grouped:
        monkeypatch.setattr(moe, "_grouped_ok", lambda x, wt: False)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(24, 16, generator=gen, requires_grad=True)
    gate_up = torch.randn(8, 24, 16, generator=gen, requires_grad=True)
    down = torch.randn(8, 16, 12, generator=gen, requires_grad=True)
    logits = torch.randn(24, 8, generator=gen)
    logits[:, 5] = -1e4  # nobody's
    weights = torch.softmax(logits, -1).topk(2).values.requires_grad_()
    ids = logits.topk(2).indices
    out = moe.experts(x, weights, ids, gate_up, down, moe.glu(F.silu))
    out.pow(2).sum().backward()
    assert x.grad is not None and gate_up.grad is not None and down.grad is not None
    assert weights.grad is not None
    return out, x.grad, gate_up.grad, down.grad, weights.grad


def test_grouped_gemm_and_the_batched_product_agree_in_values_and_gradients(monkeypatch):
    grouped = _run(True, monkeypatch)
    batched = _run(False, monkeypatch)
    for a, b in zip(grouped, batched, strict=True):
        assert (a - b).abs().max() <= 1e-5 * b.abs().max()
    assert torch.equal(grouped[2][5], torch.zeros_like(grouped[2][5]))  # an idle expert


def test_grouped_gemm_runs_only_on_aligned_operands():
    x = torch.zeros(6, 16)
    assert moe._grouped_ok(x, torch.zeros(4, 16, 8))
    assert not moe._grouped_ok(torch.zeros(6, 15), torch.zeros(4, 15, 8))  # 60-byte rows
    assert not moe._grouped_ok(x[:, 1:5], torch.zeros(4, 4, 8))  # starts 4 bytes in
    assert set(CASES_MOE) <= set(CASES)
