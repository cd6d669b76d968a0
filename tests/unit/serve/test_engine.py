"""The serving engine seam (``rayhf.serve.engine``): request limits, batching by sampling key,
incremental detokenization with stop strings, checkpoint checks, and the native engine on a tiny
checkpoint in this process."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from pydantic import ValidationError

from rayhf.errors import RayhfError
from rayhf.models.hf import ModelInit, build_model, hf_config, load_model, save_model
from rayhf.serve.engine import (
    EngineOutput,
    EngineRequest,
    NativeEngine,
    RequestRejected,
    SamplingSpec,
    ServingEngine,
    ServingEngineConfig,
    check_checkpoint,
    detokenize,
    group_requests,
    load_engine,
    require_vllm,
)
from rayhf.tasks.demo import build_tokenizer


def test_the_config_keeps_the_default_under_the_ceiling():
    cfg = ServingEngineConfig(checkpoint="ckpt")
    assert (cfg.engine, cfg.max_prompt_tokens, cfg.max_tokens, cfg.default_max_tokens) == (
        "native", 512, 256, 16,
    )  # fmt: skip
    with pytest.raises(ValidationError, match="default_max_tokens must be <= max_tokens"):
        ServingEngineConfig(checkpoint="ckpt", max_tokens=8, default_max_tokens=16)
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        ServingEngineConfig(checkpoint="ckpt", max_batch=4)  # type: ignore[call-arg]


class _Chars(ServingEngine):
    """An engine whose tokens are characters (no bos) and whose model has 20 positions."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def render_chat(self, messages: list[dict[str, str]]) -> str | None:
        return None

    @property
    def max_positions(self) -> int | None:
        return 20

    def generate(self, requests: list[EngineRequest]) -> list[list[EngineOutput]]:
        raise NotImplementedError


@pytest.mark.parametrize(
    "prompt,max_tokens,code,param",
    [
        ("abc", 9, "max_tokens_exceeded", "max_tokens"),
        ("", 4, "empty_prompt", None),
        ("x" * 11, 4, "context_length_exceeded", "prompt"),
        ("x" * 10, 11, "max_tokens_exceeded", "max_tokens"),
        ("x" * 10, 8, None, None),
    ],
)
def test_requests_over_a_limit_are_rejected_naming_the_field(prompt, max_tokens, code, param):
    engine = _Chars(ServingEngineConfig(checkpoint="c", max_prompt_tokens=10, max_tokens=8,
                                        default_max_tokens=4))  # fmt: skip
    sampling = SamplingSpec(max_tokens=max_tokens)
    if code is None:
        assert engine.prepare(prompt, sampling) == EngineRequest(tuple(map(ord, prompt)), sampling)
        return
    with pytest.raises(RequestRejected) as err:
        engine.prepare(prompt, sampling)
    assert (err.value.code, err.value.param) == (code, param)


def test_a_long_prompt_and_max_tokens_together_overflow_the_model():
    engine = _Chars(ServingEngineConfig(checkpoint="c", max_prompt_tokens=100, max_tokens=50))
    with pytest.raises(RequestRejected, match=r"prompt \(15 tokens\) \+ max_tokens \(6\) is over"):
        engine.prepare("x" * 15, SamplingSpec(max_tokens=6))
    assert len(engine.prepare("x" * 15, SamplingSpec(max_tokens=5)).prompt_ids) == 15


def _req(**sampling) -> EngineRequest:
    return EngineRequest((1,), SamplingSpec(max_tokens=4, **sampling))


def test_requests_are_grouped_by_sampling_key_in_first_seen_order():
    requests = [
        _req(greedy=True), _req(temperature=0.7), _req(seed=3), _req(greedy=True, top_k=5),
        _req(temperature=0.7), _req(temperature=0.7, top_p=0.9), _req(seed=3),
    ]  # fmt: skip
    groups = group_requests(requests)
    assert list(groups.values()) == [[0, 3], [1, 4], [2], [5], [6]]
    keys = list(groups)
    assert keys[0] == "greedy" and keys[2] == ("seeded", 2)


def _bytes(tokens: list[int]) -> str:
    """Tokens are UTF-8 bytes: a character cut in the middle decodes to U+FFFD."""
    return bytes(tokens).decode("utf-8", errors="replace")


