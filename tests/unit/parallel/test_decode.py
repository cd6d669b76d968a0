"""The native decode engine on one rank against the whole-model sampler of ``rayhf.sampling``
(checked against Hugging Face ``generate`` in tests/unit/test_sampling.py): the same tokens and
log-probs for the same seed, whatever the slots, refills, compactions and shared prefills; a
decode step that ``torch.compile(fullgraph=True)`` takes and does not recompile step to step."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounter

from rayhf.checks.common import EOS, PAD, tiny_model
from rayhf.errors import RayhfError
from rayhf.models.spec import model_spec
from rayhf.parallel.decode import (
    TOP_LOGPROBS_SLOTS,
    DecodeEngine,
    DecodeOptions,
    decode_step,
    generate,
)
from rayhf.parallel.groups import single
from rayhf.parallel.model import ShardedModel
from rayhf.parallel.pipeline import Pipeline
from rayhf.sampling import DecodeRules, GenerateOutput, GenerationConfig
from rayhf.sampling import generate as hf_generate

PROMPTS = [[3, 4, 5], [6, 7, 8, 9, 10], [11]]
# five prompts, two of them repeated (a GRPO-shaped call), of mixed lengths
MIXED = [[3, 4, 5], [6, 7, 8, 9, 10], [3, 4, 5], [11], [12, 13], [6, 7, 8, 9, 10], [3, 4, 5]]
SAMPLED = GenerationConfig(max_new_tokens=12, temperature=1.2, min_new_tokens=2)


def _scaled(family: str, shape: dict, scale: float, seed: int = 1):
    hf = tiny_model(family, shape, seed=seed)
    with torch.no_grad():  # larger weights: trajectories vary, and some rows reach EOS
        for p in hf.parameters():
            if p.dim() > 1:
                p.mul_(scale)
    model = ShardedModel(model_spec(hf.config, False), single(), hf.state_dict())
    return hf, Pipeline(model, single())


SHAPES = {"llama": {"n_heads": 4, "n_kv_heads": 2}, "gpt2": {"n_heads": 4}}


@pytest.fixture(scope="module", params=sorted(SHAPES))
def models(request):
    return _scaled(request.param, SHAPES[request.param], 6.0)


@pytest.fixture(scope="module")
def llama():
    return _scaled("llama", {"n_heads": 4, "n_kv_heads": 2}, 5.0)


def _same(got: GenerateOutput, ref: GenerateOutput) -> None:
    assert got.tokens == ref.tokens and got.finished == ref.finished
    for a, b in zip(got.logprobs, ref.logprobs, strict=True):
        assert a == pytest.approx(b, abs=1e-4)


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
        got = generate(pipe, PROMPTS, cfg, EOS, PAD, seed)
        _same(got, hf_generate(hf, PROMPTS, cfg, EOS, PAD, seed))
        assert all(len(t) <= cfg.max_new_tokens for t in got.tokens)


def test_no_prompts_and_empty_prompts(models):
    _, pipe = models
    assert generate(pipe, [], GenerationConfig(), EOS, PAD) == GenerateOutput()
    with pytest.raises(RayhfError, match="at least one token"):
        generate(pipe, [[3], []], GenerationConfig(), EOS, PAD)


def test_a_shared_prompt_prefills_once_into_the_same_keys_and_values(llama):
    _, pipe = llama
    rules = DecodeRules.of(GenerationConfig(max_new_tokens=1), EOS, PAD)
    shared, separate = DecodeEngine(pipe), DecodeEngine(pipe, DecodeOptions(share_prompts=False))
    prefills: list[int] = []
    real = shared._prefill
    shared._prefill = lambda p, rows, rec: prefills.append(len(p)) or real(p, rows, rec)  # type: ignore[method-assign]
    shared.generate(MIXED, rules, 0)
    separate.generate(MIXED, rules, 0)
    assert prefills == [4]  # the four distinct prompts, each once
    assert shared.cache is not None and separate.cache is not None
    for layer in shared.cache.k:
        for row, prompt in enumerate(MIXED):
            n = len(prompt)
            for a, b in ((shared.cache.k, separate.cache.k), (shared.cache.v, separate.cache.v)):
                torch.testing.assert_close(a[layer][row, :, :n], b[layer][row, :, :n])


@pytest.mark.parametrize(
    "options",
    [
        DecodeOptions(max_rows=2),  # five prompts through two slots: refills
        DecodeOptions(compact=False),
        DecodeOptions(share_prompts=False),
        DecodeOptions(max_rows=3, compact=False),
    ],
    ids=["refill", "no-compaction", "separate-prefills", "refill-no-compaction"],
)
def test_a_prompt_gets_the_same_response_whatever_its_slot(llama, options):
    hf, pipe = llama
    ref = hf_generate(hf, MIXED, SAMPLED, EOS, PAD, seed=4)
    assert any(ref.finished) and not all(ref.finished)  # rows end at different steps
    engine = DecodeEngine(pipe, options)
    _same(engine.generate(MIXED, DecodeRules.of(SAMPLED, EOS, PAD), 4), ref)
    if options.max_rows < len(MIXED):
        assert engine.slots is not None and engine.slots.n == options.max_rows


def test_live_rows_move_down_into_a_smaller_bucket(llama):
    _, pipe = llama
    engine = DecodeEngine(pipe)
    engine.generate(MIXED, DecodeRules.of(SAMPLED, EOS, PAD), 4)
    widths = {rows for _, rows, _ in engine.buckets}
    assert max(widths) == len(MIXED) and min(widths) < len(MIXED)


def test_buffers_are_kept_while_they_fit_and_released_on_request(llama):
    _, pipe = llama
    engine = DecodeEngine(pipe)
    rules = DecodeRules.of(SAMPLED, EOS, PAD)
    engine.generate(MIXED, rules, 0)
    cache, slots = engine.cache, engine.slots
    assert cache is not None and cache.nbytes() > 0
    engine.generate(MIXED[:3], rules, 1)  # fewer, shorter: the same buffers
    assert engine.cache is cache and engine.slots is slots
    engine.generate(MIXED, DecodeRules.of(GenerationConfig(max_new_tokens=40), EOS, PAD), 1)
    assert engine.cache is not cache  # longer responses: a larger cache
    engine.release()
    assert engine.cache is None and engine.slots is None


def test_the_decode_step_compiles_whole_and_once_per_bucket(llama):
    """fullgraph=True: a graph break raises. Steps of one (rows, keys) bucket add no
    compilation: dynamo compiles once per bucket the engine ran at, at most."""
    hf, pipe = llama
    counter = CompileCounter()
    options = DecodeOptions(compile=True)
    engine = DecodeEngine(
        pipe, options, compiler=lambda f: torch.compile(f, fullgraph=True, backend=counter)
    )
    rules = DecodeRules.of(SAMPLED, EOS, PAD)
    _same(engine.generate(MIXED, rules, 4), hf_generate(hf, MIXED, SAMPLED, EOS, PAD, seed=4))
    steps_run = engine.n_steps
    assert counter.frame_count <= len(engine.buckets) < steps_run
    compiled = counter.frame_count
    engine.generate(MIXED, rules, 4)  # the same buckets again: nothing new to compile
    assert counter.frame_count == compiled and engine.n_steps > steps_run
    assert not torch._dynamo.utils.counters["graph_break"]


def test_the_step_alone_runs_many_tokens_on_one_compilation(llama):
    _, pipe = llama
    engine = DecodeEngine(pipe)
    rules = DecodeRules.of(GenerationConfig(max_new_tokens=30, min_new_tokens=30), EOS, PAD)
    engine.generate([[3, 4, 5], [6, 7]], rules, 0)  # buffers for 2 rows, 35 slots
    counter = CompileCounter()
    step = torch.compile(decode_step, fullgraph=True, backend=counter, dynamic=False)
    slots = engine.slots
    assert slots is not None and engine.cache is not None
    slots.positions[:2] = torch.tensor([3, 2])
    slots.steps[:2] = 1
    slots.live[:2] = True
    with torch.inference_mode():
        for _ in range(20):
            step(pipe.model, engine.cache, slots, rules, 2, 32)
    assert counter.frame_count == 1
    assert slots.steps[:2].tolist() == [21, 21] and slots.positions[:2].tolist() == [23, 22]


def test_a_trained_copy_generates_from_casts_it_refreshes_when_the_weights_change():
    """fp32 master weights under bf16 autocast (a trained actor): the engine keeps its matmul
    weights cast between calls, the same tokens as casting every token, and new ones after an
    update in place."""
    from rayhf.checks.common import Tok
    from rayhf.engines.rank_model import RankModel
    from rayhf.models.precision import Numerics

    hf, _ = _scaled("llama", {"n_heads": 4, "n_kv_heads": 2}, 5.0)
    model = RankModel.from_hf(hf, Tok(), False, numerics=Numerics("bf16", master=True))
    engine = DecodeEngine(model.pipe)
    rules = DecodeRules.of(SAMPLED, EOS, PAD)
    with torch.no_grad():
        plain = [engine.generate(MIXED, rules, 4)]
    casts = engine.lent
    assert casts is not None and all(t.dtype == torch.bfloat16 for t in casts.values())
    bare = DecodeEngine(model.pipe)
    bare.lend_weights = lambda: None  # type: ignore[method-assign]
    assert bare.generate(MIXED, rules, 4) == plain[0]
    other, _ = _scaled("llama", {"n_heads": 4, "n_kv_heads": 2}, 5.0, seed=2)
    model.load_full_state(other.state_dict())  # in place: the same storage
    after = engine.generate(MIXED, rules, 4)
    assert engine.lent is casts and after == bare.generate(MIXED, rules, 4)
    assert after.tokens != plain[0].tokens


def test_the_capture_path_replays_what_the_step_computes(llama):
    """The capture bookkeeping on CPU (a "graph" that calls the step again): a warm-up run
    before each capture leaves the slots as it found them, one graph per bucket, and the
    responses are the eager engine's."""
    hf, pipe = llama
    engine = DecodeEngine(pipe, DecodeOptions(capture=True, max_rows=4))
    rules = DecodeRules.of(SAMPLED, EOS, PAD)
    _same(engine.generate(MIXED, rules, 4), hf_generate(hf, MIXED, SAMPLED, EOS, PAD, seed=4))
    assert set(engine.graphs) == {(part, b, k, rules) for part, b, k in engine.buckets}
    assert engine.buckets and all(b in (1, 2, 4) and k % 64 == 0 for _, b, k in engine.buckets)
    graphs = dict(engine.graphs)
    engine.generate(MIXED, rules, 4)
    assert graphs and all(engine.graphs[k] is g for k, g in graphs.items())  # replayed


