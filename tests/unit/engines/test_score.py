"""The sliced scoring head (``RankModel.score``): log-probs, entropies and their gradients equal
the plain path's (whole logits, then ``scores_from_logits``), with the LM head cut into slices of
3 tokens and in one slice; with ``fp32_lm_head`` at bf16, the head's log-probs are an fp32
computation on the hidden states it gets. Every layout and bf16 are checked by the parity harness
(``scores`` and ``grads``)."""

from __future__ import annotations

import pytest
import torch

import rayhf.parallel.model
from rayhf.algorithms.lm import scores_from_logits
from rayhf.checks.common import VOCAB, Tok
from rayhf.checks.parity import _batch, _model, _targets
from rayhf.engines.build import standalone_engine
from rayhf.engines.rank_model import RankModel
from rayhf.models.precision import Numerics
from rayhf.parallel.groups import single


@pytest.fixture(autouse=True, params=[3, None], ids=["3-token slices", "one slice"])
def slices(request, monkeypatch):
    """Slices of 3 tokens, recomputed in backward; or the default, one slice kept."""
    if request.param is not None:
        monkeypatch.setattr(rayhf.parallel.model, "LOGIT_CHUNK", request.param * VOCAB)


def _grads(engine, loss_of) -> dict[str, torch.Tensor]:
    module = engine.model.module
    module.train(True)
    for p in module.parameters():
        p.requires_grad_(True)
        p.grad = None
    loss_of().backward()
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", ["llama", "gemma2"])  # gemma2: tied head, soft-capped logits
def test_sliced_scores_and_gradients_equal_the_plain_path(family):
    engine = standalone_engine(_model(family, False), Tok(), False, None, single())
    ids, mask = _batch()
    targets = _targets(ids, mask)
    scored = targets >= 0
    weights = torch.randn(*ids.shape, 2, generator=torch.Generator().manual_seed(1))

    def sliced():
        return engine.score(ids, mask, targets, 0.7)

    def plain():
        return scores_from_logits(engine.forward(ids, mask), targets, 0.7)

    with torch.no_grad():
        got, want = sliced(), plain()
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert got[~scored].eq(0).all() and got[scored][:, 1].gt(0).all()  # entropies > 0
    g_sliced = _grads(engine, lambda: (sliced() * weights).sum())
    g_plain = _grads(engine, lambda: (plain() * weights).sum())
    assert g_sliced.keys() == g_plain.keys()
    for name, g in g_plain.items():
        torch.testing.assert_close(g_sliced[name], g, rtol=0, atol=1e-5, msg=name)
    assert max(g.abs().max() for g in g_plain.values()) > 1e-2  # the gradients are not ~0


def test_no_target_scores_zeros_and_still_backpropagates():
    engine = standalone_engine(_model("llama", False), Tok(), False, None, single())
    ids, mask = _batch()
    none = torch.full_like(ids, -1)
    grads = _grads(engine, lambda: engine.score(ids, mask, none).sum())
    assert grads and all(g.eq(0).all() for g in grads.values())  # the layers' are there, all 0
    assert engine.score(ids, mask, none).eq(0).all()


@pytest.mark.parametrize("master", [True, False], ids=["fp32 master weights", "a bf16 copy"])
@pytest.mark.parametrize("family", ["llama", "gemma2"])  # gemma2: tied head, soft-capped logits
def test_an_fp32_lm_head_scores_its_hidden_states_in_fp32(family, master, head_inputs, head_logits):
    """At bf16 (under autocast for fp32 master weights), ``fp32_lm_head`` makes the scoring
    path's log-probs and the forward's logits those of an fp32 head on the same hidden states,
    not the bf16 head's; the head's weight still gets its gradient."""
    numerics = Numerics("bf16", master=master, fp32_lm_head=True)
    model = RankModel.from_hf(_model(family, False), Tok(), False, numerics=numerics)
    module = model.module
    seen = head_inputs(module)
    ids, mask = _batch()
    targets = _targets(ids, mask)
    scored = targets >= 0
    with torch.no_grad():
        got = model.score(ids, mask, targets, 0.7)[scored][:, 0]
    h, y = torch.cat(seen), targets[scored]
    assert len(h) == len(y)

    def logp(dtype: torch.dtype) -> torch.Tensor:
        z = head_logits(module, h, dtype) / 0.7
        return z.log_softmax(-1).gather(-1, y[:, None]).squeeze(-1)

    torch.testing.assert_close(got, logp(torch.float32), rtol=0, atol=1e-5)
    assert (got - logp(torch.bfloat16)).abs().max() > 1e-4  # 10x the tolerance above
    seen.clear()
    with torch.no_grad():
        logits = model.forward(ids, mask)[mask.bool()]
    torch.testing.assert_close(
        logits, head_logits(module, seen[0], torch.float32), rtol=0, atol=1e-5
    )
    assert (logits - head_logits(module, seen[0], torch.bfloat16)).abs().max() > 1e-4
    if master:  # a trained role: the head's fp32 weight learns through the fp32 matmul
        head = module.param(module.head_name)
        head.requires_grad_(True)
        model.score(ids, mask, targets, 0.7).sum().backward()
        assert head.grad is not None and head.grad.dtype == torch.float32
        assert head.grad.abs().max() > 0
