"""Prompt loading, user-facing errors, resumable batch streams, and the demo reward."""

from __future__ import annotations

import random
from statistics import mean

import pytest
from pydantic import ValidationError

from rayhf.data.datasets import DatasetConfig, PromptDataset, load_rows, write_rows
from rayhf.errors import RayhfError
from rayhf.tasks import demo as demo_task

ROWS = [{"prompt": f"{i % 10} {(i * 3) % 10} =", "extra": i} for i in range(10)]


@pytest.fixture(scope="module")
def tok():
    return demo_task.build_tokenizer()


def dataset(tok, rows=ROWS, **overrides) -> PromptDataset:
    return PromptDataset(rows, tok, DatasetConfig(path="prompts.jsonl", **overrides))


def assert_one_line_error(exc_info, *needles: str) -> None:
    msg = str(exc_info.value)
    assert "\n" not in msg
    for needle in needles:
        assert needle in msg, f"{needle!r} not in {msg!r}"


# --- loading ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["p.parquet", "p.jsonl", "p.json"])
def test_write_then_load_round_trips(tmp_path, name):
    path = write_rows(ROWS, tmp_path / "sub" / name)
    assert load_rows(path) == ROWS
    assert [p.name for p in path.parent.iterdir()] == [name]  # no temp file left behind


def test_write_rows_replaces_existing_file(tmp_path):
    path = tmp_path / "p.jsonl"
    write_rows(ROWS, path)
    write_rows(ROWS[:2], path)
    assert load_rows(path) == ROWS[:2]


def test_from_config_reads_file(tmp_path, tok):
    path = write_rows(ROWS, tmp_path / "p.parquet")
    ds = PromptDataset.from_config(DatasetConfig(path=str(path)), tok)
    assert len(ds) == len(ROWS)
    assert ds.texts == [r["prompt"] for r in ROWS]
    assert ds.ids[0] == [tok.bos_token_id, *tok.encode(ROWS[0]["prompt"])]


def test_missing_file(tmp_path):
    with pytest.raises(RayhfError) as err:
        load_rows(tmp_path / "nope.parquet")
    assert_one_line_error(err, "nope.parquet", "dataset.path")


@pytest.mark.parametrize("name", ["empty.jsonl", "empty.parquet"])
def test_empty_file(tmp_path, name):
    path = write_rows([], tmp_path / name) if name.endswith("parquet") else tmp_path / name
    path.touch()
    with pytest.raises(RayhfError) as err:
        load_rows(path)
    assert_one_line_error(err, name, "no rows", "dataset.path")


@pytest.mark.parametrize(
    ("name", "content"),
    [("bad.parquet", "not parquet"), ("bad.jsonl", '{"prompt": [1,\n'), ("p.csv", "prompt\nx\n")],
)
def test_unreadable_or_unsupported_file(tmp_path, name, content):
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(RayhfError) as err:
        load_rows(path)
    assert_one_line_error(err, name, "dataset.path")


def test_missing_column(tok):
    with pytest.raises(RayhfError) as err:
        dataset(tok, prompt_key="question")
    assert_one_line_error(err, "prompts.jsonl", "dataset.prompt_key", "'question'")


def test_too_long_prompt(tok):
    rows = [*ROWS[:3], {"prompt": "1 2 3 4 5 ="}]
    with pytest.raises(RayhfError) as err:
        dataset(tok, rows, max_prompt_len=8)  # bos + 11 characters = 12 tokens
    assert_one_line_error(err, "prompts.jsonl", "row 3", "12 tokens", "dataset.max_prompt_len=8")
    assert len(dataset(tok, rows, max_prompt_len=12)) == 4


def test_config_is_strict():
    with pytest.raises(ValidationError):
        DatasetConfig(path="p.jsonl", prompt_column="x")
    with pytest.raises(ValidationError):
        DatasetConfig(path="p.jsonl", max_prompt_len=0)


# --- batches ---------------------------------------------------------------------------------


def draw(ds: PromptDataset, n_batches: int, batch_size: int = 4, seed: int = 7) -> list:
    stream = ds.batches(batch_size, seed)
    return [next(stream) for _ in range(n_batches)]


def test_batches_are_deterministic_and_cover_each_epoch(tok):
    a, b = draw(dataset(tok), 10), draw(dataset(tok), 10)
    assert a == b
    flat = [p for batch in a for p in batch]  # 40 samples = 4 epochs of 10
    assert all(len(batch) == 4 for batch in a)
    assert len({p.sample_id for p in flat}) == 40
    for epoch in range(4):
        ids = [p.sample_id for p in flat[epoch * 10 : (epoch + 1) * 10]]
        assert sorted(ids) == list(range(epoch * 10, epoch * 10 + 10))
    first, second = ([p.sample_id % 10 for p in flat[e * 10 : (e + 1) * 10]] for e in range(2))
    assert first != second  # each epoch has its own permutation
    assert first != list(range(10))


