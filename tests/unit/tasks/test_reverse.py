"""The main job's task (``rayhf.tasks.reverse``): its reward's rules, and that the answers a
policy could settle on without reversing anything stay under 0.3."""

from __future__ import annotations

import json
import random
from statistics import mean

import pytest

from rayhf.tasks import reverse as task
from rayhf.tasks.demo import ALPHABET, make_prompts
from rayhf.tasks.reverse import digits

PROMPTS = [r["prompt"] for r in make_prompts(2000, seed=0)]


@pytest.mark.parametrize(
    ("prompt", "response", "expected"),
    [
        ("3 1 4 =", "4 1 3", 1.0),
        ("3 1 4 =", "413", 1.0),  # spaces do not count
        ("3 1 4 =", "", 0.0),
        ("3 1 4 =", "  ", 0.0),
        ("3 1 4 =", "4 1 9", 2 / 3),  # one digit wrong
        ("3 1 4 =", "4 1", 2 / 3),  # one missing at the end
        ("3 1 4 =", "1 3", 0.0),  # one missing at the start shifts the rest
        ("3 1 4 =", "4 1 3 3", 3 / 4),  # one too many
        ("3 1 4 =", "3 1 4", 1 / 3),  # the echo: only the middle digit is in place
        ("3 1 4 =", "3 1 4 =", 1 / 4),
    ],
)
def test_the_reward_counts_digits_in_their_place(prompt, response, expected):
    assert task.reward([prompt], [response]) == [pytest.approx(expected)]


def test_the_reward_needs_eos_and_keeps_order():
    assert task.reward(["1 2 =", "1 2 ="], ["2 1", "1 2"]) == [1.0, 0.0]
    assert task.reward(["1 2 =", "1 2 ="], ["2 1", "2 1"], finished=[True, False]) == [1.0, 0.0]
    ideal = [task.reverse(p) for p in PROMPTS]
    assert task.reward(PROMPTS, ideal, [True] * len(PROMPTS)) == [1.0] * len(PROMPTS)


def test_shortcut_answers_score_under_0_3():
    scores = task.shortcut_scores()
    assert set(scores) >= {"empty", "the prompt repeated", "its digits in order", "its last digit"}
    assert all(0 <= v < 0.3 for v in scores.values()), scores


def test_no_one_token_or_constant_answer_scores_0_3():
    for d in "0123456789":
        assert max(task.reward(PROMPTS, [d] * len(PROMPTS))) <= 0.25  # prompts hold >= 4 digits
        for n in range(1, 9):
            assert mean(task.reward(PROMPTS, [" ".join(d * n)] * len(PROMPTS))) < 0.15
    rng = random.Random(0)
    symbols = [*ALPHABET, None]  # None: EOS, one token among the alphabet's
    answers, finished = [], []
    for _ in PROMPTS:
        drawn = [rng.choice(symbols) for _ in range(16)]  # the main job's max_new_tokens
        cut = drawn.index(None) if None in drawn else len(drawn)
        answers.append("".join(drawn[:cut]))  # type: ignore[arg-type]
        finished.append(cut < len(drawn))
    assert mean(task.reward(PROMPTS, answers, finished)) < 0.05


def test_the_sft_rows_hold_the_reversed_digits_of_other_prompts_than_ppo_s(tmp_path):
    rows = task.make_sft_rows(300, seed=1)
    assert len(rows) == 300
    assert all(r["response"] == " ".join(reversed(digits(r["prompt"]))) for r in rows)
    ppo_prompts = {r["prompt"] for r in make_prompts(512, seed=0)}
    assert len(ppo_prompts & {r["prompt"] for r in rows}) < 10  # chance repeats of short ones
    path = task.make_sft_dataset(tmp_path / "sft.jsonl", n=8)
    assert path.read_text().count("\n") == 8


def test_the_summary_reads_the_run_s_metrics(tmp_path):
    rows = [{"step": s, "task_reward": s / 20, "kl": 2.0} for s in range(1, 21)]
    rows.insert(3, {"step": 3, "eval/reward": 0.5})  # rows without a step's reward are skipped
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = task.summary(tmp_path)
    assert "0.050 at PPO step 1" in text and "-> 0.775, the mean of the last 10" in text
    assert "KL to the reference 2.00" in text and "the prompt repeated 0.1" in text


def test_the_demo_s_ppo_stage_starts_from_the_sft_stage_s_last_checkpoint():
    from conftest import REPO

    import rayhf

    sft = rayhf.load_config(REPO / "examples" / "demo" / "sft.yaml")
    ppo = rayhf.load_config(REPO / "examples" / "demo" / "ppo.yaml")
    assert sft.steps % sft.save_every == 0
    last = f"{sft.run_dir}/checkpoints/step_{sft.steps:06d}/actor"
    assert ppo.models["actor"].path == last
    assert ppo.models["reward"].function == "rayhf.tasks.reverse:reward"
    assert sft.dataset_builder == "rayhf.tasks.reverse:make_sft_dataset"
