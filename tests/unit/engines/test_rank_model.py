"""A rank's model on one process (dp = tp = pp = 1) against the Hugging Face model it came from:
forward, the whole-model state and its round trips, and the move surface that bumps ``version``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from rayhf.checks.common import EOS, PAD, VOCAB, tiny_model
from rayhf.engines.rank_model import RankModel
from rayhf.models.hf import ModelInit, build_model, hf_config, model_files, per_token_values

SHAPE = {"n_heads": 4, "n_kv_heads": 2}  # grouped-query attention


class Tok:
    """The ids a rank reads of a tokenizer, and a save that leaves a mark."""

    pad_token_id, eos_token_id = PAD, EOS

    def save_pretrained(self, out_dir) -> None:
        (Path(out_dir) / "tok.txt").write_text("saved")


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(3, VOCAB, (3, 7), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 4:] = 0
    mask[2, 2:] = 0
    return ids.masked_fill(mask == 0, PAD), mask


def _hf_out(model, ids, mask, value_head: bool) -> torch.Tensor:
    with torch.no_grad():
        if value_head:
            return per_token_values(model, ids, mask)
        return model(ids, attention_mask=mask).logits


@pytest.mark.parametrize("value_head", [False, True])
def test_forward_matches_hugging_face_and_zeroes_padding(value_head):
    hf = tiny_model("llama", SHAPE, value_head)
    rank = RankModel.from_hf(hf, Tok(), value_head)
    ids, mask = _inputs()
    out = rank.forward(ids, mask)
    expected = _hf_out(hf, ids, mask, value_head)
    assert out.shape == expected.shape  # [B, T, V] logits or [B, T] values
    keep = mask.bool()
    torch.testing.assert_close(out[keep], expected[keep], rtol=1e-5, atol=1e-5)
    assert out[~keep].abs().sum() == 0
    assert rank.spec.value_head is value_head and not rank.module.training


def test_ids_and_sizes():
    hf = tiny_model("llama", SHAPE)
    rank = RankModel.from_hf(hf, Tok(), False)
    assert (rank.pad_id, rank.eos_id, rank.version) == (PAD, EOS, 0)
    assert rank.device == torch.device("cpu")
    assert rank.local_bytes() == 4 * sum(p.numel() for p in hf.parameters())
    assert rank.digest() == pytest.approx(
        float(sum(p.detach().abs().sum() for p in hf.parameters()))
    )


def test_full_state_is_the_hugging_face_state_dict():
    hf = tiny_model("llama", SHAPE)
    full = RankModel.from_hf(hf, Tok(), False).full_state()
    expected = hf.state_dict()
    assert set(full) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(full[name], tensor), name
        assert not full[name].requires_grad


def test_full_state_of_tied_embeddings_names_the_head_too():
    config = hf_config(ModelInit(hidden_size=32, n_heads=4), VOCAB, PAD, 2, EOS)
    config.tie_word_embeddings = True
    hf = build_model(config, value_head=False).eval()
    rank = RankModel.from_hf(hf, Tok(), False)
    full = rank.full_state()
    assert torch.equal(full["lm_head.weight"], full["model.embed_tokens.weight"])
    ids, mask = _inputs()
    torch.testing.assert_close(
        rank.forward(ids, mask)[mask.bool()], _hf_out(hf, ids, mask, False)[mask.bool()]
    )


def test_load_full_state_fills_an_empty_rank_and_bumps_version():
    hf = tiny_model("llama", SHAPE, seed=3)
    empty = RankModel(model_files(hf.config, False), None, Tok())  # zeros until weights arrive
    assert empty.digest() == 0.0
    kept = empty.load_full_state(hf.state_dict())
    assert kept == empty.local_bytes()
    assert empty.version == 1
    ids, mask = _inputs()
    torch.testing.assert_close(
        empty.forward(ids, mask)[mask.bool()], _hf_out(hf, ids, mask, False)[mask.bool()]
    )


@pytest.mark.parametrize("value_head", [False, True])
def test_save_pretrained_round_trips_through_hugging_face(tmp_path, value_head):
    hf = tiny_model("llama", SHAPE, value_head, seed=5)
    rank = RankModel.from_hf(hf, Tok(), value_head)
    rank.save_pretrained(tmp_path)
    assert (tmp_path / "tok.txt").read_text() == "saved"
    cls = AutoModelForSequenceClassification if value_head else AutoModelForCausalLM
    loaded = cls.from_pretrained(tmp_path, attn_implementation="eager").eval()
    for name, tensor in hf.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


def test_save_pretrained_writes_a_given_state(tmp_path):
    rank = RankModel.from_hf(tiny_model("llama", SHAPE), Tok(), False)
    other = tiny_model("llama", SHAPE, seed=9).state_dict()
    rank.save_pretrained(tmp_path, full=other)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert torch.equal(loaded.state_dict()["lm_head.weight"], other["lm_head.weight"])


def test_release_then_receive_buffers_then_received():
    hf = tiny_model("llama", SHAPE)
    rank = RankModel.from_hf(hf, Tok(), False)
    shapes = {k: tuple(v.shape) for k, v in rank.source_shards().items()}
    rank.release()
    assert rank.local_bytes() == 0
    assert rank.version == 0  # releasing does not change the weights a move will bring
    buffers = rank.receive_buffers()
    assert {k: tuple(v.shape) for k, v in buffers.items()} == shapes
    with torch.no_grad():  # a move fills the buffers in place...
        for name, tensor in hf.state_dict().items():
            buffers[name].copy_(tensor)
    rank.received()  # ...and says so
    assert rank.version == 1
    ids, mask = _inputs()
    torch.testing.assert_close(
        rank.forward(ids, mask)[mask.bool()], _hf_out(hf, ids, mask, False)[mask.bool()]
    )
    rank.changed()
    assert rank.version == 2


def test_source_shards_are_the_live_parameters():
    rank = RankModel.from_hf(tiny_model("llama", SHAPE), Tok(), False)
    shards = rank.source_shards()
    params = dict(rank.module.named_parameters())
    assert shards and all(any(s is p for p in params.values()) for s in shards.values())
