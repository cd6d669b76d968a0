"""A model directory read and written without transformers (``rayhf.models.files``): what a
role-group worker writes is what Hugging Face's ``save_pretrained`` writes, and loads back."""

from __future__ import annotations

import json
import pickle
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from rayhf.checks.common import PAD, VOCAB
from rayhf.checks.parity import CASES, _model
from rayhf.models import files
from rayhf.models.families import FAMILIES
from rayhf.models.files import TokenizerDir, read_weights, special_ids, write_model
from rayhf.models.hf import model_files, read_model_config
from rayhf.models.tokenizer import CHAT_FORMATS, train_bpe_tokenizer
from rayhf.tasks.demo import build_tokenizer


def _both(tmp_path: Path, hf, value_head: bool) -> tuple[Path, Path]:
    """The model saved by Hugging Face from a config read back from disk, and by us."""
    hf.save_pretrained(tmp_path / "src")
    config = read_model_config(tmp_path / "src", value_head, "models.actor")
    full = {k: v.detach().float() for k, v in hf.state_dict().items()}
    cls = AutoModelForSequenceClassification if value_head else AutoModelForCausalLM
    theirs = cls.from_config(config)
    theirs.load_state_dict(full)
    theirs.save_pretrained(tmp_path / "theirs")
    write_model(tmp_path / "ours", model_files(config, value_head), full)
    return tmp_path / "theirs", tmp_path / "ours"


@pytest.mark.parametrize("value_head", [False, True])
@pytest.mark.parametrize("case", sorted(CASES))
def test_every_family_is_written_as_save_pretrained_writes_it(tmp_path, case, value_head):
    if value_head and not FAMILIES[CASES[case].family].value_head_class:
        pytest.skip(f"{case} has no sequence-classification class in transformers")
    theirs, ours = _both(tmp_path, _model(case, value_head), value_head)
    names = sorted(p.name for p in ours.iterdir())
    assert names == sorted(p.name for p in theirs.iterdir())
    for name in names:
        if name.endswith(".json"):
            assert (ours / name).read_text() == (theirs / name).read_text(), name
    a, b = load_file(theirs / files.WEIGHTS), load_file(ours / files.WEIGHTS)
    assert a.keys() == b.keys()  # a tied head saved once, as the embedding
    assert all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)


def test_weights_are_saved_in_the_config_s_dtype(tmp_path):
    hf = _model("qwen2", False).to(torch.bfloat16)
    hf.config.dtype = "bfloat16"
    theirs, ours = _both(tmp_path, hf, False)
    assert (ours / "config.json").read_text() == (theirs / "config.json").read_text()
    saved = load_file(ours / files.WEIGHTS)
    assert {t.dtype for t in saved.values()} == {torch.bfloat16}


def test_a_model_past_the_shard_size_is_split_and_read_back(tmp_path, monkeypatch):
    hf = _model("llama", False)
    config, full = hf.config, {k: v.detach() for k, v in hf.state_dict().items()}
    monkeypatch.setattr(files, "SHARD_BYTES", 40_000)
    spec = model_files(config, False)
    (tmp_path / files.WEIGHTS).write_text("a previous save's file")
    write_model(tmp_path, spec, full)
    shards = sorted(p.name for p in tmp_path.glob("model*.safetensors"))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert (tmp_path / files.INDEX).is_file()
    back = read_weights(tmp_path, spec.spec)
    assert back and all(torch.equal(back[k], full[k]) for k in back)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in full.items())


def test_a_causal_lm_read_as_a_critic_has_no_score_head_to_read(tmp_path):
    _model("llama", False).save_pretrained(tmp_path)
    critic = model_files(read_model_config(tmp_path, True, "models.critic"), True).spec
    assert read_weights(tmp_path, critic) is None  # the model is built to be read instead
    assert read_weights(tmp_path / "missing", critic) is None


