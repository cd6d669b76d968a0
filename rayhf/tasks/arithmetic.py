"""Arithmetic word problems in GSM8K's format, generated here (nothing is downloaded).

A row is what a GSM8K parquet prepared for RL holds: ``prompt``, a list of chat messages (a
system instruction and the problem), ``answer``, the worked solution ending in ``#### value``, and
``data_source``. The problems take one step of addition or subtraction over small numbers, e.g.
"Ann has 7 apples. She gets 5 more apples. How many apples does Ann have now?" with the answer
"7 + 5 = 12\\n#### 12". ``make_sft_dataset`` writes the same rows with the solution as the
``response`` column, for the supervised stage that makes a small instruct model.
"""

from __future__ import annotations

import random
from pathlib import Path

from rayhf.data.datasets import write_rows
from rayhf.models.tokenizer import train_bpe_tokenizer

SYSTEM = "Solve the problem. End with #### and the number."
NAMES = ("Ann", "Ben", "Cleo", "Dan", "Eve", "Finn", "Gus", "Hana", "Ivy", "Jon")
ITEMS = ("apples", "books", "coins", "pens", "shells", "stamps", "cards", "eggs")
SOURCE = "arithmetic"


def make_problem(rng: random.Random) -> tuple[str, str]:
    """One problem and its worked solution (``a op b = c`` then ``#### c``)."""
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    a = rng.randint(2, 19)
    if rng.random() < 0.5:
        b = rng.randint(1, 9)
        question = (
            f"{name} has {a} {item}. {name} gets {b} more {item}. "
            f"How many {item} does {name} have now?"
        )
        return question, f"{a} + {b} = {a + b}\n#### {a + b}"
    b = rng.randint(1, min(a, 9))
    question = (
        f"{name} has {a} {item}. {name} gives away {b} {item}. "
        f"How many {item} does {name} have left?"
    )
    return question, f"{a} - {b} = {a - b}\n#### {a - b}"


def messages(question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def make_rows(n: int, seed: int) -> list[dict[str, object]]:
    """``n`` rows ``{prompt: messages, answer: solution, data_source}``, a function of ``seed``."""
    rng = random.Random(seed)
    rows: list[dict[str, object]] = []
    for _ in range(n):
        question, solution = make_problem(rng)
        rows.append({"prompt": messages(question), "answer": solution, "data_source": SOURCE})
    return rows


def make_dataset(path: str | Path, n: int = 1024, seed: int = 0) -> Path:
    """Write ``make_rows(n, seed)`` (.parquet or .jsonl) and return the path."""
    return write_rows(make_rows(n, seed), path)


def make_sft_dataset(path: str | Path, n: int = 2048, seed: int = 1) -> Path:
    """The same kind of rows with the worked solution as ``response`` (supervised stage)."""
    rows = [{"prompt": r["prompt"], "response": r["answer"]} for r in make_rows(n, seed)]
    return write_rows(rows, path)


def build_tokenizer(out_dir: str | Path, vocab_size: int = 400):
    """A byte-level BPE tokenizer trained on generated problems, with a ChatML template."""
    rng, texts = random.Random(12_345), []
    for _ in range(2000):
        texts += [SYSTEM, *make_problem(rng)]
    return train_bpe_tokenizer(texts, vocab_size=vocab_size, out_dir=out_dir)
