"""What the check harnesses share: seeded tiny models of every family with the shared ids."""

from __future__ import annotations

import pytest
import torch

from rayhf.checks.common import BOS, EOS, PAD, VOCAB, Tok, tiny_model
from rayhf.models.families import FAMILIES
from rayhf.models.spec import model_spec

SHAPES = {name: traits.check_shape for name, traits in FAMILIES.items()}  # the tiny ones


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("value_head", [False, True])
def test_tiny_model_shape_and_ids(family, value_head):
    if value_head and not FAMILIES[family].value_head_class:
        pytest.skip(f"{family} has no sequence-classification class in transformers")
    model = tiny_model(family, SHAPES[family], value_head)
    spec = model_spec(model.config, value_head)
    assert (spec.family, spec.vocab_size, spec.hidden_size, spec.n_layers) == (family, VOCAB, 32, 4)
    assert spec.n_heads == SHAPES[family]["n_heads"]
    assert (model.config.pad_token_id, model.config.bos_token_id, model.config.eos_token_id) == (
        PAD, BOS, EOS
    )  # fmt: skip
    assert not model.training
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_tiny_model_is_a_function_of_its_seed():
    a, b, c = (tiny_model("llama", SHAPES["llama"], seed=s) for s in (3, 3, 4))
    name = "model.layers.0.mlp.up_proj.weight"
    assert torch.equal(a.state_dict()[name], b.state_dict()[name])
    assert not torch.equal(a.state_dict()[name], c.state_dict()[name])


def test_tok_has_the_ids_an_engine_reads():
    assert (Tok.pad_token_id, Tok.eos_token_id) == (PAD, EOS)
    assert len({PAD, BOS, EOS}) == 3 and max(PAD, BOS, EOS) < VOCAB
