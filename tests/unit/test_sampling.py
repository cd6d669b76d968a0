"""The native engine against Hugging Face ``generate`` and a full forward, on tiny random models.

Each prompt of a batch is compared with the same prompt run alone and unpadded, so left padding,
position ids and the cache are all exercised. A large ``initializer_range`` makes greedy
trajectories vary from token to token instead of repeating one token.
"""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from rayhf.errors import RayhfError
from rayhf.sampling import (
    DecodeRules,
    GenerateOutput,
    GenerationConfig,
    choose,
    generate,
    uniforms,
)

VOCAB = 32
PAD = 0
EOS = 1
PROMPTS = [[3, 4, 5], [6, 7, 8, 9, 10, 11, 12], [13], [20, 21, 22, 23, 24]]
IDS = {"pad_token_id": PAD, "bos_token_id": 2, "eos_token_id": EOS}


def _tiny_model(arch: str) -> PreTrainedModel:
    torch.manual_seed(0)
    shape = {
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 128,
        "initializer_range": 0.5,
    }
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**shape, **IDS))
    elif arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**shape, **IDS))
    else:
        cfg = GPT2Config(
            vocab_size=VOCAB,
            n_embd=32,
            n_layer=2,
            n_head=4,
            n_positions=128,
            initializer_range=0.5,
            tie_word_embeddings=False,
            **IDS,
        )
        model = GPT2LMHeadModel(cfg)
    return model.eval()  # GPT-2 has dropout; HF generate does not switch to eval itself


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny models gain nothing from threads; on a shared 2-core box spinning ones cost 5x."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module", params=["llama", "qwen2", "gpt2"])
def model(request: pytest.FixtureRequest) -> PreTrainedModel:
    return _tiny_model(request.param)


def _hf_greedy(model: PreTrainedModel, prompt: list[int], cfg: GenerationConfig, eos: int):
    """Hugging Face greedy decoding of one prompt alone, without padding."""
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=cfg.max_new_tokens,
        min_new_tokens=cfg.min_new_tokens,
        eos_token_id=eos,
        pad_token_id=PAD,
    )
    return out[0, len(prompt) :].tolist()


