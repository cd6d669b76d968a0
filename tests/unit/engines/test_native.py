"""The native generator on a rank's own model: the same tokens as Hugging Face, seeded sampling,
new weights seen without any hand-over, and with ``fp32_lm_head`` at bf16 log-probs of an fp32
head (eager and compiled)."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounter

from rayhf.checks.common import EOS, PAD, Tok, tiny_model
from rayhf.engines.config import NativeEngineConfig
from rayhf.engines.native import NativeGenerator
from rayhf.engines.rank_model import RankModel
from rayhf.models.precision import Numerics
from rayhf.parallel.decode import DecodeEngine, DecodeOptions
from rayhf.sampling import DecodeRules, GenerationConfig, generate

PROMPTS = [[3, 4, 5], [6, 7, 8, 9, 10], [11]]
SHAPE = {"n_heads": 4, "n_kv_heads": 2}


def _hf(seed: int):
    hf = tiny_model("llama", SHAPE, seed=seed)
    with torch.no_grad():  # large weights, so greedy paths vary from token to token
        for p in hf.parameters():
            if p.dim() > 1:
                p.mul_(8.0)
    return hf


@pytest.fixture(scope="module")
def hf():
    return _hf(0)


def test_greedy_is_hugging_face_greedy(hf):
    gen = NativeGenerator(RankModel.from_hf(hf, Tok(), False))
    assert gen.name == "native"
    cfg = GenerationConfig(max_new_tokens=6, greedy=True)
    out = gen.generate(PROMPTS, cfg, seed=0)
    for prompt, tokens in zip(PROMPTS, out.tokens, strict=True):
        ids = torch.tensor([prompt])
        ref = hf.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=6,
            eos_token_id=EOS, pad_token_id=PAD,
        )  # fmt: skip
        assert tokens == ref[0, len(prompt) :].tolist()
    assert len({tuple(t) for t in out.tokens}) == len(PROMPTS)


def test_sampling_follows_the_seed_as_the_shared_decode_loop_does(hf):
    gen = NativeGenerator(RankModel.from_hf(hf, Tok(), False))
    cfg = GenerationConfig(max_new_tokens=8, temperature=1.5)
    out = gen.generate(PROMPTS, cfg, seed=3)
    assert out.tokens == gen.generate(PROMPTS, cfg, seed=3).tokens
    assert out.tokens != gen.generate(PROMPTS, cfg, seed=4).tokens
    ref = generate(hf, PROMPTS, cfg, EOS, PAD, seed=3)
    assert out.tokens == ref.tokens
    for got, expected in zip(out.logprobs, ref.logprobs, strict=True):
        assert got == pytest.approx(expected, abs=1e-4)


def test_new_weights_are_used_at_once(hf):
    model = RankModel.from_hf(hf, Tok(), False)
    gen = NativeGenerator(model)
    cfg = GenerationConfig(max_new_tokens=6, greedy=True)
    other = _hf(1)
    model.load_full_state(other.state_dict())
    expected = generate(other, PROMPTS, cfg, EOS, PAD)
    assert gen.generate(PROMPTS, cfg, seed=0).tokens == expected.tokens
    assert expected.tokens != generate(hf, PROMPTS, cfg, EOS, PAD).tokens


def test_a_call_s_engine_settings_reach_its_decode_engine(hf):
    model = RankModel.from_hf(hf, Tok(), False)
    cfg = GenerationConfig(max_new_tokens=8, temperature=1.5)
    prompts = [*PROMPTS, [12, 13], [3, 4, 5]]
    free = NativeGenerator(model).generate(prompts, cfg, seed=2)
    settings = NativeEngineConfig(max_rows=2, release_memory=True)
    gen = NativeGenerator(model, settings)
    assert not gen.engine.options.capture  # CUDA graphs on CUDA only
    out = gen.generate(prompts, cfg, seed=2)  # two rows at a time, refilled
    assert out.tokens == free.tokens and out.finished == free.finished
    for got, expected in zip(out.logprobs, free.logprobs, strict=True):
        assert got == pytest.approx(expected, abs=1e-5)  # matmuls of other widths round so
    assert gen.engine.cache is None and gen.engine.slots is None  # released after the call
    compiled = NativeGenerator(model, NativeEngineConfig(compile=True))
    assert compiled.engine.options.compile


class _Feed:
    """Hands over ``later`` one prompt per look, and records what ends when."""

    def __init__(self, later: list[list[int]], rows: int) -> None:
        self.later, self.rows, self.longest = list(later), rows, 8
        self.ended_at: list[int] = []  # prompt indices, in the order their rows ended
        self.looks = 0

    def more(self, free: int, max_len: int) -> list[list[int]]:
        self.looks += 1
        if not free or not self.later or self.looks < 2:  # the first look gives nothing
            return []
        assert len(self.later[0]) <= max_len
        return [self.later.pop(0)]

    def ended(self, index, tokens, logprobs, finished) -> None:
        assert len(tokens) == len(logprobs) and finished == (tokens[-1] == EOS)
        self.ended_at.append(index)


def test_fed_prompts_join_a_running_call_and_get_what_a_plain_call_gives(hf):
    gen = NativeGenerator(RankModel.from_hf(hf, Tok(), False))
    cfg = GenerationConfig(max_new_tokens=12, min_new_tokens=2, temperature=1.2)
    later = [[12, 13], [14, 15, 16, 17], [5, 6, 7]]
    feed = _Feed(later, rows=4)
    out = gen.generate(PROMPTS, cfg, seed=5, feed=feed)
    plain = gen.generate(PROMPTS + later, cfg, seed=5)  # the same prompt indices, so draws
    assert out.tokens == plain.tokens and len(out.tokens) == 6
    for got, expected in zip(out.logprobs, plain.logprobs, strict=True):
        assert got == pytest.approx(expected, abs=1e-5)
    # every response went out as its row ended, the first ones before the last prompt joined
    assert sorted(feed.ended_at) == list(range(6)) and feed.ended_at.index(5) > 0
    assert not feed.later and feed.looks >= 4  # they joined at different looks


@pytest.mark.parametrize("master", [True, False], ids=["fp32 master weights", "a bf16 copy"])
def test_an_fp32_lm_head_samples_with_log_probs_of_an_fp32_head(
    hf, master, head_inputs, head_logits
):
    """At bf16 with ``fp32_lm_head``, each sampled token's log-prob is that of an fp32 head on
    the hidden states the step got, not the bf16 head's; the engine lends the head in fp32 (the
    master weight itself, or one fp32 copy of a bf16 one), and a compiled step agrees."""
    numerics = Numerics("bf16", master=master, fp32_lm_head=True)
    model = RankModel.from_hf(hf, Tok(), False, numerics=numerics)
    module = model.module
    cfg = GenerationConfig(max_new_tokens=6, temperature=1.0)
    counter = CompileCounter()
    compiled = DecodeEngine(
        model.pipe, DecodeOptions(compile=True),
        compiler=lambda f: torch.compile(f, fullgraph=True, backend=counter),
    )  # fmt: skip
    fast = compiled.generate([PROMPTS[1]], DecodeRules.of(cfg, EOS, PAD), 1)
    assert counter.frame_count == len(compiled.buckets) == 1  # one graph, no recompiles
    seen = head_inputs(module)  # from here on (a compiled step would recompile at each token)
    gen = NativeGenerator(model)
    out = gen.generate([PROMPTS[1]], cfg, seed=1)
    tokens, got = torch.tensor(out.tokens[0]), torch.tensor(out.logprobs[0])
    h = torch.cat(seen[: len(tokens)])  # the prefill's last token, then a step per token

    def logp(dtype: torch.dtype) -> torch.Tensor:
        z = head_logits(module, h, dtype)
        return z.log_softmax(-1).gather(-1, tokens[:, None]).squeeze(-1)

    torch.testing.assert_close(got, logp(torch.float32), rtol=0, atol=1e-5)
    assert (got - logp(torch.bfloat16)).abs().max() > 1e-4  # 10x the tolerance above
    lent, head = gen.engine.lent, module.param(module.head_name)
    assert lent is not None and lent[module.head_name].dtype == torch.float32
    assert (lent[module.head_name] is head) == master  # a bf16 copy: cast once
    if not master:  # nothing else to lend where nothing is packed (a compiled step)
        assert compiled.lent is not None and set(compiled.lent) == {module.head_name}
    assert fast.tokens == out.tokens
    assert fast.logprobs[0] == pytest.approx(out.logprobs[0], abs=1e-5)
