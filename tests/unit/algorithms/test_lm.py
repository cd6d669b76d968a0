"""The shared LM pieces: token log-probs (by hand and against a slow loop), response forwards,
sampling and log-prob batches on a fake engine whose logits are easy to score by hand."""

import math

import pytest
import torch
from algo_support import ScoresFromForward
from pydantic import ValidationError

from rayhf.algorithms.interface import CallContext, InterfaceSettings
from rayhf.algorithms.lm import (
    entropy_from_logits,
    generation_config,
    logprob_batch,
    response_forward,
    rollout_stats,
    sample_batch,
    token_logprobs,
)
from rayhf.config.registry import make_interface
from rayhf.data.batch import PackedBatch
from rayhf.sampling import GenerateOutput, GenerationConfig

VOCAB = 12


def _close(a: torch.Tensor, b, tol: float = 1e-9) -> None:
    torch.testing.assert_close(a, torch.as_tensor(b, dtype=a.dtype), rtol=tol, atol=tol)


class BigramEngine(ScoresFromForward):
    """A ``CallEngine`` whose output at a position depends on that position's token only:
    logits ``table[token]`` (``[V, V]``), or a value ``table[token]`` (``[V]``)."""

    pad_id, eos_id = 0, 1

    def __init__(
        self, table: torch.Tensor, tokens: list[list[int]] | None = None, budget: int | None = None
    ) -> None:
        self.table, self.tokens, self.budget = table, tokens or [], budget
        self.calls: list[tuple] = []

    def micro_batches(self, batch: PackedBatch) -> list[PackedBatch]:
        return [batch] if self.budget is None else batch.token_chunks(self.budget)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        self.calls.append(("forward", input_ids.shape[0]))
        out = self.table[input_ids]
        keep = attention_mask.bool()
        return out * (keep if out.dim() == 2 else keep[..., None])

    def generate(self, prompts, cfg, seed) -> GenerateOutput:
        self.calls.append(("generate", prompts, cfg, seed))
        tokens = self.tokens[: len(prompts)]
        logprobs = [[-0.5 * (j + 1) for j in range(len(t))] for t in tokens]
        return GenerateOutput(tokens, logprobs, [t[-1:] == [self.eos_id] for t in tokens])

    def all_reduce_mean(self, values: dict[str, float]) -> dict[str, float]:
        self.calls.append(("all_reduce_mean", dict(values)))
        return dict(values)


def _table(seed: int = 0) -> torch.Tensor:
    return torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(seed))


def _batch(seqs: list[list[int]], prompt_lens: list[int], ids: list[int] | None = None):
    b = PackedBatch(ids or list(range(len(seqs))))
    b.add("seq", torch.tensor([t for s in seqs for t in s]), [len(s) for s in seqs])
    b.add("prompt_lens", torch.tensor(prompt_lens), [1] * len(seqs))
    return b


def _bigram_logprob(table: torch.Tensor, prev: int, tok: int, temperature: float = 1.0) -> float:
    zs = [v / temperature for v in table[prev].tolist()]
    return zs[tok] - math.log(sum(math.exp(z) for z in zs))


SEQS, PROMPT_LENS = [[5, 6, 7, 8], [9, 10], [11, 4, 3]], [2, 1, 3]  # the last has no response


# ----- token log-probs ----------------------------------------------------------------------


def test_token_logprobs_by_hand() -> None:
    # logits [0, 0, ln 2] -> probs [1/4, 1/4, 1/2]
    logits = torch.tensor([[[0.0, 0.0, math.log(2.0)], [0.0, 0.0, math.log(2.0)]]])
    labels = torch.tensor([[2, 0]])
    _close(token_logprobs(logits, labels), [[math.log(0.5), math.log(0.25)]], 1e-6)
    # temperature 2 -> logits [0, 0, ln sqrt 2] -> p(2) = sqrt 2 / (2 + sqrt 2)
    r2 = math.sqrt(2.0)
    got = token_logprobs(logits, labels, temperature=2.0)
    _close(got, [[math.log(r2 / (2 + r2)), math.log(1 / (2 + r2))]], 1e-6)


