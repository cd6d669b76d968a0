"""Prompt datasets: load rows from a file, tokenize once, draw resumable shuffled batches.

Batches are a pure function of ``(seed, epoch, position)``: epoch ``e`` visits the rows in a
permutation seeded by ``seed + e``, and a batch that runs off the end of an epoch continues in
the next one. Saving ``epoch`` and ``position`` is therefore enough for a resumed run to draw
exactly the batches an uninterrupted run would.
"""

from __future__ import annotations

import json
import os
import random
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import pyarrow as pa
import pyarrow.json as pa_json
import pyarrow.parquet as pq
from pydantic import BaseModel, ConfigDict, Field

from rayhf.errors import RayhfError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

PARQUET_SUFFIXES = (".parquet",)
JSONL_SUFFIXES = (".jsonl", ".json")  # .json must hold JSON lines, one object per line


class DatasetConfig(BaseModel):
    """Where the prompts are and how they are read."""

    model_config = ConfigDict(extra="forbid")

    path: str  # a .parquet, .jsonl or .json (JSON lines) file, one prompt per row
    prompt_key: str = "prompt"  # the column holding the prompt text
    max_prompt_len: int = Field(64, gt=0)  # prompt tokens, counting the prepended bos
    shuffle: bool = True  # reshuffle every epoch; False keeps file order


class Prompt(NamedTuple):
    """One drawn sample; ``sample_id`` is unique across epochs (``epoch * n + index``)."""

    sample_id: int
    text: str
    ids: list[int]


def _one_line(err: BaseException) -> str:
    """Library messages can span lines; ours must not."""
    return " ".join(str(err).split()) or type(err).__name__


def load_rows(path: str | Path) -> list[dict[str, Any]]:
    """All rows of a parquet or JSON-lines file, as dicts."""
    path = Path(path)
    hint = "set dataset.path to a .parquet or .jsonl file of prompts"
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


class PromptDataset:
    """Tokenized prompts plus the ``(epoch, position)`` cursor of the batch stream."""

    def __init__(
        self, rows: list[dict[str, Any]], tokenizer: PreTrainedTokenizerBase, config: DatasetConfig
    ) -> None:
        if not rows:
            raise RayhfError(f"dataset file {config.path} has no rows; set dataset.path")
        self.config = config
        self.texts = [self._prompt_text(row, i) for i, row in enumerate(rows)]
        self.ids = [self._tokenize(tokenizer, text, i) for i, text in enumerate(self.texts)]
        self.epoch = 0
        self.position = 0
        self._order: list[int] = []
        self._order_key: tuple[int, int] | None = None

    @classmethod
    def from_config(
        cls, config: DatasetConfig, tokenizer: PreTrainedTokenizerBase
    ) -> PromptDataset:
        return cls(load_rows(config.path), tokenizer, config)

    def __len__(self) -> int:
        return len(self.texts)

    def _prompt_text(self, row: dict[str, Any], i: int) -> str:
        key, path = self.config.prompt_key, self.config.path
        if key not in row:
            raise RayhfError(
                f"dataset file {path} has no column {key!r} (row {i} has {sorted(row)}); "
                "set dataset.prompt_key"
            )
        text = row[key]
        if not isinstance(text, str):
            raise RayhfError(
                f"dataset file {path} row {i}: column {key!r} holds {type(text).__name__}, "
                "not text; fix the file or set dataset.prompt_key"
            )
        return text

    def _tokenize(self, tokenizer: PreTrainedTokenizerBase, text: str, i: int) -> list[int]:
        """Prompt ids with bos prepended (if the tokenizer has one: some, like Qwen's, don't)."""
        bos = [] if tokenizer.bos_token_id is None else [tokenizer.bos_token_id]
        ids = bos + tokenizer.encode(text, add_special_tokens=False)
        limit = self.config.max_prompt_len
        if len(ids) > limit:
            raise RayhfError(
                f"dataset file {self.config.path} row {i}: prompt is {len(ids)} tokens "
                f"(with bos), over dataset.max_prompt_len={limit}; raise it or shorten the prompt"
            )
        return ids

    def order(self, epoch: int, seed: int) -> list[int]:
        """Row indices in the order epoch ``epoch`` visits them."""
        if self._order_key != (epoch, seed):
            order = list(range(len(self)))
            if self.config.shuffle:
                random.Random(seed + epoch).shuffle(order)
            self._order, self._order_key = order, (epoch, seed)
        return self._order

    def next_batch(self, batch_size: int, seed: int) -> list[Prompt]:
        """The next ``batch_size`` prompts, continuing into the next epoch when one runs out."""
        assert batch_size > 0, "batch_size must be positive"
        n = len(self)
        batch: list[Prompt] = []
        while len(batch) < batch_size:
            if self.position >= n:
                self.epoch, self.position = self.epoch + 1, 0
            index = self.order(self.epoch, seed)[self.position]
            batch.append(Prompt(self.epoch * n + index, self.texts[index], self.ids[index]))
            self.position += 1
        return batch

    def batches(self, batch_size: int, seed: int) -> Iterator[list[Prompt]]:
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
