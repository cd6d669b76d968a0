"""Datasets: load rows from a file, tokenize once, draw resumable shuffled batches.

A prompt is text, or a list of chat messages (``[{"role": "user", "content": "..."}, ...]``)
rendered by the tokenizer's own chat template with the assistant's turn opened (the template
decides the special tokens, bos included, so none is prepended).

A dataset has a *kind*, chosen by the keys the dataflow graph reads from it (``kind_for_inputs``):

* ``prompts`` (PPO, GRPO, ReMax): ``prompts`` = bos + prompt; generation adds the rest;
* ``sft``: ``seq`` = bos + prompt + response + eos, and ``prompt_lens``;
* ``pairs`` (DPO, reward model): ``chosen`` and ``rejected`` = bos + prompt + answer + eos, and
  ``prompt_lens``.

``prompt_lens`` counts bos + prompt tokens, so ``seq[prompt_len:]`` is the response and its eos.

Batches are a pure function of ``(seed, epoch, position)``: epoch ``e`` visits the rows in a
permutation seeded by ``seed + e``, and a batch that runs off the end of an epoch continues in
the next one. Saving ``epoch`` and ``position`` is therefore enough for a resumed run to draw
exactly the batches an uninterrupted run would.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import pyarrow as pa
import pyarrow.json as pa_json
import pyarrow.parquet as pq
import torch
from pydantic import BaseModel, ConfigDict, Field

from rayhf.data.batch import PackedBatch
from rayhf.errors import RayhfError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

PARQUET_SUFFIXES = (".parquet",)
JSONL_SUFFIXES = (".jsonl", ".json")  # .json must hold JSON lines, one object per line


DatasetKind = Literal["prompts", "sft", "pairs"]

# The keys each kind provides: a graph's ``inputs`` must be one of these sets.
KIND_INPUTS: dict[DatasetKind, tuple[str, ...]] = {
    "prompts": ("prompts",),
    "sft": ("seq", "prompt_lens"),
    "pairs": ("chosen", "rejected", "prompt_lens"),
}
# Per kind, every sequence key and the config field naming the column appended to its prompt.
SEQUENCE_COLUMNS: dict[DatasetKind, tuple[tuple[str, str], ...]] = {
    "prompts": (),
    "sft": (("seq", "response_key"),),
    "pairs": (("chosen", "chosen_key"), ("rejected", "rejected_key")),
}


class DatasetConfig(BaseModel):
    """Where the rows are and how they are read."""

    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid")

    path: str
    """A .parquet, .jsonl or .json (JSON lines) file, one sample per row."""
    prompt_key: str = "prompt"
    """The column holding the prompt: text, or a list of chat messages."""
    tools_key: str = "tools"
    """The column, if the file has it, holding the tools a chat prompt offers (a list of JSON
    schemas, or that list as JSON text): the chat template renders them in its tools section."""
    response_key: str = "response"
    """The column holding the target response (sft)"""
    chosen_key: str = "chosen"
    """The column holding the preferred response (pairs)"""
    rejected_key: str = "rejected"
    """The column holding the dispreferred response (pairs)"""
    max_prompt_len: int = Field(64, gt=0)
    """Prompt tokens, counting the prepended bos."""
    max_seq_len: int = Field(128, gt=0)
    """Bos + prompt + response + eos tokens (sft, pairs)"""
    shuffle: bool = True
    """Reshuffle every epoch; False keeps file order."""
    eval_path: str | None = None
    """Held-out rows in the same format, evaluated whole."""


def kind_for_inputs(inputs: list[str]) -> DatasetKind:
    """The dataset kind that provides exactly the keys a graph reads from the dataset."""
    for kind, keys in KIND_INPUTS.items():
        if sorted(inputs) == sorted(keys):
            return kind
    supported = ", ".join(f"{list(keys)} ({kind})" for kind, keys in KIND_INPUTS.items())
    raise RayhfError(
        f"graph inputs {list(inputs)} match no dataset kind; set the graph's inputs to one of "
        f"{supported}, in any order"
    )


@dataclass(frozen=True)
class Sample:
    """One drawn row; ``sample_id`` is unique across epochs (``epoch * n + index``).

    ``text`` and ``ids`` are the prompt (ids with bos); ``fields`` holds the token ids of every
    key the dataset kind provides; ``extras`` the row's other columns (prompts kind: its ground
    truth, data source, ...), as the file holds them.
    """

    sample_id: int
    text: str
    ids: list[int]
    fields: dict[str, list[int]]
    extras: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def prompt_len(self) -> int:
        """Tokens before the response (bos + prompt), the sample's ``prompt_lens`` value."""
        return len(self.ids)


