"""Every family of the parity harness, saved with ``save_pretrained`` and loaded back the way a
run loads a model directory: the loaded model, sharded by rayhf, gives the saved model's logits,
and a trained rank's ``save_pretrained`` writes a directory Hugging Face loads to the same
weights (a tied head included)."""

from __future__ import annotations

import pytest
import torch

from rayhf.checks.common import EOS, PAD
from rayhf.checks.parity import CASES, _batch, _model, _rel
from rayhf.engines.rank_model import RankModel
from rayhf.models.hf import load_model, save_model


class _Tok:
    """The ids an engine reads, and a tokenizer's save (a run saves it beside the model)."""

    pad_token_id, eos_token_id = PAD, EOS

    def save_pretrained(self, out_dir) -> None:
        pass


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_saved_model_loads_back_and_runs_as_saved(case, tmp_path):
    original = _model(case, False)
    loaded = load_model(save_model(original, tmp_path / "saved"), False, "models.actor.path")
    ids, mask = _batch()
    keep = mask.bool()
    model = RankModel.from_hf(loaded, _Tok(), False)
    with torch.no_grad():
        want = original(input_ids=ids, attention_mask=mask).logits
        assert _rel(model.forward(ids, mask)[keep], want[keep]) < 1e-5
    model.save_pretrained(tmp_path / "written", model.full_state())
    again = load_model(tmp_path / "written", False, "models.actor.path")
    assert again.config.tie_word_embeddings == original.config.tie_word_embeddings
    for name, tensor in original.state_dict().items():
        assert torch.equal(again.state_dict()[name], tensor), name
