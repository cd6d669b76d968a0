"""Chat data: a prompt column of messages rendered by a local BPE tokenizer's own chat template
(``rayhf.data.datasets``, ``rayhf.models.tokenizer.train_bpe_tokenizer``), token for token."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from transformers import AutoTokenizer

import rayhf
from rayhf.data.datasets import DatasetConfig, PromptDataset, to_packed, write_rows
from rayhf.errors import RayhfError
from rayhf.models.tokenizer import train_bpe_tokenizer
from rayhf.runtime.assets import prepare_tokenizer
from rayhf.tasks.demo import build_tokenizer

REPO = Path(__file__).resolve().parents[3]
CHAT = [
    {"role": "system", "content": "Answer with a number after ####."},
    {"role": "user", "content": "Tom has 3 apples and buys 4 more. How many now?"},
    {"role": "assistant", "content": "3 + 4 = 7 #### 7"},
    {"role": "user", "content": "And if he eats 2, how many are left?"},
]
ROWS = [{"prompt": CHAT, "answer": "5"}, {"prompt": CHAT[1:2], "answer": "7"}]


@pytest.fixture(scope="module")
def bpe(tmp_path_factory) -> Path:
    """A byte-level BPE tokenizer trained here, saved and loaded back as a directory."""
    out = tmp_path_factory.mktemp("bpe")
    texts = [m["content"] for m in CHAT] * 20 + ["How many apples? #### 12, 1,000 and 3/4"] * 5
    train_bpe_tokenizer(texts, vocab_size=320, out_dir=out)
    return out


def test_a_multi_turn_prompt_round_trips_token_for_token(bpe, tmp_path):
    tok = AutoTokenizer.from_pretrained(bpe, local_files_only=True)
    path = write_rows(ROWS, tmp_path / "chat.parquet")  # a list-of-structs column in parquet
    ds = PromptDataset.from_config(DatasetConfig(path=str(path), max_prompt_len=256), tok)
    rendered = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    expected = tok.apply_chat_template(
        CHAT, tokenize=True, add_generation_prompt=True, return_dict=False
    )
    assert ds.texts[0] == rendered and ds.ids[0] == list(expected)
    assert tok.decode(ds.ids[0]) == rendered, "decoding gives back the rendered text exactly"
    assert rendered.count("<|im_start|>") == 5 and rendered.endswith("<|im_start|>assistant\n")
    assert ds.ids[0].count(tok.convert_tokens_to_ids("<|im_end|>")) == 4
    assert tok.bos_token_id not in ds.ids[0], "the template decides the special tokens"
    assert to_packed(ds.all_samples()).extras == {"answer": ["5", "7"]}
    text = PromptDataset([{"prompt": "3 + 4 ="}], tok, DatasetConfig(path="t.jsonl"))
    assert text.ids[0][0] == tok.bos_token_id, "a text prompt still gets bos"


def test_the_config_s_chat_template_replaces_the_tokenizer_s_own(bpe, tmp_path):
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}>"
    cfg = rayhf.load_config(
        REPO / "examples" / "ppo_tiny.yaml",
        [f"tokenizer.path={bpe}", "tokenizer.alphabet=null"],
    ).with_overrides({"tokenizer.chat_template": template})
    tok, where = prepare_tokenizer(cfg, tmp_path, "actor")
    assert where == tmp_path / "tokenizer", "saved with the run, as workers and checkpoints load it"
    saved = AutoTokenizer.from_pretrained(where, local_files_only=True)
    ds = PromptDataset([{"prompt": CHAT[1:2]}], saved, DatasetConfig(path="c.jsonl"))
    assert ds.texts == [f"[user] {CHAT[1]['content']}\n>"] and tok.chat_template == template


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        ([{"role": "bot", "content": "hi"}], "message 0 has role 'bot'; use one of system, user"),
        ([{"role": "user", "content": 3}], "message 0 is not {role, content} with text content"),
        (["hi"], "message 0 is not {role, content}"),
    ],
)
def test_bad_messages_are_refused_with_their_row_and_message(bpe, prompt, message):
    tok = AutoTokenizer.from_pretrained(bpe, local_files_only=True)
    rows = [{"prompt": CHAT}, {"prompt": prompt}]
    with pytest.raises(RayhfError, match=re.escape(f"dataset file d.jsonl row 1: {message}")):
        PromptDataset(rows, tok, DatasetConfig(path="d.jsonl", max_prompt_len=256))


def test_messages_need_a_chat_template():
    with pytest.raises(
        RayhfError,
        match=re.escape(
            "row 0: the prompt is chat messages but the tokenizer has no chat template; set "
            "tokenizer.chat_template"
        ),
    ):
        PromptDataset([{"prompt": CHAT}], build_tokenizer(), DatasetConfig(path="d.jsonl"))