def test_sample_carries_text_and_ids(tok):
    ds = dataset(tok)
    for sample in draw(ds, 3)[2]:
        assert sample.text == ROWS[sample.sample_id % 10]["prompt"]
        assert sample.ids == [tok.bos_token_id, *tok.encode(sample.text)]
        assert sample.fields == {"prompts": sample.ids}
        assert sample.prompt_len == len(sample.ids)


def test_seed_changes_order(tok):
    assert draw(dataset(tok), 3, seed=1) != draw(dataset(tok), 3, seed=2)


def test_no_shuffle_keeps_file_order(tok):
    flat = [p.sample_id for batch in draw(dataset(tok, shuffle=False), 5) for p in batch]
    assert flat == list(range(20))


@pytest.mark.parametrize("cut", [1, 2, 3, 5])
def test_resume_draws_the_uninterrupted_sequence(tok, cut):
    uninterrupted = draw(dataset(tok), 8)
    first = dataset(tok)
    head = draw(first, cut)
    state = first.state_dict()
    resumed = dataset(tok)
    resumed.load_state_dict(state)
    assert head + draw(resumed, 8 - cut) == uninterrupted


def test_resume_with_other_dataset_size_is_a_user_error(tok):
    ds = dataset(tok)
    draw(ds, 1)
    with pytest.raises(RayhfError) as err:
        dataset(tok, ROWS[:5]).load_state_dict(ds.state_dict())
    assert_one_line_error(err, "dataset.path", "10")


# --- demo task -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("prompt", "response", "expected"),
    [
        ("3 1 4 =", "3 1 4", 1.0),
        ("3 1 4 =", "314", 1.0),  # spaces do not count
        ("3 1 4 =", "", 0.0),
        ("3 1 4 =", "   ", 0.0),
        ("3 1 4 =", "a b =", 0.0),
        ("3 1 4 =", "3 9 1 4", 0.75),  # one digit too many: 1 edit over 4 characters
        ("3 1 4 =", "3 1", 2 / 3),  # one missing
        ("3 1 4 =", "4 1 3", 1 / 3),  # the right digits in the wrong order
        ("3 1 4 =", "3 1 4 =", 0.75),
        ("3 1 4 1 5 =", "1 1 1 1 1", 0.4),  # only the 1s in place count
    ],
)
def test_demo_reward_grades_the_whole_answer(prompt, response, expected):
    assert demo_task.reward([prompt], [response]) == [pytest.approx(expected)]


def test_demo_reward_needs_eos_and_keeps_order():
    assert demo_task.reward(["1 =", "2 ="], ["1", "1"]) == [1.0, 0.0]
    assert demo_task.reward(["1 =", "1 ="], ["1", "1"], finished=[True, False]) == [1.0, 0.0]


def test_demo_reward_cannot_be_gamed_by_degenerate_answers():
    """The answers a policy could settle on without copying: one digit, one digit repeated to
    the prompt's length, the prompt's digits sorted; and a random policy that stops at EOS."""
    prompts = [r["prompt"] for r in demo_task.make_prompts(400, seed=0)]
    best_single = [max(demo_task.reward([p], [d])[0] for d in "0123456789") for p in prompts]
    assert max(best_single) <= 0.25  # a one-token answer: < 0.3 whatever the prompt
    n_digits = [len(demo_task.echo(p).split()) for p in prompts]
    runs = [
        max(demo_task.reward([p], [" ".join(d * n)])[0] for d in "0123456789")
        for p, n in zip(prompts, n_digits, strict=True)
    ]
    assert mean(runs) < 0.45  # the most common digit, repeated: its matches in place only
    rng = random.Random(0)
    symbols = [*demo_task.ALPHABET, None]  # None: EOS, one token among the alphabet's
    answers, finished = [], []
    for _ in prompts:
        drawn = [rng.choice(symbols) for _ in range(12)]  # the main job's max_new_tokens
        cut = drawn.index(None) if None in drawn else len(drawn)
        answers.append("".join(drawn[:cut]))  # type: ignore[arg-type]
        finished.append(cut < len(drawn))
    assert mean(demo_task.reward(prompts, answers, finished)) < 0.1
    echoes = [demo_task.echo(p) for p in prompts]
    assert demo_task.reward(prompts, echoes, [True] * len(prompts)) == [1.0] * len(prompts)


def test_demo_prompts_fit_the_alphabet_and_defaults(tmp_path, tok):
    rows = demo_task.make_prompts(200, seed=3)
    assert rows == demo_task.make_prompts(200, seed=3)
    assert rows != demo_task.make_prompts(200, seed=4)
    for row in rows:
        digits = row["prompt"].split()
        assert digits[-1] == "=" and 4 <= len(digits) - 1 <= 8
        assert all(d.isdigit() and len(d) == 1 for d in digits[:-1])
    path = demo_task.make_dataset(tmp_path / "demo.parquet", n=64, seed=0)
    ds = PromptDataset.from_config(DatasetConfig(path=str(path)), tok)
    assert len(ds) == 64
    assert tok.unk_token_id not in {i for ids in ds.ids for i in ids}
    assert demo_task.reward(ds.texts, [t.rstrip(" =") for t in ds.texts]) == [1.0] * 64