def test_on_cpus_the_step_multiplies_packed_copies_made_again_when_weights_change(
    models, monkeypatch
):
    """oneDNN-packed copies of the fp32 matmul weights: the same tokens as the weights
    themselves (log-probs to rounding), and new copies after an update in place."""
    from rayhf.parallel import lent

    monkeypatch.setattr(lent, "PACK_MIN_ELEMENTS", 0)  # the tiny model's weights too
    _, pipe = models
    if not lent.packable():
        pytest.skip("this torch has no oneDNN linear packing")
    rules = DecodeRules.of(SAMPLED, EOS, PAD)
    packed, plain = DecodeEngine(pipe), DecodeEngine(pipe, DecodeOptions(pack=False))
    got, want = packed.generate(MIXED, rules, 4), plain.generate(MIXED, rules, 4)
    _same(got, want)
    assert packed.lent is not None and all(t.is_mkldnn for t in packed.lent.values())
    assert plain.lent is None
    before = packed.lent
    with torch.no_grad():
        name = pipe.model.matmul_weights()[0]
        pipe.model.param(name).mul_(0.5)  # an optimizer step, in place
    try:
        packed.generate(MIXED, rules, 4)
        assert packed.lent is not before
    finally:
        with torch.no_grad():
            pipe.model.param(name).mul_(2.0)