def test_a_tokenizer_dir_knows_its_ids_and_loads_the_rest_on_first_use(tmp_path):
    tok = build_tokenizer(tmp_path)
    lazy = TokenizerDir(str(tmp_path), **special_ids(tok))
    lazy = pickle.loads(pickle.dumps(lazy))  # it travels to the workers
    assert (lazy.pad_token_id, lazy.eos_token_id, lazy.bos_token_id) == (
        tok.pad_token_id, tok.eos_token_id, tok.bos_token_id,
    )  # fmt: skip
    lazy.save_pretrained(tmp_path / "checkpoint")  # a copy of the directory's files
    for f in tmp_path.glob("*.json"):
        assert (tmp_path / "checkpoint" / f.name).read_bytes() == f.read_bytes()
    assert "loaded" not in vars(lazy), "the ids and a checkpoint's copy need no tokenizer"
    ids = tok.encode("1 2 =", add_special_tokens=False)
    assert lazy.decode(ids) == tok.decode(ids) and "loaded" not in vars(lazy)
    assert lazy.encode("1 2 =", add_special_tokens=False) == ids and "loaded" in vars(lazy)
    with pytest.raises(AttributeError):
        lazy.no_such_method  # noqa: B018


def _bpe(out: Path):
    texts = [f"{a} plus {b} is {a + b}. Call calc({a}, {b})!" for a in range(30) for b in (7, 91)]
    return train_bpe_tokenizer(texts, 300, out, chat_format=CHAT_FORMATS["llama3"])


@pytest.mark.parametrize("build", [build_tokenizer, _bpe], ids=["char", "bpe-llama3"])
def test_a_tokenizer_dir_decodes_as_transformers_does_without_loading_it(tmp_path, build):
    tok = build(tmp_path)
    lazy = TokenizerDir(str(tmp_path), **special_ids(tok))
    rng = random.Random(0)
    for n in (0, 1, 5, 40):  # any ids, specials (and chat tokens) among them
        ids = [rng.randrange(len(tok)) for _ in range(n)] + [tok.eos_token_id, tok.bos_token_id]
        for skip in (False, True):
            assert lazy.decode(ids, skip_special_tokens=skip) == tok.decode(
                ids, skip_special_tokens=skip
            )
    assert "loaded" not in vars(lazy)


def test_a_tokenizer_that_cleans_up_spaces_decodes_through_transformers(tmp_path):
    tok = build_tokenizer(tmp_path)
    config = tmp_path / "tokenizer_config.json"
    config.write_text(
        json.dumps(json.loads(config.read_text()) | {"clean_up_tokenization_spaces": True})
    )
    lazy = TokenizerDir(str(tmp_path), **special_ids(tok))
    assert lazy.decoder is None
    ids = tok.encode("1 2 =", add_special_tokens=False)
    assert lazy.decode(ids) == tok.decode(ids) and "loaded" in vars(lazy)


@pytest.mark.parametrize("case", ["qwen3_moe", "mixtral"])
def test_experts_saved_one_by_one_are_read_back_stacked_without_building_the_model(tmp_path, case):
    """``save_pretrained`` writes each expert's gate, up and down apart (Mixtral's as
    ``block_sparse_moe.experts.{e}.w1``...); a worker reads them as the model holds them."""
    hf = _model(case, False)
    hf.save_pretrained(tmp_path)
    saved = load_file(tmp_path / files.WEIGHTS)
    assert not any(k.endswith("experts.gate_up_proj") for k in saved)
    config = read_model_config(tmp_path, False, "models.actor")
    state = read_weights(tmp_path, model_files(config, False).spec)
    assert state is not None and state.keys() == hf.state_dict().keys()
    assert all(torch.equal(state[k], v) for k, v in hf.state_dict().items())


RELEASED = {  # the released model type -> its multimodal class, and the text tower's family
    "qwen3_5": ("Qwen3_5ForConditionalGeneration", "qwen3_5_text"),
    "qwen3_5_moe": ("Qwen3_5MoeForConditionalGeneration", "qwen3_5_moe_text"),
}


