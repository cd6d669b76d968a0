"""The reward call: function rewards on decoded text, reward models at the last token."""

from __future__ import annotations

import pytest
import torch

from rayhf.algorithms import CallContext, InterfaceSettings
from rayhf.algorithms.ppo import PPOConfig
from rayhf.algorithms.reward import check_columns, wanted_columns
from rayhf.config.registry import make_interface
from rayhf.data.batch import PackedBatch
from rayhf.engines.build import standalone_engine
from rayhf.engines.call import CallEngine
from rayhf.engines.collectives import DataParallel
from rayhf.errors import RayhfError
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


def _answer_reward(prompts, responses, answer, finished, tag="x"):
    return [
        float(r == a and f) + (0.5 if tag == "x" else 0.0)
        for r, a, f in zip(responses, answer, finished, strict=True)
    ]


def _takes_all(prompts, responses, **more):
    return [float(len(more["finished"]) + len(more)) for _ in prompts]


def test_function_reward_receives_the_row_columns_and_eos_it_names():
    tok = build_tokenizer()
    engine = CallEngine(tok, None, DataParallel(None))
    batch = _batch(tok, [("1 2", True), ("1 2", False), ("2 1", True)])
    batch.add_extra("answer", ["1 2", "1 2", "1 2"])
    batch.add_extra("source", ["s", "s", "s"])
    for ref, expected in [
        (f"{__name__}:_answer_reward", [1.5, 0.5, 0.5]),  # answer and finished; tag keeps default
        (f"{__name__}:_takes_all", [6.0, 6.0, 6.0]),  # **more: both columns and finished
    ]:
        settings = InterfaceSettings(PPOConfig(), GenerationConfig(), ref)
        out = make_interface("reward", settings).inference(engine, batch, CallContext(1, 0, 1, 0))
        assert out.tensors["scores"].tolist() == expected


def test_a_reward_needing_a_column_the_dataset_lacks_is_refused_by_name():
    assert wanted_columns(_answer_reward) == (["answer", "finished"], ["tag"], False)
    check_columns(_answer_reward, "m:f", ["answer", "source"], "d.parquet")
    with pytest.raises(
        RayhfError,
        match=r"reward function m:f needs column 'answer', which "
        r"dataset file d.parquet does not have \(it has \['source'\]\)",
    ):
        check_columns(_answer_reward, "m:f", ["source"], "d.parquet")


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
