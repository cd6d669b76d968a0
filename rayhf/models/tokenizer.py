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
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from rayhf.errors import RayhfError

if TYPE_CHECKING:  # transformers costs a reward worker ~3 s of CPU to import (decision 0095)
    from transformers import PreTrainedTokenizerFast

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
    from transformers import PreTrainedTokenizerFast

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


# Chat templates with tools, in the shapes three model families write them, for tokenizers built
# here: tools listed in a system turn, the model's calls in its own turn, tool results in a turn
# of their own. Each ends a turn with its eos, which the model samples; what follows the eos in
# a rendering (ChatML's newline) is the environment's to add.
CHATML_TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>\n{% for t in tools %}{{ t | tojson }}\n"
    '{% endfor %}</tools>\nCall a tool as <tool_call>{"name": ..., "arguments": ...}'
    "</tool_call>.<|im_end|>\n{% endif %}"
    "{% for m in messages %}{% if m['role'] == 'tool' %}"
    "{{ '<|im_start|>user\n<tool_response>\n' + m['content'] + '\n</tool_response><|im_end|>\n' }}"
    "{% else %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
LLAMA3_TEMPLATE = (
    "{% if tools %}<|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n"
    'Answer a tool call as {"name": ..., "parameters": ...}.\n'
    "{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|eot_id|>{% endif %}"
    "{% for m in messages %}{% set role = 'ipython' if m['role'] == 'tool' else m['role'] %}"
    "{{ '<|start_header_id|>' + role + '<|end_header_id|>\n\n' + m['content'] + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
GEMMA_TEMPLATE = (  # no system or tool role: both are user turns, the assistant is "model"
    "{% if tools %}<start_of_turn>user\nTools:\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    "<end_of_turn>\n{% endif %}"
    "{% for m in messages %}{% set role = 'model' if m['role'] == 'assistant' else 'user' %}"
    "{% set text = '<tool_response>' + m['content'] + '</tool_response>' if m['role'] == 'tool'"
    " else m['content'] %}{{ '<start_of_turn>' + role + '\n' + text + '<end_of_turn>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)


@dataclass(frozen=True)
class ChatFormat:
    """A chat template with the special tokens it writes and the one that ends a model turn."""

    name: str
    template: str
    specials: tuple[str, ...]
    eos: str


CHATML = ChatFormat("chatml", CHATML_TOOLS_TEMPLATE, CHAT_TOKENS, "<|im_end|>")
LLAMA3 = ChatFormat(
    "llama3", LLAMA3_TEMPLATE, ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
    "<|eot_id|>",
)  # fmt: skip
GEMMA = ChatFormat("gemma", GEMMA_TEMPLATE, ("<start_of_turn>", "<end_of_turn>"), "<end_of_turn>")
CHAT_FORMATS = {f.name: f for f in (CHATML, LLAMA3, GEMMA)}


def train_bpe_tokenizer(
    texts: Iterable[str],
    vocab_size: int = 512,
    out_dir: str | Path | None = None,
    chat_template: str | None = CHATML_TEMPLATE,
    chat_format: ChatFormat | None = None,
    split_digits: bool = False,
) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on ``texts``; saved to ``out_dir`` if given.

    Any text encodes (bytes never map to ``<unk>``) and ``decode(encode(s)) == s``. Its eos is
    ``<|im_end|>``, the token that ends a chat turn, so an instruct model stops there; with a
    ``chat_format``, that format's template, special tokens and eos instead. ``split_digits``
    makes every digit a token of its own, as Qwen's and Llama 3's tokenizers nearly do: a number
    reads the same wherever it stands, so a small model can copy it.
    """
    core = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.pre_tokenizer = (
        pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
        if split_digits
        else byte_level
    )
    core.decoder = decoders.ByteLevel()
    chat = chat_format or ChatFormat("chatml", chat_template or "", CHAT_TOKENS, "<|im_end|>")
    specials = ["<pad>", "<bos>", *chat.specials]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(texts, trainer)
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token=chat.eos,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = chat.template or None
    if out_dir is not None:
        tokenizer.save_pretrained(str(out_dir))
    return tokenizer