def test_raw_and_top_log_probs_ride_in_the_whole_step(llama):
    """Asked for (the policy server does), the step reports each token's raw log-prob (before
    the temperature) and the k likeliest tokens at each position: the same tokens, a full
    forward's numbers, and still one graph per bucket with fullgraph=True."""
    import dataclasses

    hf, pipe = llama
    rules = DecodeRules.of(SAMPLED, EOS, PAD)
    asked = dataclasses.replace(rules, raw_logprobs=True, top_logprobs=3)
    counter = CompileCounter()
    options = DecodeOptions(compile=True, compact=False)
    engine = DecodeEngine(
        pipe, options, compiler=lambda f: torch.compile(f, fullgraph=True, backend=counter)
    )
    out = engine.generate(MIXED, asked, 4)
    assert out.tokens == DecodeEngine(pipe).generate(MIXED, rules, 4).tokens
    assert 0 < counter.frame_count <= len(engine.buckets)
    assert not torch._dynamo.utils.counters["graph_break"]
    for prompt, tokens, lps, ids, tops in zip(
        MIXED, out.tokens, out.logprobs, out.top_ids, out.top_logprobs, strict=True
    ):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
        full = logits.float().log_softmax(-1)
        want = full.gather(1, torch.tensor(tokens)[:, None]).squeeze(1)
        torch.testing.assert_close(torch.tensor(lps), want, atol=1e-4, rtol=0)
        values, best = full.topk(3, dim=-1)
        assert ids == best.tolist()
        torch.testing.assert_close(torch.tensor(tops), values, atol=1e-4, rtol=0)


