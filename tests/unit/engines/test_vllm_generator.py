"""The vLLM generate seam without starting vLLM: ``check_vllm``'s errors, the scoring forward,
``VllmEngine`` against a fake ``vllm`` module (what it asks of vLLM, sleep and wake), and
``VllmGenerator`` reloading weights only when the rank's model changed."""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

import pytest
import torch

from rayhf.checks.common import EOS, Tok, tiny_model
from rayhf.engines import vllm_generator as vg
from rayhf.engines import vllm_sync_check as sc
from rayhf.engines.rank_model import RankModel
from rayhf.errors import RayhfError
from rayhf.models.hf import model_files
from rayhf.models.precision import DTYPES, Numerics
from rayhf.parallel.layout import Layout
from rayhf.sampling import GenerationConfig

DP1 = Layout((0,), dp=1)


@pytest.fixture
def installed(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: object() if name == "vllm" else real(name)
    )


# ----- check_vllm ---------------------------------------------------------------------------


def test_check_vllm_passes_a_whole_model_rank_with_a_supported_head_size(installed):
    vg.check_vllm("actor_gen", "actor", DP1, 64, "cpu")
    vg.check_vllm("actor_gen", "actor", DP1, 8, "cuda")  # the head-size list is CPU attention's


@pytest.mark.parametrize("layout", [Layout((0, 1), dp=1, tp=2), Layout((0, 1), dp=1, pp=2)])
def test_check_vllm_refuses_tp_or_pp(installed, layout):
    with pytest.raises(RayhfError) as info:
        vg.check_vllm("actor_gen", "actor", layout, 64, "cpu")
    msg = str(info.value)
    assert msg.startswith("engines.actor_gen.engine: vLLM runs one whole model per rank")
    assert layout.name in msg and msg.endswith("set plan.actor_gen to a dp-only layout")


def test_check_vllm_refuses_a_head_size_cpu_attention_lacks(installed):
    with pytest.raises(RayhfError) as info:
        vg.check_vllm("actor_gen", "actor", DP1, 8, "cpu")
    msg = str(info.value)
    assert "head_dim (32, 64," in msg and "role 'actor' has 8" in msg
    assert msg.endswith("change models.actor")


def test_without_vllm_the_errors_name_the_extra(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(RayhfError) as info:
        vg.check_vllm("actor_gen", "actor", DP1, 64, "cpu")
    assert str(info.value) == f"engines.actor_gen.engine: vLLM is not installed: {vg.VLLM_EXTRA}"
    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(RayhfError, match="engine 'vllm' needs vLLM, which is not installed"):
        vg.import_vllm()


# ----- scoring ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf():
    return tiny_model("llama", {"n_heads": 4}, seed=2)


@pytest.fixture(scope="module")
def files(hf):
    return model_files(hf.config, False)


@pytest.mark.parametrize("greedy", [False, True])
def test_score_is_the_log_prob_of_each_response_token_under_the_rank_s_model(hf, greedy):
    model = RankModel.from_hf(hf, Tok(), False)
    prompts, tokens = [[3, 4, 5], [6]], [[7, 8], [9, 10, EOS]]
    cfg = GenerationConfig(greedy=greedy, temperature=0.5)
    got = vg.score(model, prompts, tokens, cfg)
    scale = 1.0 if greedy else 0.5  # greedy samples are scored unscaled
    for prompt, response, logps in zip(prompts, tokens, got, strict=True):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + response])).logits[0] / scale
        expected = [
            logits[len(prompt) - 1 + j].log_softmax(-1)[t].item() for j, t in enumerate(response)
        ]
        assert logps == pytest.approx(expected, abs=1e-5)


def test_score_honours_an_fp32_lm_head(hf, head_inputs, head_logits):
    """vLLM samples, the rank's forward scores: at bf16 with ``fp32_lm_head`` the log-probs a
    vLLM call returns are an fp32 head's on the hidden states, as the trainer's are."""
    numerics = Numerics("bf16", master=True, fp32_lm_head=True)
    model = RankModel.from_hf(hf, Tok(), False, numerics=numerics)
    seen = head_inputs(model.module)
    prompts, tokens = [[3, 4, 5]], [[7, 8, 9, EOS]]
    got = torch.tensor(vg.score(model, prompts, tokens, GenerationConfig(temperature=0.5))[0])
    z = head_logits(model.module, seen[0][2:6], torch.float32) / 0.5  # the response's positions
    expected = z.log_softmax(-1).gather(-1, torch.tensor(tokens[0])[:, None]).squeeze(-1)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


# ----- VllmEngine on a fake vllm ------------------------------------------------------------