def to_packed(samples: list[Sample]) -> PackedBatch:
    """One key per sample field, plus ``prompt_lens`` when the fields are whole sequences.

    The prompts kind gets no ``prompt_lens``: its generate call produces it together with ``seq``.
    """
    assert samples, "to_packed needs at least one sample"
    keys = list(samples[0].fields)
    assert all(list(s.fields) == keys for s in samples), "to_packed needs samples of one kind"
    batch = PackedBatch([s.sample_id for s in samples])
    for name in samples[0].extras:
        batch.add_extra(name, [s.extras[name] for s in samples])
    for key in keys:
        tokens = torch.tensor([t for s in samples for t in s.fields[key]], dtype=torch.long)
        batch.add(key, tokens, [len(s.fields[key]) for s in samples])
    if "prompts" not in keys:
        prompt_lens = torch.tensor([s.prompt_len for s in samples], dtype=torch.long)
        batch.add("prompt_lens", prompt_lens, [1] * len(samples))
    return batch


def _one_line(err: BaseException) -> str:
    """Library messages can span lines; ours must not."""
    return " ".join(str(err).split()) or type(err).__name__


def load_rows(path: str | Path, field: str = "dataset.path") -> list[dict[str, Any]]:
    """All rows of a parquet or JSON-lines file, as dicts; errors tell the user to fix ``field``."""
    path = Path(path)
    hint = f"set {field} to a .parquet or .jsonl file of rows"
    if not path.is_file():
        raise RayhfError(f"dataset file {path} does not exist; {hint}")
    suffix = path.suffix.lower()
    if suffix not in PARQUET_SUFFIXES + JSONL_SUFFIXES:
        raise RayhfError(f"dataset file {path} has unsupported suffix {suffix!r}; {hint}")
    if path.stat().st_size == 0:  # pyarrow calls an empty JSON file invalid, not empty
        raise RayhfError(f"dataset file {path} has no rows; {hint}")
    try:
        reader = pq.read_table if suffix in PARQUET_SUFFIXES else pa_json.read_json
        table = reader(str(path))
    except (pa.ArrowException, OSError) as err:
        raise RayhfError(f"dataset file {path} is unreadable ({_one_line(err)}); {hint}") from err
    if table.num_rows == 0:
        raise RayhfError(f"dataset file {path} has no rows; {hint}")
    return table.to_pylist()


def write_rows(rows: list[dict[str, Any]], path: str | Path) -> Path:
    """Write ``rows`` as parquet or JSON lines (by suffix), atomically via a sibling temp file."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in PARQUET_SUFFIXES + JSONL_SUFFIXES:
        raise RayhfError(f"cannot write rows to {path}: use a .parquet or .jsonl file name")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            if suffix in PARQUET_SUFFIXES:
                pq.write_table(pa.Table.from_pylist(rows), f)
            else:
                f.writelines((json.dumps(row) + "\n").encode() for row in rows)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


CHAT_ROLES = ("system", "user", "assistant", "tool")


def render_messages(
    tokenizer: PreTrainedTokenizerBase, messages: list[Any], where: str, tools: Any = None
) -> str:
    """Chat ``messages`` as the prompt text the tokenizer's chat template makes of them, with the
    assistant's turn opened and ``tools`` (JSON schemas, or a JSON list of them) in the
    template's tools section; ``where`` (file and row) starts every error."""
    for j, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str):
            raise RayhfError(
                f"{where}: message {j} is not {{role, content}} with text content; fix the file"
            )
        if m.get("role") not in CHAT_ROLES:
            raise RayhfError(
                f"{where}: message {j} has role {m.get('role')!r}; use one of "
                f"{', '.join(CHAT_ROLES)}"
            )
    if not getattr(tokenizer, "chat_template", None):
        raise RayhfError(
            f"{where}: the prompt is chat messages but the tokenizer has no chat template; "
            "set tokenizer.chat_template or use a tokenizer directory that has one"
        )
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as err:
            raise RayhfError(
                f"{where}: the tools column is not JSON ({err}); fix the file"
            ) from err
    if tools is not None and not (
        isinstance(tools, list) and all(isinstance(t, dict) for t in tools)
    ):
        raise RayhfError(f"{where}: the tools column is not a list of JSON schemas; fix the file")
    chat = [{"role": m["role"], "content": m["content"]} for m in messages]
    text = tokenizer.apply_chat_template(
        chat, tools=tools or None, tokenize=False, add_generation_prompt=True
    )
    return str(text)


