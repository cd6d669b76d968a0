"""The generated GSM8K-format task (``rayhf.tasks.arithmetic``): rows as GSM8K parquets hold them,
solutions the math reward accepts, and no constant answer that earns much."""

from __future__ import annotations

import re
from collections import Counter

from rayhf.data.datasets import DatasetConfig, PromptDataset, load_rows
from rayhf.rewards import extract_gsm8k, math_reward
from rayhf.tasks.arithmetic import build_tokenizer, make_dataset, make_rows, make_sft_dataset


def test_rows_are_chat_messages_with_a_worked_solution(tmp_path):
    rows = make_rows(300, seed=0)
    assert rows == make_rows(300, seed=0) and rows != make_rows(300, seed=1)
    for row in rows:
        system, user = row["prompt"]  # type: ignore[misc]
        assert (system["role"], user["role"]) == ("system", "user")
        a, op, b, c = re.fullmatch(r"(\d+) ([+-]) (\d+) = (\d+)\n#### \d+", row["answer"]).groups()  # type: ignore[arg-type,union-attr]
        assert int(c) == (int(a) + int(b) if op == "+" else int(a) - int(b)) >= 0
        assert f"{a} " in user["content"] and f"{b} " in user["content"]
        assert extract_gsm8k(str(row["answer"])) == c
    path = make_dataset(tmp_path / "train.parquet", n=64)
    assert load_rows(path)[0]["data_source"] == "arithmetic"
    sft = load_rows(make_sft_dataset(tmp_path / "sft.parquet", n=8))
    assert set(sft[0]) == {"prompt", "response"}


def test_the_reward_takes_the_right_answer_and_no_constant_answer_earns_much():
    rows = make_rows(1000, seed=3)
    answers = [str(r["answer"]) for r in rows]
    prompts = [""] * len(rows)
    assert math_reward(prompts, answers, answers) == [1.0] * len(rows), "the solution scores 1"
    finals = Counter(extract_gsm8k(a) for a in answers)
    value, _ = finals.most_common(1)[0]
    best_constant = sum(math_reward(prompts, [f"#### {value}"] * len(rows), answers)) / len(rows)
    assert best_constant < 0.1, best_constant  # the most common final answer, every time
    no_marker = [a.split("\n")[0] for a in answers]  # "3 + 4 = 7" without "#### 7"
    assert sum(math_reward(prompts, no_marker, answers)) == 0.0


def test_the_tokenizer_renders_prompts_within_the_example_s_limit(tmp_path):
    tok = build_tokenizer(tmp_path / "tok")
    ds = PromptDataset(
        make_rows(200, seed=0), tok, DatasetConfig(path="t.jsonl", max_prompt_len=72)
    )
    assert max(len(ids) for ids in ds.ids) <= 72 and tok.unk_token_id is None
    assert ds.texts[0].startswith("<|im_start|>system\n") and ds.columns == [
        "answer",
        "data_source",
    ]
