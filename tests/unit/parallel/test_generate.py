"""Sampling with the sharded model's KV cache on one rank against the whole-model sampler of
``rayhf.sampling`` (checked against Hugging Face ``generate`` in tests/unit/test_sampling.py): the
same tokens for the same generator state, and the same log-probs."""

from __future__ import annotations

import pytest
import torch

from rayhf.checks.common import EOS, PAD, tiny_model
from rayhf.errors import RayhfError
from rayhf.models.spec import model_spec
from rayhf.parallel.generate import generate
from rayhf.parallel.groups import single
from rayhf.parallel.model import ShardedModel
from rayhf.parallel.pipeline import Pipeline
from rayhf.sampling import GenerateOutput, GenerationConfig
from rayhf.sampling import generate as hf_generate

PROMPTS = [[3, 4, 5], [6, 7, 8, 9, 10], [11]]


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def models(request):
    hf = tiny_model(request.param, {"n_heads": 4}, seed=1)
    with torch.no_grad():  # larger weights: trajectories vary, and some rows reach EOS
        for p in hf.parameters():
            if p.dim() > 1:
                p.mul_(6.0)
    model = ShardedModel(model_spec(hf.config, False), single(), hf.state_dict())
    return hf, Pipeline(model, single())


@pytest.mark.parametrize(
    "cfg",
    [
        GenerationConfig(max_new_tokens=6, greedy=True),
        GenerationConfig(max_new_tokens=8, temperature=1.3, top_k=5),
        GenerationConfig(max_new_tokens=8, min_new_tokens=3, top_p=0.9),
    ],
)
def test_same_tokens_and_logprobs_as_the_whole_model(models, cfg):
    hf, pipe = models
    for seed in (0, 1):
        got = generate(pipe, PROMPTS, cfg, EOS, PAD, torch.Generator().manual_seed(seed))
        ref = hf_generate(hf, PROMPTS, cfg, EOS, PAD, torch.Generator().manual_seed(seed))
        assert got.tokens == ref.tokens and got.finished == ref.finished
        for a, b in zip(got.logprobs, ref.logprobs, strict=True):
            assert a == pytest.approx(b, abs=1e-4)
        assert all(len(t) <= cfg.max_new_tokens for t in got.tokens)


def test_no_prompts_and_empty_prompts(models):
    _, pipe = models
    assert generate(pipe, [], GenerationConfig(), EOS, PAD) == GenerateOutput()
    with pytest.raises(RayhfError, match="at least one token"):
        generate(pipe, [[3], []], GenerationConfig(), EOS, PAD)