def test_pieces_add_up_to_the_text_and_hold_back_half_characters():
    tokens = list("aé b".encode())
    pieces, n_used, stopped = detokenize(_bytes, tokens, ())
    assert pieces == ["a", "", "é", " ", "b"] and (n_used, stopped) == (5, False)
    assert detokenize(_bytes, [], ("x",)) == ([], 0, False)


def test_a_stop_string_ends_the_text_before_it_and_the_tokens_after_it():
    tokens = list(b"abcdef")
    pieces, n_used, stopped = detokenize(_bytes, tokens, ("zz", "cd"))
    assert (pieces, n_used, stopped) == (["a", "b", "", ""], 4, True)
    pieces, n_used, stopped = detokenize(_bytes, tokens, ("ef", "b"))
    assert "".join(pieces) == "a" and n_used == 2 and stopped, "the first stop to appear"


def test_checkpoints_need_a_config_and_a_tokenizer(tmp_path: Path):
    with pytest.raises(RayhfError, match="is not a directory"):
        check_checkpoint(tmp_path / "missing")
    with pytest.raises(RayhfError, match=r"is not a model directory \(no config.json\)"):
        check_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(RayhfError, match="has no tokenizer; save it with"):
        check_checkpoint(str(tmp_path))
    (tmp_path / "tokenizer_config.json").write_text("{}")
    assert check_checkpoint(str(tmp_path)) == tmp_path


def test_vllm_is_not_served_in_process_and_its_absence_is_one_line(monkeypatch):
    with pytest.raises(RayhfError, match="engine: vllm has no in-process engine"):
        load_engine(ServingEngineConfig(checkpoint="c", engine="vllm"), max_rows=4)
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(RayhfError, match=r"pip install 'rayhf\[vllm\]'"):
        require_vllm()


@pytest.fixture(scope="module")
def native(tmp_path_factory) -> NativeEngine:
    out = tmp_path_factory.mktemp("ckpt") / "actor"
    tok = build_tokenizer()
    config = hf_config(ModelInit(hidden_size=32, n_heads=4, max_positions=64), len(tok),
                       tok.pad_token_id, tok.bos_token_id, tok.eos_token_id)  # fmt: skip
    save_model(build_model(config, value_head=False, seed=3), out, tok)
    return NativeEngine(
        ServingEngineConfig(checkpoint=str(out), max_tokens=8, default_max_tokens=4)
    )


def test_the_native_engine_encodes_as_training_did(native: NativeEngine):
    ids = native.encode("1 2 =")
    assert ids[0] == native.tokenizer.bos_token_id and len(ids) == 6
    assert native.encode(native.tokenizer.bos_token + "1") == ids[:2], "one bos only"
    assert (
        native.max_positions == 64
        and native.render_chat([{"role": "user", "content": "hi"}]) is None
    )


def test_rows_of_a_batch_do_not_interact_and_seeds_reproduce(native: NativeEngine):
    greedy = SamplingSpec(max_tokens=6, greedy=True)
    short = native.prepare("1 =", SamplingSpec(max_tokens=2, greedy=True))
    long = native.prepare("3 1 4 1 5 =", greedy)
    alone = native.generate([long])[0][0]
    batched = [outs[0] for outs in native.generate([short, long, native.prepare("9 =", greedy)])]
    assert batched[1] == alone, "a greedy row equals the same request run alone"
    assert batched[0].completion_tokens <= 2 and batched[0].prompt_tokens == 4  # bos 1 space =
    for out in batched:
        assert out.text == "".join(out.pieces) and len(out.pieces) == len(out.token_ids)
        ended = bool(out.token_ids) and out.token_ids[-1] == native.eos_id
        assert out.finish_reason == ("stop" if ended else "length")
    seeded = native.prepare("2 =", SamplingSpec(max_tokens=6, seed=11))
    assert native.generate([seeded]) == native.generate([seeded, long])[:1]