def _released(out: Path, model_type: str = "qwen3_5") -> Path:
    """A released Qwen3.5 checkpoint in miniature: the multimodal class's layout (the text
    tower under ``model.language_model``, a vision tower) and MTP heads in bf16, as Qwen's
    files hold them."""
    import transformers
    from safetensors.torch import save_file

    text = {
        "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4,
        "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 4,
        "linear_num_key_heads": 4, "linear_num_value_heads": 8, "linear_key_head_dim": 8,
        "linear_value_head_dim": 4, "layer_types": ["linear_attention", "full_attention"] * 2,
        "pad_token_id": PAD,
    }  # fmt: skip
    if model_type == "qwen3_5_moe":
        text |= {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                 "shared_expert_intermediate_size": 24}  # fmt: skip
    vision = {
        "depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2,
        "out_hidden_size": 32, "num_position_embeddings": 16, "patch_size": 4,
    }  # fmt: skip
    cls = getattr(transformers, RELEASED[model_type][0])
    config = cls.config_class(text_config=text, vision_config=vision, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = cls(config)
    for name, p in model.named_parameters():  # (1 + w) norms and zero biases start equal
        if name.endswith(("norm.weight", "dt_bias")):
            p.data.normal_(0, 0.1)
    model.save_pretrained(out)
    state = load_file(out / "model.safetensors")
    state["mtp.fc.weight"] = torch.randn(32, 64).bfloat16()
    state["mtp.layers.0.input_layernorm.weight"] = torch.randn(32).bfloat16()
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("model_type", list(RELEASED))
def test_a_released_multimodal_checkpoint_trains_its_text_tower_and_saves_the_rest_back(
    tmp_path, model_type
):
    """Qwen3.5 and Qwen3.5-MoE as released: rayhf reads the text tower under
    ``model.language_model``, gives the full model's logits, and saves the tower back there with
    the vision tower, the MTP heads and config.json as they were; a critic from it (where
    transformers has a head for it) is the text tower with a head."""
    import transformers

    from rayhf.checks.common import Tok
    from rayhf.engines.rank_model import RankModel
    from rayhf.models.hf import load_weights
    from rayhf.models.spec import model_spec

    cls, family = getattr(transformers, RELEASED[model_type][0]), RELEASED[model_type][1]
    src = _released(tmp_path / "released", model_type)
    config, state = load_weights(src, False, "models.actor")
    files = model_files(config, False, str(src))
    assert files.spec.family == family and files.released == str(src)
    ids = torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0
    hf = cls.from_pretrained(src).eval()
    with torch.no_grad():
        want = hf(ids, attention_mask=mask).logits
        got = RankModel(files, state, Tok()).forward(ids, mask)
    torch.testing.assert_close(got[mask.bool()], want[mask.bool()], atol=1e-5, rtol=1e-5)

    state["model.norm.weight"] += 1.0  # a trained tower
    write_model(tmp_path / "saved", files, state)
    before, after = (
        load_file(src / "model.safetensors"),
        load_file(tmp_path / "saved/model.safetensors"),
    )
    assert set(after) == set(before)
    tower = "model.language_model."
    kept = [n for n in before if not n.startswith(tower) and n != "lm_head.weight"]
    assert any(n.startswith("mtp.") for n in kept) and any(".visual." in n for n in kept)
    for n in kept:  # byte for byte: values and dtype
        assert after[n].dtype == before[n].dtype and torch.equal(after[n], before[n]), n
    assert torch.equal(after[tower + "norm.weight"], before[tower + "norm.weight"] + 1.0)
    saved_config = json.loads((tmp_path / "saved/config.json").read_text())
    assert saved_config == json.loads((src / "config.json").read_text())
    reloaded = cls.from_pretrained(tmp_path / "saved")
    assert torch.equal(reloaded.model.language_model.norm.weight, after[tower + "norm.weight"])
    if model_type == "qwen3_5_moe":  # (no sequence-classification class of it)
        return

    critic = read_model_config(src, True, "models.critic")
    assert critic.model_type == "qwen3_5_text" and model_spec(critic, True).value_head