def test_token_logprobs_matches_reference() -> None:
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 4, 6, generator=g) * 4
    labels = torch.randint(0, 6, (3, 4), generator=g)
    temp = 0.7
    got = token_logprobs(logits.to(torch.bfloat16).float(), labels, temperature=temp)
    ref = []
    for b in range(3):
        row = []
        for t in range(4):
            zs = [v / temp for v in logits[b, t].to(torch.bfloat16).float().tolist()]
            row.append(zs[labels[b, t]] - math.log(sum(math.exp(z) for z in zs)))
        ref.append(row)
    _close(got, ref, 1e-5)
    assert got.dtype == torch.float32
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(logits, labels, temperature=0.0)


# ----- response forward and log-prob inference ----------------------------------------------


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_response_forward_scores_each_response_token_by_the_position_before_it(temperature):
    table = _table()
    logp, entropy, mask = response_forward(
        BigramEngine(table), _batch(SEQS, PROMPT_LENS), temperature
    )
    assert mask.tolist() == [[True, True], [True, False], [False, False]]
    expected = [
        _bigram_logprob(table, 6, 7, temperature),
        _bigram_logprob(table, 7, 8, temperature),
    ]
    _close(logp[0], expected, 1e-5)
    _close(logp[1, :1], [_bigram_logprob(table, 9, 10, temperature)], 1e-5)
    # the entropy of the sampling distribution, softmax(logits / temperature), at each position
    _close(entropy[0], entropy_from_logits(table[[6, 7]] / temperature), 1e-5)
    _close(entropy[1, 0], entropy_from_logits(table[9] / temperature), 1e-5)
    assert entropy[~mask].eq(0).all() and logp[~mask].eq(0).all()


def test_response_forward_of_a_value_head_gives_values_and_no_entropy():
    values = torch.arange(VOCAB, dtype=torch.float32) / 10
    out, entropy, mask = response_forward(BigramEngine(values), _batch(SEQS, PROMPT_LENS))
    assert entropy is None
    _close(out[mask], [0.6, 0.7, 0.9])  # the value of the state before tokens 7, 8 and 10


def test_logprob_batch_packs_one_row_per_response_token():
    table = _table(1)
    whole = logprob_batch(BigramEngine(table), _batch(SEQS, PROMPT_LENS, [4, 8, 9]), 0.7, "lp")
    engine = BigramEngine(table, budget=max(len(s) for s in SEQS))  # a forward per sequence
    out = logprob_batch(engine, _batch(SEQS, PROMPT_LENS, [4, 8, 9]), 0.7, "lp")
    assert [c for c in engine.calls if c[0] == "forward"] == [("forward", 1)] * 3
    assert torch.equal(out.tensors["lp"], whole.tensors["lp"]) and out.seqlens == whole.seqlens
    assert out.sample_ids == [4, 8, 9] and out.keys() == ["lp"]
    assert out.seqlens["lp"] == [2, 1, 0]
    expected = [_bigram_logprob(table, a, b, 0.7) for a, b in ((6, 7), (7, 8), (9, 10))]
    _close(out.tensors["lp"], expected, 1e-5)
    assert not out.tensors["lp"].requires_grad


# ----- sampling -----------------------------------------------------------------------------


def _prompts() -> PackedBatch:
    b = PackedBatch([10, 11])
    b.add("prompts", torch.tensor([5, 6, 7]), [2, 1])
    return b