def test_n_samples_share_one_call_and_a_seed_gives_sample_j_whatever_n(native: NativeEngine):
    calls: list[int] = []
    real = native.decoder.generate
    native.decoder.generate = lambda prompts, *a: calls.append(len(prompts)) or real(prompts, *a)  # type: ignore[method-assign]
    try:
        four = native.prepare("2 =", SamplingSpec(max_tokens=8, seed=5, n=4))
        [samples] = native.generate([four])
        two = native.generate([native.prepare("2 =", SamplingSpec(max_tokens=8, seed=5, n=2))])
    finally:
        del native.decoder.generate
    assert calls == [4, 2], "a request's samples are rows of one call"
    assert len(samples) == 4 and len({s.token_ids for s in samples}) > 1, "samples differ"
    assert two[0] == samples[:2], "the same seed: the same samples"
    assert all(s.logprobs is None for s in samples)


def test_at_most_max_rows_rows_decode_at_once_and_a_seed_s_samples_stay(native: NativeEngine):
    """Four requests of n = 4 on an engine of max_rows 4: one call of 16 rows, decoded 4 at a
    time in 4-row buffers; a seeded request's samples as on an engine that holds them all."""
    small = NativeEngine(native.cfg, max_rows=4)
    spec = SamplingSpec(max_tokens=8, n=4)
    requests = [small.prepare(p, spec) for p in ("1 =", "2 =", "3 4 =", "5 =")]
    unseeded = small.generate(requests)
    assert [len(samples) for samples in unseeded] == [4] * 4
    assert small.decoder.slots is not None and small.decoder.slots.n == 4
    assert small.decoder.cache is not None and small.decoder.cache.n_rows == 4
    seeded = small.prepare("2 =", dataclasses.replace(spec, seed=5, n=6))  # 2 rows wait
    assert small.generate([seeded]) == native.generate([seeded])


def test_log_probs_are_the_raw_distribution_s_with_the_likeliest_tokens(native: NativeEngine):
    """At temperature 2 the reported log-probs are still ``log_softmax(logits)`` (vLLM's
    default), the top-k are sorted and hold the greedy token, and asking changes no token."""
    import torch

    from rayhf.algorithms.lm import token_logprobs

    spec = SamplingSpec(max_tokens=6, temperature=2.0, seed=1, n=2)
    plain, asked = (
        native.generate([native.prepare("1 2 =", dataclasses.replace(spec, logprobs=k))])[0]
        for k in (None, 3)
    )
    assert [o.token_ids for o in plain] == [o.token_ids for o in asked]
    prompt = native.encode("1 2 =")
    hf = load_model(Path(native.cfg.checkpoint), value_head=False, field="c").eval()
    for out in asked:
        assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
        ids = torch.tensor([[*prompt, *out.token_ids]])
        with torch.no_grad():
            logits = hf(ids).logits[:, len(prompt) - 1 : -1]
        want = token_logprobs(logits, torch.tensor([out.token_ids]))[0]
        got = torch.tensor([t.logprob for t in out.logprobs])
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
        for t, row in zip(out.logprobs, logits[0].log_softmax(-1), strict=True):
            assert len(t.top) == 3 and [lp for _, lp in t.top] == sorted(
                (lp for _, lp in t.top), reverse=True
            )
            assert t.top[0][0] == native.token_text(int(row.argmax()))
            assert t.top[0][1] == pytest.approx(float(row.max()), abs=1e-4)


def test_an_adapter_is_served_on_the_checkpoint_s_own_weights(native: NativeEngine, tmp_path):
    from peft import LoraConfig, get_peft_model

    checkpoint = native.cfg.checkpoint
    config = LoraConfig(r=2, target_modules=["q_proj"], init_lora_weights=False)
    get_peft_model(load_model(checkpoint, False, "c"), config).save_pretrained(tmp_path)
    cfg = ServingEngineConfig(checkpoint=checkpoint, adapters={"a": str(tmp_path)})
    engine = NativeEngine(cfg)
    base, adapted = (engine.decoders[k].model for k in (None, "a"))
    names = [n for n in adapted.shards if ".lora_" not in n]
    assert names and names == list(base.shards)
    assert all(adapted.param(n).data_ptr() == base.param(n).data_ptr() for n in names)
    assert sum(".lora_" in n for n in adapted.shards) == 2 * 2  # q_proj's A and B, 2 layers