class FakeLLM:
    """Records what vLLM is asked; generates ``[prompt[-1] + 1, EOS]`` per request."""

    def __init__(self, **kwargs) -> None:
        self.kwargs, self.log, self.sleeping = kwargs, [], False
        self.llm_engine = types.SimpleNamespace(is_sleeping=lambda: self.sleeping)
        self.model = torch.nn.Module()  # the worker's model: reloads copy into its parameters

    def collective_rpc(self, fn, args):
        runner = types.SimpleNamespace(reload_weights=self._reload, get_model=lambda: self.model)
        return [fn(types.SimpleNamespace(model_runner=runner), *args)]  # one worker's answer

    def _reload(self, weights_iterator):
        weights = list(weights_iterator)
        self.log.append(("reload", weights))
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, t in weights:
                if name in params:
                    params[name].copy_(t)

    def generate(self, requests, params, use_tqdm, lora_request=None):
        self.log.append(("generate", requests, params))
        out = []
        for r in requests:
            completion = types.SimpleNamespace(token_ids=(r["prompt_token_ids"][-1] + 1, EOS))
            out.append(types.SimpleNamespace(outputs=[completion]))
        return out

    def sleep(self, level):
        self.log.append(("sleep", level))
        self.sleeping = True

    def wake_up(self):
        self.log.append(("wake",))
        self.sleeping = False


@pytest.fixture
def fake_vllm(monkeypatch):
    """A ``vllm`` module whose ``LLM`` is ``FakeLLM`` and whose platform is a GPU."""
    module = types.ModuleType("vllm")
    module.LLM = FakeLLM
    module.SamplingParams = lambda **kw: kw
    platforms = types.ModuleType("vllm.platforms")
    platforms.current_platform = types.SimpleNamespace(is_cpu=lambda: False)
    monkeypatch.setitem(sys.modules, "vllm", module)
    monkeypatch.setitem(sys.modules, "vllm.platforms", platforms)
    for var in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_KVCACHE_SPACE"):
        monkeypatch.setenv(var, "unset-by-test")  # import_vllm's setdefault keeps these
    return module


def test_vllm_engine_asks_for_a_dummy_float32_model_of_the_role_s_shape(fake_vllm, files):
    engine = vg.VllmEngine(files, max_model_len=64, seed=3, sleeps=True)
    kw = engine.llm.kwargs
    assert (kw["load_format"], kw["dtype"], kw["seed"]) == ("dummy", "float32", 3)
    assert kw["skip_tokenizer_init"] and kw["enforce_eager"] and kw["enable_sleep_mode"]
    assert kw["max_model_len"] == 64
    config = Path(kw["model"]) / "config.json"  # the shape, saved where vLLM reads it
    assert '"model_type": "llama"' in config.read_text()
    no_sleep = vg.VllmEngine(files, max_model_len=64, seed=3, sleeps=False)
    assert not no_sleep.llm.kwargs["enable_sleep_mode"]
    low = vg.VllmEngine(files, max_model_len=64, seed=3, sleeps=False, dtype="bf16")
    assert low.llm.kwargs["dtype"] == "bfloat16"  # the role's precision
    assert (engine.dtype, low.dtype) == (torch.float32, torch.bfloat16)  # what checks cast to
    no_sleep.generate([[3]], GenerationConfig(), eos_token_id=EOS, seed=0)
    assert [e[0] for e in no_sleep.llm.log] == ["generate"]  # a rank that does not train


def test_vllm_engine_sampling_params_and_sleep_between_calls(fake_vllm, files):
    engine = vg.VllmEngine(files, max_model_len=64, seed=0, sleeps=True)
    cfg = GenerationConfig(max_new_tokens=5, min_new_tokens=1, temperature=0.7, top_p=0.9)
    out = engine.generate([[3, 4], [6]], cfg, eos_token_id=EOS, seed=10)
    assert out == [[5, EOS], [7, EOS]]
    (_, requests, params) = engine.llm.log[0]
    assert requests == [{"prompt_token_ids": [3, 4]}, {"prompt_token_ids": [6]}]
    assert params[0] == {
        "n": 1, "temperature": 0.7, "top_k": -1, "top_p": 0.9, "max_tokens": 5,
        "min_tokens": 1, "stop_token_ids": [EOS], "seed": 10,
    }  # fmt: skip
    assert params[1]["seed"] == 11  # one seed per request
    assert engine.llm.log[1] == ("sleep", 1) and engine.asleep
    greedy = GenerationConfig(greedy=True, top_k=4, temperature=0.3)
    engine.generate([[3]], greedy, eos_token_id=EOS, seed=0)
    assert engine.llm.log[2] == ("wake",)  # woken before generating again
    (_, _, params) = engine.llm.log[3]
    assert (params[0]["temperature"], params[0]["top_k"]) == (0.0, 4)
    assert engine.llm.log[4] == ("sleep", 1)
    weights = [("w", torch.ones(1))]
    assert engine.load_weights(weights) is None  # unchecked
    assert engine.llm.log[5:] == [("wake",), ("reload", weights)]  # woken to take weights


def test_a_checked_load_reports_what_the_worker_s_model_holds(fake_vllm, files):
    engine = vg.VllmEngine(files, max_model_len=64, seed=0, sleeps=False)
    engine.llm.model.w = torch.nn.Parameter(torch.zeros(3), requires_grad=False)
    weights = [("w", torch.tensor([1.0, 2.0, 3.0])), ("tied", torch.ones(1)), ("x", torch.ones(1))]
    held = engine.load_weights(weights, check=True, skip=frozenset({"tied"}))
    assert held == sc.HeldWeights(
        "Module", (sc.Held(sc.Group("w", ("w",)), torch.float32, sc.checksum(weights[0][1])),),
        unused=("x",),
    )  # fmt: skip


