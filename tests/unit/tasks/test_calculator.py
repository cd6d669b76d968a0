"""The calculator example's SFT stage teaches exactly what its environment renders: each
demonstration, read as the SFT dataset reads it (chat messages and a tools column), is token
for token the trajectory ``CalculatorEnv`` builds for the same right answers."""

from __future__ import annotations

import asyncio
import re

import pytest

from rayhf.data.datasets import DatasetConfig, PromptDataset, render_messages
from rayhf.envs import trajectory
from rayhf.errors import RayhfError
from rayhf.tasks.calculator import CalculatorEnv, build_tokenizer, make_sft_dataset, make_sft_rows

TOK = build_tokenizer()


def test_sft_rows_are_the_environment_s_trajectories(tmp_path):
    path = make_sft_dataset(tmp_path / "sft.parquet", n=4, seed=3)  # tools: JSON text in parquet
    cfg = DatasetConfig(path=str(path), max_prompt_len=256, max_seq_len=256)
    data = PromptDataset.from_config(cfg, TOK, "sft")
    rows = make_sft_rows(4, 3)
    for q in range(4):
        call_seq, answer_seq = data.fields[2 * q]["seq"], data.fields[2 * q + 1]["seq"]
        env = CalculatorEnv({"prompt": rows[2 * q]["prompt"][0]["content"], "answer": 0})
        traj = trajectory.start(TOK, asyncio.run(env.reset()), [t.schema() for t in env.tools])
        for seq in (call_seq, answer_seq):  # the model's turn: what follows the prompt so far
            turn = seq[len(traj.tokens) :]
            assert turn[-1] == TOK.eos_token_id and TOK.eos_token_id not in turn[:-1]
            text = trajectory.add_model_turn(traj, TOK, turn, [0.0] * len(turn))
            assert traj.tokens == seq
            step = asyncio.run(env.step(text))
            if step.messages:
                trajectory.add_messages(traj, TOK, step.messages)
        assert text.startswith("Answer: ") and step.done and step.messages == []
    digits = TOK.convert_ids_to_tokens(TOK.encode("Answer: 358202"))
    assert digits[-6:] == list("358202"), "a token per digit: a number reads the same anywhere"


@pytest.mark.parametrize(
    ("tools", "message"),
    [
        ("[{", "the tools column is not JSON"),
        ('{"a": 1}', "the tools column is not a list of JSON schemas"),
    ],
)
def test_a_bad_tools_column_is_refused_with_its_row(tools, message):
    chat = [{"role": "user", "content": "What is 2 * 3?"}]
    with pytest.raises(RayhfError, match=re.escape(f"row 1: {message}")):
        render_messages(TOK, chat, "dataset file d.jsonl row 1", tools)