class PromptDataset:
    """Tokenized rows of one kind plus the ``(epoch, position)`` cursor of the batch stream."""

    def __init__(
        self,
        rows: list[dict[str, Any]],
        tokenizer: PreTrainedTokenizerBase,
        config: DatasetConfig,
        kind: DatasetKind = "prompts",
    ) -> None:
        assert kind in KIND_INPUTS, f"unknown dataset kind {kind!r}"
        if not rows:
            raise RayhfError(f"dataset file {config.path} has no rows; set dataset.path")
        if kind != "prompts" and tokenizer.eos_token_id is None:
            raise RayhfError(
                f"the tokenizer has no eos token, which ends every {kind} sequence; "
                "use a tokenizer with one"
            )
        self.config, self.kind = config, kind
        prompts = [self._prompt(tokenizer, row, i) for i, row in enumerate(rows)]
        self.texts = [text for text, _ in prompts]
        self.ids = [self._check_len(ids, i) for i, (_, ids) in enumerate(prompts)]
        self.fields = [self._row_fields(tokenizer, row, i) for i, row in enumerate(rows)]
        self.extras = [self._row_extras(row) for row in rows]
        self.epoch = 0
        self.position = 0
        self._order: list[int] = []
        self._order_key: tuple[int, int] | None = None

    @classmethod
    def from_config(
        cls,
        config: DatasetConfig,
        tokenizer: PreTrainedTokenizerBase,
        kind: DatasetKind = "prompts",
        path: str | Path | None = None,
    ) -> PromptDataset:
        """The rows at ``config.path``, or at ``path`` read with the same settings.

        ``path`` exists to load ``config.eval_path``, so its file errors name that field.
        """
        if path is None:
            return cls(load_rows(config.path), tokenizer, config, kind)
        rows = load_rows(path, field="dataset.eval_path")
        return cls(rows, tokenizer, config.model_copy(update={"path": str(path)}), kind)

    def __len__(self) -> int:
        return len(self.texts)

    def longest_sample(self, max_new_tokens: int) -> tuple[int, str]:
        """The most sequence tokens one sample can hold (prompts: with its response), and how
        that count is made, for an error message."""
        if self.kind == "prompts":
            prompt = max(len(ids) for ids in self.ids)
            why = f"prompt of {prompt} + generation.max_new_tokens={max_new_tokens}"
            return prompt + max_new_tokens, why
        longest = max(sum(len(ids) for ids in fields.values()) for fields in self.fields)
        return longest, f"the longest row of dataset file {self.config.path}"

    def mean_prompt_len(self) -> float:
        """Mean prompt length in tokens (the planner's workload)."""
        return sum(len(i) for i in self.ids) / max(1, len(self.ids))

    def _text(self, row: dict[str, Any], i: int, field: str) -> str:
        """Row ``i``'s text in the column that config field ``field`` names."""
        key, path = getattr(self.config, field), self.config.path
        if key not in row:
            raise RayhfError(
                f"dataset file {path} has no column {key!r} (row {i} has {sorted(row)}); "
                f"set dataset.{field}"
            )
        text = row[key]
        if not isinstance(text, str):
            raise RayhfError(
                f"dataset file {path} row {i}: column {key!r} holds {type(text).__name__}, "
                f"not text; fix the file or set dataset.{field}"
            )
        return text

    def _prompt(
        self, tokenizer: PreTrainedTokenizerBase, row: dict[str, Any], i: int
    ) -> tuple[str, list[int]]:
        """Row ``i``'s prompt as text and ids: bos (if the tokenizer has one: some, like Qwen's,
        don't) + the text, or chat messages rendered by the tokenizer's chat template."""
        key = self.config.prompt_key
        if isinstance(row.get(key), list):
            where = f"dataset file {self.config.path} row {i}"
            text = render_messages(tokenizer, row[key], where, row.get(self.config.tools_key))
            return text, tokenizer.encode(text, add_special_tokens=False)
        text = self._text(row, i, "prompt_key")
        bos = [] if tokenizer.bos_token_id is None else [tokenizer.bos_token_id]
        return text, bos + tokenizer.encode(text, add_special_tokens=False)

    def _check_len(self, ids: list[int], i: int) -> list[int]:
        limit = self.config.max_prompt_len
        if len(ids) > limit:
            raise RayhfError(
                f"dataset file {self.config.path} row {i}: prompt is {len(ids)} tokens "
                f"(with bos), over dataset.max_prompt_len={limit}; raise it or shorten the prompt"
            )
        return ids

    def _row_fields(
        self, tokenizer: PreTrainedTokenizerBase, row: dict[str, Any], i: int
    ) -> dict[str, list[int]]:
        """The token ids of every key this kind provides for row ``i`` (prompt ids already set)."""
        if self.kind == "prompts":
            return {"prompts": self.ids[i]}
        fields: dict[str, list[int]] = {}
        limit, eos = self.config.max_seq_len, tokenizer.eos_token_id
        for key, field in SEQUENCE_COLUMNS[self.kind]:
            answer = tokenizer.encode(self._text(row, i, field), add_special_tokens=False)
            seq = [*self.ids[i], *answer, eos]
            if len(seq) > limit:
                raise RayhfError(
                    f"dataset file {self.config.path} row {i}: {key} is {len(seq)} tokens "
                    f"(bos + prompt + {key} + eos), over dataset.max_seq_len={limit}; "
                    "raise it or shorten the row"
                )
            fields[key] = seq
        return fields

    def _row_extras(self, row: dict[str, Any]) -> dict[str, Any]:
        """A prompts row's columns besides the prompt: what its reward may read."""
        if self.kind != "prompts":
            return {}
        return {k: v for k, v in row.items() if k != self.config.prompt_key}

    @property
    def columns(self) -> list[str]:
        """The columns every sample carries to the reward (prompts kind; none for the others)."""
        return sorted(self.extras[0]) if self.extras else []

    def _sample(self, sample_id: int, index: int) -> Sample:
        i = index
        return Sample(sample_id, self.texts[i], self.ids[i], self.fields[i], self.extras[i])

    def all_samples(self) -> list[Sample]:
        """Every row once in file order, ``sample_id`` = row index: a whole evaluation set."""
        return [self._sample(i, i) for i in range(len(self))]

    def order(self, epoch: int, seed: int) -> list[int]:
        """Row indices in the order epoch ``epoch`` visits them."""
        if self._order_key != (epoch, seed):
            order = list(range(len(self)))
            if self.config.shuffle:
                random.Random(seed + epoch).shuffle(order)
            self._order, self._order_key = order, (epoch, seed)
        return self._order

    def next_batch(self, batch_size: int, seed: int) -> list[Sample]:
        """The next ``batch_size`` samples, continuing into the next epoch when one runs out."""
        assert batch_size > 0, "batch_size must be positive"
        n = len(self)
        batch: list[Sample] = []
        while len(batch) < batch_size:
            if self.position >= n:
                self.epoch, self.position = self.epoch + 1, 0
            index = self.order(self.epoch, seed)[self.position]
            batch.append(self._sample(self.epoch * n + index, index))
            self.position += 1
        return batch

    def batches(self, batch_size: int, seed: int) -> Iterator[list[Sample]]:
        """Endless stream of batches; the cursor advances before each yield, so
        ``state_dict()`` taken between batches resumes right after the last one drawn."""
        while True:
            yield self.next_batch(batch_size, seed)

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "n_samples": len(self)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Restore the cursor; the dataset must have as many rows as when it was saved."""
        saved_n = state.get("n_samples", len(self))
        if saved_n != len(self):
            raise RayhfError(
                f"dataset file {self.config.path} has {len(self)} rows but the checkpoint was "
                f"taken with {saved_n}; resume with the same dataset.path"
            )
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
