import pytest
import torch

from rayhf.errors import RayhfError
from rayhf.models.hf import (
    ModelInit,
    build_model,
    hf_config,
    load_model,
    load_weights,
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


def _saved(tmp_path, family: str, value_head: bool, **save) -> tuple[str, dict]:
    from rayhf.checks.parity import _model

    model = _model(family, value_head)
    model.save_pretrained(tmp_path / family, **save)
    return str(tmp_path / family), model.state_dict()


@pytest.mark.parametrize("value_head", [False, True])
def test_weights_read_from_the_files_are_the_loaded_model_s(tmp_path, value_head):
    """Every family (Gemma 2's head tied to its embedding), as a critic too: each parameter
    the spec names, bit for bit, in fp32 even from bf16 files; shards with an index too."""
    from rayhf.checks.parity import CASES
    from rayhf.models.families import FAMILIES
    from rayhf.models.sharding import param_shards
    from rayhf.models.spec import model_spec

    for family in CASES:
        if value_head and not FAMILIES[CASES[family].family].value_head_class:
            continue  # no critic of it (GLM-4.5)
        path, want = _saved(tmp_path, family, value_head)
        config, got = load_weights(path, value_head, "models.actor.path")
        names = {p.name for p in param_shards(model_spec(config, value_head))}
        assert got.keys() == names and names <= want.keys(), family
        assert all(torch.equal(got[n], want[n]) for n in names), family
    model = build_model(config, value_head, seed=1).to(torch.bfloat16)
    model.save_pretrained(tmp_path / "bf16", max_shard_size="20KB")
    assert (tmp_path / "bf16" / "model.safetensors.index.json").is_file()
    _, got = load_weights(tmp_path / "bf16", value_head, "models.actor.path")
    assert got and all(v.dtype == torch.float32 for v in got.values())
    assert all(torch.equal(got[n], model.state_dict()[n].float()) for n in got)


def test_a_critic_from_a_causal_lm_s_directory_gets_the_loaded_model_s_new_head(tmp_path):
    """No ``score`` in the files: Hugging Face's model is built and its fresh head kept."""
    path, want = _saved(tmp_path, "llama", False)
    config, got = load_weights(path, True, "models.critic.path")
    assert config.num_labels == 1 and got["score.weight"].shape == (1, 32)
    assert torch.equal(got["model.embed_tokens.weight"], want["model.embed_tokens.weight"])


def test_a_worker_reads_its_weights_without_hugging_face_s_model_code(tmp_path):
    """Importing the modelling stack is most of a role-group worker's start."""
    import subprocess
    import sys

    path, _ = _saved(tmp_path, "qwen2", False)
    code = (
        "import sys; from rayhf.runtime.worker import RoleWorker; "
        f"from rayhf.models.hf import load_weights; load_weights({path!r}, False, 'x'); "
        "print([m for m in sys.modules if m.endswith(('.modeling_utils', '.modeling_qwen2'))])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
