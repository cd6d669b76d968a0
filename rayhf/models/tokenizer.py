"""Tokenizers built locally, so demos and tests never download a vocabulary.

* ``build_char_tokenizer``: ids 0-3 are the special tokens (``<pad>``, ``<bos>``, ``<eos>``,
  ``<unk>``); every character of the alphabet follows in order.
* ``train_bpe_tokenizer``: a byte-level BPE vocabulary trained on given texts with the
  ``tokenizers`` library (the kind Llama 3 and Qwen ship), with chat special tokens and a
  ChatML chat template, as an instruct model's tokenizer directory holds them.

Encoding adds no special tokens: callers decide where bos/eos go.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
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


CHAT_TOKENS = ("<|im_start|>", "<|im_end|>")
# ChatML, as Qwen's instruct models write it: each message is "<|im_start|>role\ncontent
# <|im_end|>\n"; a generation prompt opens the assistant's turn.
CHATML_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def train_bpe_tokenizer(
    texts: Iterable[str],
    vocab_size: int = 512,
    out_dir: str | Path | None = None,
    chat_template: str | None = CHATML_TEMPLATE,
) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on ``texts``; saved to ``out_dir`` if given.

    Any text encodes (bytes never map to ``<unk>``) and ``decode(encode(s)) == s``. Its eos is
    ``<|im_end|>``, the token that ends a chat turn, so an instruct model stops there.
    """
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    specials = ["<pad>", "<bos>", *CHAT_TOKENS]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(texts, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<|im_end|>",
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = chat_template
    if out_dir is not None:
        tokenizer.save_pretrained(str(out_dir))
    return tokenizer
