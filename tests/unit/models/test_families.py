"""The family table (``rayhf.models.families``): every row names a config class Hugging Face
has, a row registered under a new name is a family everywhere (config, spec, shards, files), and
no code outside the table tests a family's name."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import transformers
from pydantic import ValidationError

from rayhf.errors import RayhfError
from rayhf.models.families import FAMILIES, family_traits
from rayhf.models.hf import build_model, hf_config, model_files
from rayhf.models.init import ModelInit
from rayhf.models.sharding import param_shards
from rayhf.models.spec import model_spec

PACKAGE = Path(__file__).resolve().parents[3] / "rayhf"


@pytest.mark.parametrize("family", FAMILIES)
def test_every_row_names_a_config_class_of_its_model_type(family):
    cls = getattr(transformers, FAMILIES[family].hf_config_class)
    assert cls.model_type == family


def test_an_unknown_family_is_refused_in_one_line():
    with pytest.raises(RayhfError, match=r"^model type 'bert' is not supported; use one of llama"):
        family_traits("bert")
    with pytest.raises(ValidationError) as info:
        ModelInit(family="bert")
    assert info.value.errors()[0]["msg"] == (
        "Input should be 'llama', 'qwen2', 'qwen3', 'mistral', 'phi3', 'gemma2', 'gemma3_text', "
        "'gpt2', 'qwen3_moe', 'glm4_moe', 'gpt_oss', 'mixtral', 'qwen3_5_text', 'qwen3_next' or "
        "'qwen3_5_moe_text'"
    )


@pytest.mark.parametrize("value_head", [False, True])
def test_a_registered_row_is_a_family_of_its_own(monkeypatch, value_head):
    """Llama's traits under another name: its configs, spec, shards and saved files."""
    toy = dataclasses.replace(FAMILIES["llama"])
    monkeypatch.setitem(FAMILIES, "toyllama", toy)
    init = ModelInit(family="toyllama", hidden_size=32, n_layers=2, n_heads=4)
    config = hf_config(init, 37, 0, 2, 1)
    assert type(config) is transformers.LlamaConfig and config.model_type == "toyllama"
    model = build_model(config, value_head)
    spec = model_spec(model.config, value_head)
    assert (spec.family, spec.traits) == ("toyllama", toy)
    listed = {p.name: p.shape for p in param_shards(spec)}
    assert listed == {k: tuple(v.shape) for k, v in model.state_dict().items()}
    llama = model_spec(hf_config(init.model_copy(update={"family": "llama"}), 37, 0, 2, 1), False)
    assert dataclasses.replace(spec, family="llama", value_head=False) == llama
    files = model_files(model.config, value_head)
    config_json = dict(files.texts)["config.json"]
    assert '"model_type": "llama"' in config_json  # saved as the class it is


# a family's name compared or tested for membership: the code must read traits instead
NAME_TEST = re.compile(
    r"\b(family|model_type)\s*(==|!=)|(?<!for )\b(family|model_type)\s+(not\s+)?in\b"
)


def test_no_code_outside_the_table_tests_a_family_name():
    offenders = [
        f"{path.relative_to(PACKAGE)}:{n}: {line.strip()}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.name != "families.py"
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if NAME_TEST.search(line.split("#")[0])
    ]
    assert not offenders, "\n".join(offenders)
