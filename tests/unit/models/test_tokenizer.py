"""The local character tokenizer: exact round trips, fixed special ids, offline save/load."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from rayhf.errors import RayhfError
from rayhf.models.tokenizer import build_char_tokenizer
from rayhf.tasks.demo import ALPHABET

SAMPLES = ["3 1 4 1 5 =", "  leading and trailing \n ", "0123456789", "a=b", "j"]


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer(ALPHABET + "lnrt\n")


def test_special_ids_come_first(tok):
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2, 3)
    assert (tok.pad_token, tok.bos_token, tok.eos_token, tok.unk_token) == (
        "<pad>",
        "<bos>",
        "<eos>",
        "<unk>",
    )


def test_one_token_per_character_in_alphabet_order():
    tok = build_char_tokenizer(ALPHABET)
    assert len(tok) == 4 + len(ALPHABET)
    assert tok.encode(ALPHABET) == list(range(4, 4 + len(ALPHABET)))


@pytest.mark.parametrize("text", SAMPLES)
def test_round_trip_keeps_spaces_and_digits(tok, text):
    ids = tok.encode(text)
    assert len(ids) == len(text)
    assert tok.decode(ids) == text


def test_encode_adds_no_special_tokens(tok):
    assert tok.encode("12") == [tok.convert_tokens_to_ids("1"), tok.convert_tokens_to_ids("2")]
    assert tok("12")["input_ids"] == tok.encode("12")


def test_decode_can_skip_specials(tok):
    ids = [tok.bos_token_id, *tok.encode("1 2"), tok.eos_token_id, tok.pad_token_id]
    assert tok.decode(ids, skip_special_tokens=True) == "1 2"
    assert tok.decode(ids) == "<bos>1 2<eos><pad>"


def test_unknown_character_is_unk():
    tok = build_char_tokenizer("ab")
    assert tok.encode("aZb") == [4, 3, 5]


def test_save_and_load_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    built = build_char_tokenizer(ALPHABET, tmp_path / "tok")
    loaded = AutoTokenizer.from_pretrained(tmp_path / "tok")
    assert loaded.get_vocab() == built.get_vocab()
    assert loaded.eos_token_id == 2 and loaded.pad_token_id == 0 and loaded.bos_token_id == 1
    for text in ["3 1 4 1 5 =", " 9 9 ", "abc = 0"]:
        assert loaded.encode(text) == built.encode(text)
        assert loaded.decode(loaded.encode(text)) == text


@pytest.mark.parametrize("alphabet", ["", "abca"])
def test_bad_alphabet_is_a_user_error(alphabet):
    with pytest.raises(RayhfError, match="alphabet"):
        build_char_tokenizer(alphabet)
