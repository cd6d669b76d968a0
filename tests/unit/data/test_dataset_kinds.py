"""Dataset kinds (prompts, sft, pairs): token layout, packing, errors, eval rows, demo datasets."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from pydantic import ValidationError

from rayhf.data.datasets import (
    DatasetConfig,
    PromptDataset,
    kind_for_inputs,
    to_packed,
    write_rows,
)
from rayhf.errors import RayhfError
from rayhf.models.hf import ModelInit, build_model, hf_config
from rayhf.tasks import demo as demo_task

PROMPTS = [f"{i % 10} {(i * 3) % 10} =" for i in range(10)]
SFT_ROWS = [{"prompt": p, "response": f"{i % 10} {i % 7}"} for i, p in enumerate(PROMPTS)]
PAIR_ROWS = [
    {"prompt": p, "chosen": f"{i % 10}", "rejected": f"{(i + 1) % 10} {i % 4} a"}
    for i, p in enumerate(PROMPTS)
]
SEQ_KEYS = {"sft": ("seq",), "pairs": ("chosen", "rejected")}
ANSWER_COLUMN = {"seq": "response", "chosen": "chosen", "rejected": "rejected"}
ROWS_OF = {"prompts": SFT_ROWS, "sft": SFT_ROWS, "pairs": PAIR_ROWS}


@pytest.fixture(scope="module")
def tok():
    return demo_task.build_tokenizer()


def dataset(tok, kind, rows=None, **overrides) -> PromptDataset:
    rows = ROWS_OF[kind] if rows is None else rows
    return PromptDataset(rows, tok, DatasetConfig(path="rows.jsonl", **overrides), kind)


def assert_one_line_error(exc_info, *needles: str) -> None:
    msg = str(exc_info.value)
    assert "\n" not in msg
    for needle in needles:
        assert needle in msg, f"{needle!r} not in {msg!r}"


# --- kinds and token layout ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "keys"),
    [("prompts", ["prompts"]), ("sft", ["seq"]), ("pairs", ["chosen", "rejected"])],
)
def test_each_kind_has_its_keys(tok, kind, keys):
    for sample in dataset(tok, kind).next_batch(4, seed=0):
        assert list(sample.fields) == keys


def test_prompts_kind_ignores_answer_columns(tok):
    ds = dataset(tok, "prompts")
    assert ds.fields[3] == {"prompts": [tok.bos_token_id, *tok.encode(PROMPTS[3])]}


@pytest.mark.parametrize("kind", ["sft", "pairs"])
def test_sequence_layout(tok, kind):
    for sample in dataset(tok, kind).next_batch(10, seed=1):
        row = ROWS_OF[kind][sample.sample_id % 10]
        assert sample.text == row["prompt"]
        assert sample.prompt_len == 1 + len(tok.encode(row["prompt"]))
        for key in SEQ_KEYS[kind]:
            seq = sample.fields[key]
            assert seq[0] == tok.bos_token_id and seq[-1] == tok.eos_token_id
            assert seq[: sample.prompt_len] == sample.ids
            assert tok.decode(seq[sample.prompt_len : -1]) == row[ANSWER_COLUMN[key]]


def test_custom_answer_columns(tok):
    rows = [{"q": r["prompt"], "good": r["chosen"], "bad": r["rejected"]} for r in PAIR_ROWS]
    ds = dataset(tok, "pairs", rows, prompt_key="q", chosen_key="good", rejected_key="bad")
    assert ds.fields == dataset(tok, "pairs").fields


# --- packing ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["sft", "pairs"])
def test_to_packed_sequences_carry_prompt_lens(tok, kind):
    samples = dataset(tok, kind).next_batch(5, seed=2)
    batch = to_packed(samples)
    assert batch.sample_ids == [s.sample_id for s in samples]
    assert sorted(batch.keys()) == sorted([*SEQ_KEYS[kind], "prompt_lens"])
    for key in SEQ_KEYS[kind]:
        assert batch.tensors[key].dtype == torch.long and batch.tensors[key].dim() == 1
        assert batch.seqlens[key] == [len(s.fields[key]) for s in samples]
        for i, s in enumerate(samples):
            assert batch.sample(key, i).tolist() == s.fields[key]
    assert batch.tensors["prompt_lens"].dtype == torch.long
    assert batch.tensors["prompt_lens"].tolist() == [s.prompt_len for s in samples]
    assert batch.seqlens["prompt_lens"] == [1] * 5


def test_to_packed_prompts_has_no_prompt_lens(tok):
    samples = dataset(tok, "prompts").next_batch(3, seed=0)
    batch = to_packed(samples)
    assert batch.keys() == ["prompts"]
    assert batch.seqlens["prompts"] == [len(s.ids) for s in samples]
    assert batch.tensors["prompts"].tolist() == [t for s in samples for t in s.ids]
    responses = {r["prompt"]: r["response"] for r in SFT_ROWS}
    assert batch.extras == {"response": [responses[s.text] for s in samples]}, "other columns"
    assert dataset(tok, "prompts").columns == ["response"]
    assert (
        dataset(tok, "sft").columns == []
        and to_packed(dataset(tok, "sft").all_samples()).extras == {}
    )


# --- kind_for_inputs -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("inputs", "kind"),
    [
        (["prompts"], "prompts"),
        (["seq", "prompt_lens"], "sft"),
        (["prompt_lens", "seq"], "sft"),
        (["chosen", "rejected", "prompt_lens"], "pairs"),
        (["prompt_lens", "rejected", "chosen"], "pairs"),
    ],
)
def test_kind_for_inputs(inputs, kind):
    assert kind_for_inputs(inputs) == kind


@pytest.mark.parametrize(
    "inputs", [[], ["seq"], ["prompts", "prompt_lens"], ["chosen", "prompt_lens"], ["x"]]
)
def test_kind_for_inputs_rejects_other_sets(inputs):
    with pytest.raises(RayhfError) as err:
        kind_for_inputs(inputs)
    assert_one_line_error(
        err,
        f"graph inputs {inputs}",
        "['prompts'] (prompts)",
        "['seq', 'prompt_lens'] (sft)",
        "['chosen', 'rejected', 'prompt_lens'] (pairs)",
    )


# --- user errors -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "column", "field"),
    [
        ("sft", "response", "dataset.response_key"),
        ("pairs", "chosen", "dataset.chosen_key"),
        ("pairs", "rejected", "dataset.rejected_key"),
    ],
)
def test_missing_answer_column(tok, kind, column, field):
    rows = [{k: v for k, v in r.items() if k != column} for r in ROWS_OF[kind]]
    with pytest.raises(RayhfError) as err:
        dataset(tok, kind, rows)
    assert_one_line_error(err, "rows.jsonl", field, repr(column))


@pytest.mark.parametrize(("kind", "column"), [("sft", "response"), ("pairs", "rejected")])
def test_non_text_answer(tok, kind, column):
    rows = [dict(r) for r in ROWS_OF[kind]]
    rows[2][column] = 7
    with pytest.raises(RayhfError) as err:
        dataset(tok, kind, rows)
    assert_one_line_error(err, "rows.jsonl", "row 2", "int", f"dataset.{column}_key")


def test_sequence_over_max_seq_len(tok):
    rows = [*SFT_ROWS[:3], {"prompt": "1 2 =", "response": "1 2 1 2 1"}]  # 1 + 5 + 9 + 1 = 16
    with pytest.raises(RayhfError) as err:
        dataset(tok, "sft", rows, max_seq_len=15)
    assert_one_line_error(err, "rows.jsonl", "row 3", "16 tokens", "dataset.max_seq_len=15")
    assert len(dataset(tok, "sft", rows, max_seq_len=16)) == 4


def test_rejected_over_max_seq_len_names_the_key(tok):
    rows = [{"prompt": "1 =", "chosen": "1", "rejected": "2 2 2"}]  # rejected: 1 + 3 + 5 + 1
    with pytest.raises(RayhfError) as err:
        dataset(tok, "pairs", rows, max_seq_len=9)
    assert_one_line_error(err, "row 0", "rejected is 10 tokens", "dataset.max_seq_len=9")


def test_prompt_over_max_prompt_len_in_sft(tok):
    with pytest.raises(RayhfError) as err:
        dataset(tok, "sft", max_prompt_len=5)  # bos + "0 0 =" = 6 tokens
    assert_one_line_error(err, "rows.jsonl", "row 0", "6 tokens", "dataset.max_prompt_len=5")


def test_tokenizer_without_eos_is_a_user_error():
    fake = SimpleNamespace(bos_token_id=1, eos_token_id=None, encode=lambda s, **_: [5] * len(s))
    with pytest.raises(RayhfError) as err:
        PromptDataset(SFT_ROWS, fake, DatasetConfig(path="rows.jsonl"), "sft")
    assert_one_line_error(err, "eos", "sft")
    assert len(PromptDataset(SFT_ROWS, fake, DatasetConfig(path="rows.jsonl"))) == 10


def test_config_limits_are_validated():
    with pytest.raises(ValidationError):
        DatasetConfig(path="p.jsonl", max_seq_len=0)
    assert DatasetConfig(path="p.jsonl").max_seq_len == 128


# --- evaluation rows -------------------------------------------------------------------------


def test_all_samples_is_file_order_and_keeps_the_cursor(tok):
    ds = dataset(tok, "pairs")
    ds.next_batch(3, seed=5)
    state = ds.state_dict()
    samples = ds.all_samples()
    assert [s.sample_id for s in samples] == list(range(10))
    assert [s.text for s in samples] == PROMPTS
    assert [s.fields for s in samples] == ds.fields
    assert ds.state_dict() == state


def test_eval_path_loads_with_the_same_settings(tmp_path, tok):
    rename = [{"q": r["prompt"], "a": r["response"]} for r in SFT_ROWS]
    train = write_rows(rename, tmp_path / "train.jsonl")
    held_out = write_rows(rename[:4], tmp_path / "eval.parquet")
    cfg = DatasetConfig(path=str(train), eval_path=str(held_out), prompt_key="q", response_key="a")
    ds = PromptDataset.from_config(cfg, tok, "sft", path=cfg.eval_path)
    assert len(ds) == 4 and ds.kind == "sft"
    assert [s.fields for s in ds.all_samples()] == dataset(tok, "sft").fields[:4]
    assert len(PromptDataset.from_config(cfg, tok, "sft")) == 10


def test_eval_path_errors_name_the_eval_file(tmp_path, tok):
    train = write_rows(SFT_ROWS, tmp_path / "train.jsonl")
    cfg = DatasetConfig(path=str(train), eval_path=str(tmp_path / "missing.jsonl"))
    with pytest.raises(RayhfError) as err:
        PromptDataset.from_config(cfg, tok, "sft", path=cfg.eval_path)
    assert_one_line_error(err, "missing.jsonl", "dataset.eval_path")
    bad = write_rows([{"prompt": "1 ="}], tmp_path / "bad.jsonl")
    with pytest.raises(RayhfError) as err:
        PromptDataset.from_config(cfg, tok, "sft", path=bad)
    assert_one_line_error(err, "bad.jsonl", "dataset.response_key")


# --- resume ----------------------------------------------------------------------------------


def draw(ds: PromptDataset, n_batches: int, batch_size: int = 4, seed: int = 7) -> list:
    return [ds.next_batch(batch_size, seed) for _ in range(n_batches)]


@pytest.mark.parametrize("cut", [1, 3])
def test_pairs_resume_draws_the_uninterrupted_sequence(tok, cut):
    uninterrupted = draw(dataset(tok, "pairs"), 6)
    first = dataset(tok, "pairs")
    head = draw(first, cut)
    resumed = dataset(tok, "pairs")
    resumed.load_state_dict(first.state_dict())
    assert head + draw(resumed, 6 - cut) == uninterrupted
    flat = [s for batch in uninterrupted for s in batch]
    assert [s.sample_id % 10 for s in flat[:10]] != list(range(10))  # shuffled
    assert all(s.fields == dataset(tok, "pairs").fields[s.sample_id % 10] for s in flat)


# --- demo datasets ---------------------------------------------------------------------------


def test_demo_sft_rows_echo_the_prompt():
    rows = demo_task.make_sft_rows(300, seed=3)
    assert rows == demo_task.make_sft_rows(300, seed=3)
    assert [r["prompt"] for r in rows] == [r["prompt"] for r in demo_task.make_prompts(300, 3)]
    assert len(rows) == 300 and all(r["response"] == r["prompt"].removesuffix(" =") for r in rows)
    assert (
        demo_task.reward([r["prompt"] for r in rows], [r["response"] for r in rows]) == [1.0] * 300
    )


def test_demo_preference_rows_rank_by_the_digit_share():
    rows = demo_task.make_preference_rows(512, seed=0)
    assert rows == demo_task.make_preference_rows(512, seed=0)
    assert rows != demo_task.make_preference_rows(512, seed=1)
    prompts = [r["prompt"] for r in rows]
    chosen = demo_task.digit_share_reward(prompts, [r["chosen"] for r in rows])
    rejected = demo_task.digit_share_reward(prompts, [r["rejected"] for r in rows])
    assert all(c - r >= demo_task.MIN_SCORE_GAP for c, r in zip(chosen, rejected, strict=True))
    tokens = {t for r in rows for side in ("chosen", "rejected") for t in r[side].split()}
    assert tokens <= set("0123456789abcdefghij") and tokens & set("abcdefghij")
    assert any(r["chosen"] == demo_task.echo(r["prompt"]) for r in rows)
    assert len({len(r["rejected"]) for r in rows}) > 4  # short and long answers, not one shape
    assert min(rejected) == 0.0 and max(rejected) > 0.5  # from all-wrong to mostly right


def test_policy_preference_rows_pair_the_policy_s_best_and_worst_answers(tmp_path, tok):
    policy = tmp_path / "policy"
    config = hf_config(ModelInit(), len(tok), tok.pad_token_id, tok.bos_token_id, tok.eos_token_id)
    build_model(config, value_head=False).save_pretrained(policy)
    tok.save_pretrained(policy)
    rows = demo_task.make_policy_preference_rows(64, seed=0, policy=policy, samples=3)
    assert rows == demo_task.make_policy_preference_rows(64, seed=0, policy=policy, samples=3)
    fallback = demo_task.make_preference_rows(64, seed=0)
    assert [r["prompt"] for r in rows] == [r["prompt"] for r in fallback]
    sampled = [r for r, f in zip(rows, fallback, strict=True) if r != f]
    assert len(sampled) > 16, "a random policy's answers often differ by the gap"
    score = demo_task.digit_share
    for r in rows:
        assert score(r["prompt"], r["chosen"]) - score(r["prompt"], r["rejected"]) >= 0.25
    # what a random policy writes (letters, '=', runs of any length), not the templates' shapes
    assert any("=" in r["chosen"] + r["rejected"] for r in sampled)


@pytest.mark.parametrize(
    ("make", "kind"),
    [(demo_task.make_sft_dataset, "sft"), (demo_task.make_preference_dataset, "pairs")],
)
def test_demo_datasets_load_with_defaults_and_no_unknown_tokens(tmp_path, tok, make, kind):
    path = make(tmp_path / f"{kind}.parquet", n=128, seed=0)
    ds = PromptDataset.from_config(DatasetConfig(path=str(path)), tok, kind)
    assert len(ds) == 128
    tokens = {t for fields in ds.fields for ids in fields.values() for t in ids}
    assert tok.unk_token_id not in tokens
    assert tokens >= {tok.bos_token_id, tok.eos_token_id}