def test_sample_batch_appends_responses_to_prompts():
    engine = BigramEngine(_table(), tokens=[[8, 1], [9]])
    cfg = GenerationConfig(max_new_tokens=2)
    out = sample_batch(engine, _prompts(), cfg, CallContext(step=3, dp_rank=1, dp_size=2, seed=7))
    (_, prompts, got_cfg, seed) = engine.calls[0]
    assert prompts == [[5, 6], [7]] and got_cfg is cfg
    assert seed == 7 * 100_003 + 3 * 101 + 1  # differs per run seed, step and dp rank
    assert out.sample_ids == [10, 11]
    assert [out.sample("seq", i).tolist() for i in range(2)] == [[5, 6, 8, 1], [7, 9]]
    assert out.tensors["prompt_lens"].tolist() == [2, 1]
    assert out.seqlens["logprobs"] == [2, 1]
    _close(out.tensors["logprobs"], [-0.5, -1.0, -0.5])
    assert "group_ids" not in out.tensors


def test_sample_batch_with_several_samples_numbers_them_by_prompt():
    engine = BigramEngine(_table(), tokens=[[8], [1], [3, 4], [2]])
    prompts = _prompts()
    prompts.add_extra("answer", ["7", "9"])
    out = sample_batch(engine, prompts, GenerationConfig(), CallContext(0, 0, 1, 0), 2)
    assert engine.calls[0][1] == [[5, 6], [5, 6], [7], [7]]
    assert out.sample_ids == [20, 21, 22, 23]
    assert out.tensors["group_ids"].tolist() == [10, 10, 11, 11]
    assert out.extras == {"answer": ["7", "7", "9", "9"]}, "each answer keeps its prompt's row"
    assert out.sample("seq", 2).tolist() == [7, 3, 4]
    assert out.tensors["prompt_lens"].tolist() == [2, 2, 1, 1]


def test_generation_config_applies_a_call_s_overrides():
    base = GenerationConfig(max_new_tokens=8, temperature=0.7)
    assert generation_config(base, {}) == base
    got = generation_config(base, {"generation": {"greedy": True}, "other": 1})
    assert (got.greedy, got.max_new_tokens, got.temperature) == (True, 8, 0.7)
    assert not base.greedy  # the experiment's settings are not changed
    with pytest.raises(ValidationError):
        generation_config(base, {"generation": {"min_new_tokens": 9}})


def test_rollout_stats_reduce_reward_and_response_length_over_ranks():
    batch = _batch(SEQS, PROMPT_LENS)
    batch.add("scores", torch.tensor([1.0, 0.0, 0.5]), [1, 1, 1])
    engine = BigramEngine(_table())
    stats = rollout_stats(engine, batch)
    assert stats == pytest.approx({"task_reward": 0.5, "response_len": 1.0})
    assert engine.calls == [("all_reduce_mean", stats)]  # one all-reduce for both


# ----- the lm interface ---------------------------------------------------------------------


@pytest.mark.parametrize(("greedy", "temperature"), [(False, 0.5), (True, 1.0)])
def test_lm_interface_scores_at_its_sampling_temperature(greedy, temperature):
    gen = GenerationConfig(greedy=greedy, temperature=0.5)
    iface = make_interface("lm", InterfaceSettings(None, gen))
    assert iface.temperature == temperature  # greedy tokens are scored unscaled
    table = _table(2)
    out = iface.inference(BigramEngine(table), _batch(SEQS, PROMPT_LENS), CallContext(0, 0, 1, 0))
    _close(out.tensors["logprobs"][:1], [_bigram_logprob(table, 6, 7, temperature)], 1e-5)


def test_lm_interface_generate_uses_the_call_args():
    engine = BigramEngine(_table(), tokens=[[8], [9]])
    iface = make_interface("lm", InterfaceSettings(None, GenerationConfig(max_new_tokens=3)))
    ctx = CallContext(0, 0, 1, 0, {"generation": {"greedy": True}})
    out = iface.generate(engine, _prompts(), ctx)
    cfg = engine.calls[0][2]
    assert cfg.greedy and cfg.max_new_tokens == 3
    assert out.sample("seq", 1).tolist() == [7, 9]