def test_each_k_of_top_log_probs_fits_the_same_slots(llama):
    """Slots hold ``TOP_LOGPROBS_SLOTS`` top log-probs whenever any are asked, so a client's
    new k reallocates nothing (on CUDA: forgets no graph); each call gets its own k."""
    import dataclasses

    _, pipe = llama
    engine = DecodeEngine(pipe)
    rules = DecodeRules.of(SAMPLED, EOS, PAD)
    outs = {}
    for k in (5, 2, TOP_LOGPROBS_SLOTS, 1):
        outs[k] = engine.generate(MIXED, dataclasses.replace(rules, top_logprobs=k), 4)
        if k == 5:
            slots = engine.slots
        assert engine.slots is slots and slots is not None and slots.k == TOP_LOGPROBS_SLOTS
        assert {len(t) for row in outs[k].top_ids for t in row} == {k}
    for few in (1, 2):
        assert [[t[:few] for t in row] for row in outs[5].top_ids] == outs[few].top_ids


def test_a_mixture_of_experts_step_compiles_whole_and_samples_as_hugging_face():
    """Qwen3-MoE's routing and grouped experts read nothing back to the host: the step
    compiles with fullgraph=True, and samples Hugging Face's tokens."""
    from rayhf.models.families import FAMILIES

    hf, pipe = _scaled("qwen3_moe", dict(FAMILIES["qwen3_moe"].check_shape), 5.0)
    counter = CompileCounter()
    engine = DecodeEngine(
        pipe,
        DecodeOptions(compile=True),
        compiler=lambda f: torch.compile(f, fullgraph=True, backend=counter),
    )
    rules = DecodeRules.of(SAMPLED, EOS, PAD)
    _same(engine.generate(MIXED, rules, 4), hf_generate(hf, MIXED, SAMPLED, EOS, PAD, seed=4))
    assert 0 < counter.frame_count <= len(engine.buckets)
    assert not torch._dynamo.utils.counters["graph_break"]


def _routes_of(pipe: Pipeline, seqs: list[list[int]]) -> list[torch.Tensor]:
    """Each sequence's experts per token in one packed forward (no cache)."""
    from rayhf.parallel.attention import TokenLayout
    from rayhf.parallel.moe import Routes

    spec = pipe.model.spec
    assert spec.moe is not None
    lengths = [len(s) for s in seqs]
    record = torch.zeros(sum(lengths), len(spec.moe_layers), spec.moe.top_k, dtype=torch.int16)
    with torch.no_grad():
        pipe.model(torch.tensor([t for s in seqs for t in s]), TokenLayout.packed(lengths),
                   routes=Routes(record=record))  # fmt: skip
    return list(record.split(lengths))