# ----- VllmGenerator ------------------------------------------------------------------------


class FakeEngine:
    """Stands in for ``VllmEngine``: answers ``[8, EOS]`` or ``[8, 9]`` by the prompt's parity."""

    def __init__(self, hf_config, max_model_len, seed, sleeps, dtype, lora_rank=None) -> None:
        self.args = (max_model_len, seed, sleeps)
        self.dtype = DTYPES[dtype]  # as VllmEngine keeps it
        self.loads: list[dict[str, torch.Tensor]] = []

        self.held: sc.HeldWeights | None = None  # what a checked load reports
        self.checks: list[tuple[bool, frozenset[str]]] = []

    def load_weights(self, weights, check=False, skip=frozenset()):
        self.loads.append(dict(weights))
        self.checks.append((check, skip))
        return self.held if check else None

    def generate(self, prompts, cfg, eos_token_id, seed):
        return [[8, eos_token_id] if len(p) % 2 else [8, 9] for p in prompts]


def test_vllm_generator_reloads_only_changed_weights(monkeypatch, hf):
    monkeypatch.setattr(vg, "VllmEngine", FakeEngine)
    model = RankModel.from_hf(hf, Tok(), False)
    gen = vg.VllmGenerator(model, seed=4, sleeps=False)
    assert gen.name == "vllm"
    assert gen.vllm.args == (hf.config.max_position_embeddings, 4, False)
    cfg = GenerationConfig(max_new_tokens=2)
    out = gen.generate([[3, 4, 5], [6, 7]], cfg, seed=1)
    assert out.tokens == [[8, EOS], [8, 9]] and out.finished == [True, False]
    assert out.logprobs == vg.score(model, [[3, 4, 5], [6, 7]], out.tokens, cfg)
    assert len(gen.vllm.loads) == 1
    assert torch.equal(gen.vllm.loads[0]["lm_head.weight"], hf.state_dict()["lm_head.weight"])
    gen.generate([[3]], cfg, seed=2)
    assert gen.sync() == 0.0 and len(gen.vllm.loads) == 1  # same version: nothing to load
    model.changed()  # a train step
    gen.generate([[3]], cfg, seed=3)
    assert len(gen.vllm.loads) == 2


def test_vllm_generator_needs_a_whole_model_rank(monkeypatch, hf):
    monkeypatch.setattr(vg, "VllmEngine", FakeEngine)
    model = RankModel.from_hf(hf, Tok(), False)
    model.groups.tp = 2  # as a tp rank would report
    with pytest.raises(AssertionError, match="whole models"):
        vg.VllmGenerator(model, seed=0, sleeps=False)


def test_a_sync_is_checked_when_a_call_asks_and_its_error_names_the_calls(monkeypatch, hf):
    monkeypatch.setattr(vg, "VllmEngine", FakeEngine)
    model = RankModel.from_hf(hf, Tok(), False)
    unchecked = vg.VllmGenerator(model, seed=0, sleeps=False)  # check_sync: false everywhere
    unchecked.vllm.held = _differing(model)
    unchecked.sync()
    assert unchecked.vllm.checks == [(False, frozenset())]
    gen = vg.VllmGenerator(model, seed=0, sleeps=False, checked_by=("gen", "eval_gen"))
    gen.vllm.held = _differing(model)
    with pytest.raises(RayhfError) as info:
        gen.sync()
    assert gen.vllm.checks == [(True, frozenset())]  # an untied head: vLLM must hold it
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith("vLLM weight sync: model.norm.weight differs")
    assert msg.endswith(
        "; set engines.gen.check_sync and engines.eval_gen.check_sync: false to skip this check"
    )
    gen.vllm.held = sc.HeldWeights("LlamaForCausalLM", (), ())
    assert gen.sync() > 0  # a failed sync is not taken for done: the next one loads again
    assert len(gen.vllm.loads) == 2 and gen.sync() == 0.0


def test_a_tied_head_need_not_be_held_by_vllm(monkeypatch):
    monkeypatch.setattr(vg, "VllmEngine", FakeEngine)
    model = RankModel.from_hf(tiny_model("llama", {"n_heads": 4, "tied": True}), Tok(), False)
    gen = vg.VllmGenerator(model, seed=0, sleeps=False, checked_by=("gen",))
    gen.vllm.held = sc.HeldWeights("LlamaForCausalLM", (), ())
    gen.sync()
    assert gen.vllm.checks == [(True, frozenset({"lm_head.weight"}))]


def _differing(model: RankModel) -> sc.HeldWeights:
    """vLLM's report of a sync whose norm weight came out one value off."""
    norm = model.full_state()["model.norm.weight"].clone()
    norm[0] += 1
    held = sc.Held(sc.Group("model.norm.weight", ("model.norm.weight",)), norm.dtype,
                   sc.checksum(norm))  # fmt: skip
    return sc.HeldWeights("LlamaForCausalLM", (held,), ())