def _full_forward_logprobs(
    model: PreTrainedModel, prompt: list[int], response: list[int], temperature: float
) -> list[float]:
    """Log-probs of ``response`` from one uncached forward over prompt + response, alone."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0].float()
    scaled = logits[len(prompt) - 1 : -1] / temperature
    return scaled.log_softmax(-1).gather(-1, torch.tensor(response)[:, None]).squeeze(-1).tolist()


def _run(model: PreTrainedModel, cfg: GenerationConfig, eos: int = EOS, seed: int = 0):
    return generate(model, PROMPTS, cfg, eos, PAD, seed=seed)


def test_greedy_matches_hf_generate(model: PreTrainedModel) -> None:
    cfg = GenerationConfig(greedy=True, max_new_tokens=12)
    free = _run(model, cfg, eos=VOCAB + 5)
    eos = min(set(range(VOCAB)) - {t for row in free.tokens for t in row})  # never produced
    out = _run(model, cfg, eos=eos)
    assert out == free and not any(out.finished)
    for prompt, tokens in zip(PROMPTS, out.tokens, strict=True):
        assert tokens == _hf_greedy(model, prompt, cfg, eos)
    assert len({tuple(t) for t in out.tokens}) == len(PROMPTS)  # rows really differ


def test_eos_ends_row_and_drops_later_tokens(model: PreTrainedModel) -> None:
    free = _run(model, GenerationConfig(greedy=True, max_new_tokens=12), eos=VOCAB + 5)
    # The first token that is new in some row's trajectory becomes EOS; that row must stop there.
    row, k = next(
        (r, k)
        for r, toks in enumerate(free.tokens)
        for k in range(1, len(toks))
        if toks[k] not in toks[:k]
    )
    eos = free.tokens[row][k]
    cfg = GenerationConfig(greedy=True, max_new_tokens=12)
    out = _run(model, cfg, eos=eos)
    assert out.tokens[row] == free.tokens[row][: k + 1]
    assert out.finished[row] and len(out.logprobs[row]) == k + 1
    for prompt, tokens, done in zip(PROMPTS, out.tokens, out.finished, strict=True):
        assert tokens == _hf_greedy(model, prompt, cfg, eos)
        assert done == (eos in tokens)
        assert eos not in tokens[:-1]


def test_eos_equal_to_pad_id(model: PreTrainedModel) -> None:
    free = _run(model, GenerationConfig(greedy=True, max_new_tokens=12), eos=VOCAB + 5)
    eos = free.tokens[0][2]
    cfg = GenerationConfig(greedy=True, max_new_tokens=12)
    out = generate(model, PROMPTS, cfg, eos_token_id=eos, pad_token_id=eos)
    for prompt, tokens in zip(PROMPTS, out.tokens, strict=True):
        assert tokens == _hf_greedy(model, prompt, cfg, eos)
    assert out.finished[0]


@pytest.mark.parametrize(
    "cfg",
    [
        GenerationConfig(greedy=True, temperature=0.5, max_new_tokens=10),
        GenerationConfig(temperature=0.7, top_k=5, top_p=0.8, max_new_tokens=10),
        GenerationConfig(temperature=1.3, min_new_tokens=10, max_new_tokens=10),
    ],
    ids=["greedy", "filtered", "min_len"],
)
def test_logprobs_match_full_forward(model: PreTrainedModel, cfg: GenerationConfig) -> None:
    out = _run(model, cfg, eos=4)
    temperature = 1.0 if cfg.greedy else cfg.temperature
    for prompt, tokens, logprobs in zip(PROMPTS, out.tokens, out.logprobs, strict=True):
        expected = _full_forward_logprobs(model, prompt, tokens, temperature)
        assert torch.allclose(torch.tensor(logprobs), torch.tensor(expected), atol=1e-5)


def test_top_k_one_sampling_equals_greedy(model: PreTrainedModel) -> None:
    greedy = _run(model, GenerationConfig(greedy=True, max_new_tokens=10))
    sampled = _run(model, GenerationConfig(top_k=1, max_new_tokens=10), seed=7)
    assert sampled.tokens == greedy.tokens
    assert sampled.logprobs == greedy.logprobs  # both at temperature 1


def test_tiny_top_p_equals_greedy(model: PreTrainedModel) -> None:
    greedy = _run(model, GenerationConfig(greedy=True, max_new_tokens=10))
    sampled = _run(model, GenerationConfig(temperature=2.0, top_p=1e-6, max_new_tokens=10), seed=3)
    assert sampled.tokens == greedy.tokens


def test_seed_fixes_samples(model: PreTrainedModel) -> None:
    # Temperature 5 flattens 32 tokens to near-uniform: two seeds agreeing on 4 x 16 tokens is
    # practically impossible.
    cfg = GenerationConfig(temperature=5.0, min_new_tokens=16, max_new_tokens=16)
    first = _run(model, cfg, seed=1)
    assert _run(model, cfg, seed=1) == first
    assert _run(model, cfg, seed=2).tokens != first.tokens


def test_min_new_tokens_prevents_early_eos(model: PreTrainedModel) -> None:
    free = _run(model, GenerationConfig(greedy=True, max_new_tokens=12), eos=VOCAB + 5)
    eos = free.tokens[0][0]  # without a minimum, row 0 would stop after one token
    early = _run(model, GenerationConfig(greedy=True, max_new_tokens=12), eos=eos)
    assert early.tokens[0] == [eos] and early.finished[0]
    cfg = GenerationConfig(greedy=True, min_new_tokens=5, max_new_tokens=12)
    out = _run(model, cfg, eos=eos)
    for prompt, tokens in zip(PROMPTS, out.tokens, strict=True):
        assert len(tokens) >= 5 and eos not in tokens[:5]
        assert tokens == _hf_greedy(model, prompt, cfg, eos)


def test_finished_rows_get_pad_and_all_finished_stops_early() -> None:
    model = _tiny_model("llama")
    fed: list[list[int]] = []  # input ids of every forward, flattened per call
    hook = model.register_forward_pre_hook(
        lambda _m, _args, kwargs: fed.append(kwargs["input_ids"][:, -1].tolist()),
        with_kwargs=True,
    )
    try:
        cfg = GenerationConfig(greedy=True, max_new_tokens=12)
        free = _run(model, cfg, eos=VOCAB + 5)
        eos = free.tokens[0][0]
        fed.clear()
        out = generate(model, PROMPTS, cfg, eos, PAD)
        assert out.tokens[0] == [eos] and not all(out.finished)
        assert len(fed) == max(len(t) for t in out.tokens)  # prefill + one per further token
        assert fed[2:] and all(step[0] == PAD for step in fed[2:])  # pad after row 0's EOS
        fed.clear()
        generate(model, [PROMPTS[0]], cfg, eos, PAD)
        assert len(fed) == 1  # the only row ended at its first token: no decode step
    finally:
        hook.remove()


def test_restores_training_mode_and_disables_dropout() -> None:
    model = _tiny_model("gpt2")  # dropout 0.1: sampling in train mode would change outputs
    cfg = GenerationConfig(greedy=True, max_new_tokens=12)
    expected = _run(model, cfg)
    model.train()
    assert _run(model, cfg) == expected
    assert model.training and all(m.training for m in model.modules())
    model.eval()
    _run(model, cfg)
    assert not model.training


def _candidates(logits: torch.Tensor, top_k: int, top_p: float) -> list[bool]:
    """Which tokens ``choose`` ever draws from ``logits [1, V]`` over a fine grid of uniforms."""
    rules = DecodeRules(False, 1.0, top_k, top_p, 0, 8, eos=99, pad=0)
    u = (torch.arange(4096) + 0.5) / 4096
    tokens, _ = choose(
        logits.expand(len(u), -1).clone(), rules, u, torch.zeros(len(u), dtype=torch.long)
    )
    return [t in set(tokens.tolist()) for t in range(logits.shape[-1])]


def test_top_k_and_top_p_keep_the_tokens_they_name() -> None:
    logits = torch.tensor([[0.05, 0.5, 0.15, 0.3]]).log()
    assert _candidates(logits, 2, 1.0) == [False, True, False, True]
    assert _candidates(logits, 0, 0.7) == [False, True, False, True]
    assert _candidates(logits, 0, 0.85) == [False, True, True, True]
    assert _candidates(logits, 0, 1e-9) == [False, True, False, False]
    assert _candidates(logits, 3, 0.99) == [False, True, True, True]
    assert _candidates(logits, 0, 1.0) == [True, True, True, True]


def test_a_token_of_probability_zero_is_never_drawn() -> None:
    logits = torch.tensor([[float("-inf"), 0.0, float("-inf"), 0.0, float("-inf")]])
    assert _candidates(logits, 0, 1.0) == [False, True, False, True, False]


def test_uniforms_depend_on_seed_response_and_token_only() -> None:
    ids = torch.tensor([0, 1, 2, 7])
    table = uniforms(5, ids, 6)
    assert table.shape == (4, 6) and bool((table > 0).all() and (table < 1).all())
    assert torch.equal(uniforms(5, ids[2:], 6), table[2:])  # whatever else is in the call
    assert torch.equal(uniforms(5, ids, 3), table[:, :3])
    assert not torch.equal(uniforms(6, ids, 6), table)
    assert len(set(table.flatten().tolist())) == table.numel()


def test_uniforms_are_uniform() -> None:
    """Kolmogorov-Smirnov over 64k draws of consecutive responses and tokens (a counter hash
    that correlates neighbours fails here first)."""
    from scipy import stats

    draws = uniforms(2024, torch.arange(256), 256).flatten().double().numpy()
    assert stats.kstest(draws, "uniform").pvalue > 1e-3
    pairs = uniforms(2024, torch.arange(256), 256)
    lag = torch.corrcoef(torch.stack([pairs[:, :-1].flatten(), pairs[:, 1:].flatten()]))[0, 1]
    assert abs(float(lag)) < 0.02


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"),
    [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 4, 1.0), (1.0, 0, 0.8), (0.9, 5, 0.9)],
)
def test_drawn_tokens_follow_the_filtered_softmax(temperature, top_k, top_p) -> None:
    """Chi-square of 100k draws (one row per response, as in a call) against the softmax at the
    temperature, renormalized over what top-k/top-p keep."""
    from scipy import stats

    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, -3.0])
    rules = DecodeRules(False, temperature, top_k, top_p, 0, 8, eos=99, pad=0)
    n = 100_000
    u = uniforms(11, torch.arange(n), 1)[:, 0]
    tokens, logprobs = choose(
        logits.expand(n, -1).clone(), rules, u, torch.zeros(n, dtype=torch.long)
    )
    probs = (logits / temperature).softmax(-1)
    torch.testing.assert_close(logprobs, probs.log()[tokens])  # before filtering
    keep = torch.tensor(_candidates(logits[None], top_k, top_p))
    want = torch.where(keep, probs, 0.0).double()
    counts = torch.bincount(tokens, minlength=len(logits))
    assert int(counts[~keep].sum()) == 0
    expected = (want[keep] / want.sum() * n).numpy()
    assert stats.chisquare(counts[keep].double().numpy(), expected).pvalue > 1e-3


def test_config_rejects_bad_values() -> None:
    for bad in [
        {"temperature": 0.0},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"top_k": -1},
        {"max_new_tokens": 0},
        {"min_new_tokens": 5, "max_new_tokens": 4},
        {"do_sample": True},
    ]:
        with pytest.raises(ValidationError):
            GenerationConfig(**bad)


def test_empty_inputs() -> None:
    model = _tiny_model("llama")
    assert generate(model, [], GenerationConfig(), EOS, PAD) == GenerateOutput()
    with pytest.raises(RayhfError, match="at least one token"):
        generate(model, [[3], []], GenerationConfig(), EOS, PAD)


def test_a_wide_vocabulary_is_scanned_in_blocks_with_the_same_draws() -> None:
    """1,000 tokens (blocks of 25): the blocked scan picks what one cumulative scan over the
    whole row picks, never a token of weight 0, and the draws follow the softmax."""
    from scipy import stats

    from rayhf.sampling import _block_size, _first_reaching

    assert _block_size(1000) == 25 and _block_size(37) == 1 and _block_size(151936) == 128
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1000, generator=g) * 3
    logits[torch.randperm(1000, generator=g)[:300]] = float("-inf")
    n = 100_000
    u = uniforms(3, torch.arange(n), 1)[:, 0]
    weights = (logits - logits.max()).exp().expand(n, -1)
    blocked = _first_reaching(weights, u)
    total = weights[0].cumsum(-1)
    whole = (total[None, :] < (u * total[-1])[:, None]).sum(-1)
    assert (blocked == whole).double().mean() > 0.999  # rounding may move a boundary draw
    assert bool(torch.isfinite(logits[blocked]).all())
    counts = torch.bincount(blocked, minlength=1000).double()
    probs = logits.double().softmax(-1)
    common = probs * n >= 20  # chi-square wants expected counts that are not tiny
    expected = torch.cat([probs[common] * n, (probs[~common] * n).sum()[None]])
    observed = torch.cat([counts[common], counts[~common].sum()[None]])
    assert stats.chisquare(observed.numpy(), expected.numpy()).pvalue > 1e-3