def test_a_generator_records_the_experts_each_token_went_to():
    """Prompt tokens (a repeated prompt prefilled once) and response tokens, through refills
    and compaction: the experts a packed forward of prompt + response sends them to; the last
    response token, never fed, none (-1). Compiled whole, the step records the same."""
    import dataclasses

    from rayhf.models.families import FAMILIES

    _, pipe = _scaled("qwen3_moe", dict(FAMILIES["qwen3_moe"].check_shape), 5.0)
    spec = pipe.model.spec
    assert spec.moe is not None
    rules = dataclasses.replace(DecodeRules.of(SAMPLED, EOS, PAD), routes=True)
    out = DecodeEngine(pipe, DecodeOptions(max_rows=2)).generate(MIXED, rules, 4)
    seqs = [p + t for p, t in zip(MIXED, out.tokens, strict=True)]
    assert any(len(t) < SAMPLED.max_new_tokens for t in out.tokens)  # some rows ended early
    for got, want, seq in zip(out.routes, _routes_of(pipe, seqs), seqs, strict=True):
        assert got.shape == (len(seq), len(spec.moe_layers), spec.moe.top_k)
        assert got.dtype == torch.int16 and (got[-1] == -1).all()
        assert torch.equal(got[:-1], want[:-1])
    plain = dataclasses.replace(rules, routes=False)
    assert DecodeEngine(pipe).generate(MIXED, plain, 4).routes == []
    counter = CompileCounter()
    compiled = DecodeEngine(
        pipe,
        DecodeOptions(compile=True),
        compiler=lambda f: torch.compile(f, fullgraph=True, backend=counter),
    ).generate(MIXED, rules, 4)
    assert compiled.tokens == out.tokens
    assert all(torch.equal(a, b) for a, b in zip(compiled.routes, out.routes, strict=True))


def test_a_q_k_normed_model_with_fp32_master_weights_decodes_under_bf16_autocast():
    """Qwen3's q/k norms of fp32 master weights give fp32 keys under autocast; the bf16 cache
    keeps them in bf16, and the tokens are the bf16 frozen copy's or near them."""
    from rayhf.models.precision import Numerics

    hf = tiny_model("qwen3", {"n_heads": 4, "n_kv_heads": 2})
    rules = DecodeRules.of(GenerationConfig(max_new_tokens=6, greedy=True), EOS, PAD)
    outs = []
    for numerics in (Numerics("bf16", master=True), Numerics("bf16")):
        model = ShardedModel(model_spec(hf.config, False), single(), hf.state_dict(), numerics)
        engine = DecodeEngine(Pipeline(model, single()))
        outs.append(engine.generate(PROMPTS, rules, 0))
        assert engine.cache is not None and engine.cache.k[0].dtype == torch.bfloat16
    assert [len(t) for t in outs[0].tokens] == [6, 6, 6]
    pairs = zip(outs[0].tokens, outs[1].tokens, strict=True)
    same = sum(a == b for x, y in pairs for a, b in zip(x, y, strict=True))
    assert same >= 12  # of 18: bf16 products of fp32 and of bf16-stored weights round alike


@pytest.mark.parametrize(
    "options",
    [DecodeOptions(max_rows=2), pytest.param(DecodeOptions(compile=True), marks=pytest.mark.slow)],
)
def test_a_hybrid_model_carries_each_row_s_recurrent_state_through_refills(options):
    """Qwen3.5's Gated DeltaNet layers keep a state per row beside the attention layers' keys:
    a prefill leaves it in the row, a repeated prompt's rows copy it, refills overwrite it and
    compaction moves it; the step with it compiles whole. The whole-model sampler's tokens."""
    from rayhf.models.families import FAMILIES

    hf, pipe = _scaled("qwen3_5_text", dict(FAMILIES["qwen3_5_text"].check_shape), 3.0)
    engine = DecodeEngine(pipe, options)
    got = engine.generate(MIXED, DecodeRules.of(SAMPLED, EOS, PAD), 3)
    _same(got, hf_generate(hf, MIXED, SAMPLED, EOS, PAD, 3))
    assert engine.cache is not None and engine.cache.state and len(engine.cache.k) == 2
