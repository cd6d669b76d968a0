"""Activation checkpointing (``ShardedModel.checkpointing``): the same gradients, and the memory
it saves measured as the bytes autograd keeps for backward."""

from __future__ import annotations

import torch

from rayhf.checks.common import VOCAB, Tok, tiny_model
from rayhf.engines.rank_model import RankModel
from rayhf.parallel.attention import TokenLayout

SHAPE = {"n_heads": 4, "n_kv_heads": 2}  # 4 layers, 32 wide


def _loss_and_saved_bytes(model: RankModel, ids: torch.Tensor, lens: list[int]):
    """The mean logit of a training forward, and the bytes of every tensor saved for backward
    while it ran (what activation memory holds until backward)."""
    saved: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.numel() * t.element_size())
        return t

    model.module.train(True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model.module(ids, TokenLayout.packed(lens))
    return out.float().mean(), sum(saved)


def test_checkpointing_keeps_the_gradients_and_saves_activation_memory():
    g = torch.Generator().manual_seed(0)
    lens = [64, 48, 80]
    ids = torch.randint(3, VOCAB, (sum(lens),), generator=g)
    results = {}
    for on in (False, True):
        hf = tiny_model("llama", SHAPE, seed=1)
        model = RankModel.from_hf(hf, Tok(), False, checkpointing=on)
        loss, saved = _loss_and_saved_bytes(model, ids, lens)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.module.named_parameters()}
        results[on] = (loss.item(), saved, grads)
    (loss_off, saved_off, grads_off), (loss_on, saved_on, grads_on) = results[False], results[True]
    assert loss_on == loss_off
    for name, grad in grads_off.items():
        torch.testing.assert_close(grads_on[name], grad, rtol=1e-5, atol=1e-7, msg=name)
    # measured 3.53 MB -> 0.20 MB: the layers' inputs and the head's activations stay
    assert saved_on < 0.1 * saved_off, (saved_on, saved_off)
    with torch.no_grad():  # inference never recomputes: nothing is saved either way
        hf = tiny_model("llama", SHAPE, seed=1)
        model = RankModel.from_hf(hf, Tok(), False, checkpointing=True)
        assert _loss_and_saved_bytes(model, ids, lens)[1] == 0
