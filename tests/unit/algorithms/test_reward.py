"""The reward call: function rewards on decoded text, reward models at the last token."""

from __future__ import annotations

import torch

from rayhf.algorithms import CallContext, InterfaceSettings, make_interface
from rayhf.algorithms.ppo import PPOConfig
from rayhf.data.batch import PackedBatch
from rayhf.engines.build import standalone_engine
from rayhf.engines.call import CallEngine
from rayhf.engines.collectives import DataParallel
from rayhf.models.hf import ModelInit, build_model, hf_config, per_token_values
from rayhf.sampling import GenerationConfig
from rayhf.tasks.demo import build_tokenizer


def _batch(tok, answers: list[tuple[str, bool]]) -> PackedBatch:
    """Prompt "1 2 =" with each answer, EOS appended where the flag says so."""
    prompt = [tok.bos_token_id, *tok.encode("1 2 =", add_special_tokens=False)]
    seqs = [
        prompt + tok.encode(a, add_special_tokens=False) + ([tok.eos_token_id] if eos else [])
        for a, eos in answers
    ]
    b = PackedBatch(list(range(len(seqs))))
    b.add("seq", torch.tensor([t for s in seqs for t in s]), [len(s) for s in seqs])
    b.add("prompt_lens", torch.tensor([len(prompt)] * len(seqs)), [1] * len(seqs))
    return b


def test_function_reward_scores_decoded_text_without_eos():
    tok = build_tokenizer()
    settings = InterfaceSettings(PPOConfig(), GenerationConfig(), "rayhf.tasks.demo:reward")
    iface = make_interface("reward", settings)
    engine = CallEngine(tok, None, DataParallel(None))
    out = iface.inference(
        engine, _batch(tok, [("1 2", True), ("a 3", False)]), CallContext(1, 0, 1, 0)
    )
    assert out.tensors["scores"].tolist() == [1.0, 0.0]


def test_reward_model_scores_last_token_and_cut_off_answers_get_no_eos_score():
    tok = build_tokenizer()
    config = hf_config(ModelInit(hidden_size=32), len(tok), 0, 1, 2)
    model = build_model(config, value_head=True, seed=0).eval()
    engine = standalone_engine(model, tok, True)
    iface = make_interface("reward", InterfaceSettings(PPOConfig(), GenerationConfig()))
    batch = _batch(tok, [("1 2", True), ("2 2 1", False)])
    plain = iface.inference(engine, batch, CallContext(1, 0, 1, 0)).tensors["scores"]
    ids = batch.sample("seq", 0).unsqueeze(0)
    with torch.no_grad():
        expected = per_token_values(model, ids, torch.ones_like(ids))[0, -1]
    assert torch.allclose(plain[0], expected)
    ctx = CallContext(1, 0, 1, 0, {"no_eos_score": -5.0})
    guarded = iface.inference(engine, batch, ctx).tensors["scores"]
    assert guarded[0] == plain[0] and guarded[1] == -5.0 and plain[1] != -5.0
