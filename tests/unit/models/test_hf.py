import pytest
import torch

from rayhf.errors import RayhfError
from rayhf.models.hf import (
    ModelInit,
    build_model,
    hf_config,
    load_model,
    per_token_values,
    save_model,
)
from rayhf.models.tokenizer import build_char_tokenizer

FAMILIES = ["llama", "qwen2", "mistral", "gpt2"]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("value_head", [False, True])
def test_create_save_load_roundtrip(tmp_path, family, value_head):
    tok = build_char_tokenizer("0123456789 =")
    init = ModelInit(family=family, hidden_size=32, n_layers=2, n_heads=4, n_kv_heads=2)
    cfg = hf_config(init, len(tok), tok.pad_token_id, tok.bos_token_id, tok.eos_token_id)
    model = build_model(cfg, value_head, seed=3).eval()
    save_model(model, tmp_path / "m", tok)
    loaded = load_model(tmp_path / "m", value_head, "models.actor.path").eval()
    ids = torch.randint(4, len(tok), (2, 7))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        if value_head:
            a, b = per_token_values(model, ids, mask), per_token_values(loaded, ids, mask)
            assert a.shape == (2, 7)
        else:
            a, b = model(ids).logits, loaded(ids).logits
            assert a.shape == (2, 7, len(tok))
    assert torch.equal(a, b)


def test_same_seed_same_weights_other_seed_differs():
    tok = build_char_tokenizer("ab")
    cfg = hf_config(ModelInit(), len(tok), 0, 1, 2)
    w = [build_model(cfg, False, seed=s).model.embed_tokens.weight for s in (1, 1, 2)]
    assert torch.equal(w[0], w[1]) and not torch.equal(w[0], w[2])


def test_not_a_model_directory(tmp_path):
    with pytest.raises(RayhfError, match=r"models\.actor\.path: .* is not a model directory"):
        load_model(tmp_path, False, "models.actor.path")


@pytest.mark.parametrize("family", ["qwen2", "gpt2"])
def test_vocabulary_padded_past_the_tokenizer(family):
    """Qwen-shaped models pad their vocabulary (151,936 rows for 151,646 tokens)."""
    padded = {"vocab_size": 50}
    init = ModelInit(family=family, hidden_size=32, n_layers=1, n_heads=4, config=padded)
    cfg = hf_config(init, 16, 0, 1, 2)
    assert cfg.vocab_size == 50
    assert build_model(cfg, False).get_input_embeddings().weight.shape == (50, 32)
    with pytest.raises(RayhfError, match=r"init\.config\.vocab_size=8 is below .* 16 tokens"):
        hf_config(init.model_copy(update={"config": {"vocab_size": 8}}), 16, 0, 1, 2)
