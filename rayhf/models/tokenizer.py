"""A character-level tokenizer built locally, so demos and tests never download a vocabulary.

Ids 0-3 are the special tokens (``<pad>``, ``<bos>``, ``<eos>``, ``<unk>``); every character of
the alphabet follows in order. Encoding adds no special tokens: callers decide where bos/eos go.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from rayhf.errors import RayhfError

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")


def _vocab(alphabet: str) -> dict[str, int]:
    """Specials first, then one id per character; duplicates would make ids ambiguous."""
    if not alphabet:
        raise RayhfError("tokenizer alphabet is empty; pass at least one character")
    dupes = sorted({c for c in alphabet if alphabet.count(c) > 1})
    if dupes:
        raise RayhfError(f"tokenizer alphabet repeats {dupes!r}; list every character once")
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for char in alphabet:
        vocab[char] = len(vocab)
    return vocab


def build_char_tokenizer(
    alphabet: str, out_dir: str | Path | None = None
) -> PreTrainedTokenizerFast:
    """One token per character of ``alphabet``; saved to ``out_dir`` if given.

    No normalizer, so characters (case, spaces) survive; the ``Fuse`` decoder joins tokens with
    no separator, so ``decode(encode(s)) == s`` for any string over the alphabet. Characters
    outside the alphabet encode to ``<unk>``.
    """
    core = Tokenizer(models.WordLevel(_vocab(alphabet), unk_token="<unk>"))
    # [\s\S] rather than "." so newlines in an alphabet are single tokens too.
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=False,  # cleanup rewrites " ." and " ,"; decode must be exact
    )
    if out_dir is not None:
        tokenizer.save_pretrained(str(out_dir))
    return tokenizer
