"""The policy server over real HTTP: a tiny checkpoint served by Ray Serve on 127.0.0.1.

One Serve application for the module (Ray startup and the replica's imports cost ~15 s); every
test talks to it with ``requests``. Greedy outputs are compared with ``native.generate`` on the
same checkpoint, and usage counts with the tokenizer's. The pure pieces (detokenization,
request grouping, the config files) are tested without Ray.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml
from conftest import needs_vllm

from rayhf.errors import RayhfError
from rayhf.models.files import quiet_transformers
from rayhf.models.hf import (
    ModelInit,
    build_model,
    hf_config,
    load_model,
    save_model,
)
from rayhf.sampling import GenerationConfig, generate
from rayhf.serve.engine import EngineRequest, SamplingSpec, detokenize, group_requests
from rayhf.tasks.demo import build_tokenizer

REPO = Path(__file__).resolve().parents[2]
MAX_PROMPT_TOKENS = 32
MAX_TOKENS = 32
TIMEOUT = 60


def make_checkpoint(out: Path) -> Path:
    """A ~100k-parameter random Llama with the demo char tokenizer, saved like a training actor
    (head_dim 32: vLLM's CPU attention runs it too)."""
    quiet_transformers()
    tok = build_tokenizer()
    ids = (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id)
    cfg = hf_config(ModelInit(hidden_size=64, n_layers=2, n_heads=2), len(tok), *ids)
    cfg.initializer_range = 0.5  # peaked logits: greedy text varies and ties are unlikely
    return save_model(build_model(cfg, value_head=False, seed=0), out, tok)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("serve") / "tiny-policy")


# two LoRA adapters served beside the checkpoint: (rank, target modules) each
ADAPTERS = {"digits-r4": (4, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                              "down_proj"]), "digits-r2": (2, ["q_proj", "v_proj"])}  # fmt: skip


@pytest.fixture(scope="module")
def adapters(checkpoint) -> dict[str, tuple[Path, Path]]:
    """Each adapter's PEFT directory (its B drawn at random, so it changes the output) and
    the checkpoint with it merged into the weights (PEFT's ``merge_and_unload``)."""
    import torch
    from peft import LoraConfig, get_peft_model

    out = {}
    for i, (name, (rank, targets)) in enumerate(ADAPTERS.items()):
        torch.manual_seed(i)
        base = load_model(checkpoint, value_head=False, field="checkpoint")
        config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets,
                            init_lora_weights=False)  # fmt: skip
        peft = get_peft_model(base, config)
        peft.save_pretrained(checkpoint.parent / name)
        merged = save_model(peft.merge_and_unload(), checkpoint.parent / f"{name}-merged")
        out[name] = (checkpoint.parent / name, merged)
    return out


@pytest.fixture(scope="module")
def server(checkpoint, adapters):
    """Base URL of the app: Ray (2 CPUs), Serve HTTP on a free port, one replica."""
    import ray
    from ray import serve

    from rayhf.serve.app import build_app

    owns_ray = not ray.is_initialized()
    if owns_ray:
        ray.init(num_cpus=2, include_dashboard=False, configure_logging=False, log_to_driver=False)
    port = free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        args = {
            "checkpoint": str(checkpoint),
            "max_prompt_tokens": MAX_PROMPT_TOKENS,
            "max_tokens": MAX_TOKENS,
            "max_batch_size": 16,
            "batch_wait_timeout_s": 0.05,
            "adapters": {name: str(where) for name, (where, _) in adapters.items()},
        }
        serve.run(build_app(args), name="policy", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        if owns_ray:
            ray.shutdown()


@pytest.fixture(scope="module")
def reference(checkpoint):
    """Greedy ``native.generate`` on the checkpoint: prompt text -> (tokens, text, finished)."""
    return greedy_reference(checkpoint)


def greedy_reference(checkpoint: Path):
    """Greedy ``native.generate`` on ``checkpoint``: prompt text -> (tokens, text, finished)."""
    model = load_model(checkpoint, value_head=False, field="checkpoint")
    tok = build_tokenizer()

    def run(prompt: str, max_tokens: int) -> tuple[list[int], str, bool]:
        ids = [tok.bos_token_id, *tok.encode(prompt, add_special_tokens=False)]
        cfg = GenerationConfig(max_new_tokens=max_tokens, greedy=True)
        out = generate(model, [ids], cfg, tok.eos_token_id, tok.pad_token_id)
        text = tok.decode(out.tokens[0], skip_special_tokens=True)
        return out.tokens[0], text, out.finished[0]

    return run


def post(server: str, path: str, body: Any) -> requests.Response:
    return requests.post(f"{server}{path}", json=body, timeout=TIMEOUT)


def sse_chunks(resp: requests.Response) -> list[Any]:
    """The JSON payloads of an SSE response; the last event must be [DONE]."""
    events = [line[len("data: ") :] for line in resp.text.split("\n\n") if line]
    assert events[-1] == "[DONE]", events[-3:]
    return [json.loads(e) for e in events[:-1]]


def assert_error(resp: requests.Response, status: int, code: str | None = None) -> dict:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert error["message"] and error["type"], error
    if code is not None:
        assert error["code"] == code, error
    return error


def test_models(server, checkpoint):
    resp = requests.get(f"{server}/v1/models", timeout=TIMEOUT)
    assert resp.status_code == 200
    body = resp.json()
    assert body["object"] == "list"
    assert [m["id"] for m in body["data"]] == [checkpoint.name, *ADAPTERS]


def test_each_adapter_generates_the_tokens_of_its_merged_model(server, reference, adapters):
    prompts = ["1 2 3 =", "9 8 7 6 5 4 =", "4 4 ="]
    texts = {}
    for name, (_, merged) in adapters.items():
        want = greedy_reference(merged)
        for prompt in prompts:
            body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "model": name}
            resp = post(server, "/v1/completions", body)
            assert resp.status_code == 200, resp.text
            assert resp.json()["model"] == name
            texts[name, prompt] = resp.json()["choices"][0]["text"]
            assert texts[name, prompt] == want(prompt, 12)[1], (name, prompt)
    for name in ADAPTERS:  # each adapter changes what is generated
        assert any(texts[name, p] != reference(p, 12)[1] for p in prompts), name


def test_completion_usage_and_finish_reason(server, reference):
    prompt = "3 1 4 1 ="
    resp = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 10, "temperature": 0})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    [choice] = body["choices"]
    tokens, _, finished = reference(prompt, 10)
    tok = build_tokenizer()
    n_prompt = 1 + len(tok.encode(prompt, add_special_tokens=False))  # bos + characters
    assert body["usage"] == {
        "prompt_tokens": n_prompt,
        "completion_tokens": len(tokens),
        "total_tokens": n_prompt + len(tokens),
    }
    assert choice["finish_reason"] == ("stop" if finished else "length")


@pytest.mark.parametrize("prompt", ["1 2 3 =", "9 8 7 6 5 4 =", ""])
def test_greedy_equals_native_generate(server, reference, prompt):
    resp = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 12, "temperature": 0})
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["text"] == reference(prompt, 12)[1]


def test_prompt_list_is_one_choice_per_prompt(server, reference):
    prompts = ["1 2 =", "5 5 5 5 ="]
    resp = post(server, "/v1/completions", {"prompt": prompts, "max_tokens": 6, "temperature": 0})
    assert resp.status_code == 200, resp.text
    choices = resp.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1]
    assert [c["text"] for c in choices] == [reference(p, 6)[1] for p in prompts]


def test_streaming_completion_matches_whole(server):
    body = {"prompt": "2 7 1 8 =", "max_tokens": 16, "temperature": 0}
    whole = post(server, "/v1/completions", body).json()["choices"][0]
    resp = post(server, "/v1/completions", {**body, "stream": True})
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-type"].startswith("text/event-stream")
    chunks = sse_chunks(resp)
    assert all(c["object"] == "text_completion" for c in chunks)
    assert len(chunks) > 2  # streamed in pieces, not one blob
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == whole["finish_reason"]
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])


def test_stream_usage_chunk(server):
    body = {"prompt": "1 =", "max_tokens": 4, "temperature": 0, "stream": True}
    chunks = sse_chunks(
        post(server, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
    )
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["prompt_tokens"] == 4


def test_stop_string_cuts_text(server):
    body = {"prompt": "3 1 4 1 =", "max_tokens": 10, "temperature": 0}
    text = post(server, "/v1/completions", body).json()["choices"][0]["text"]
    assert len(text) >= 3, text
    stop = text[2]
    cut = post(server, "/v1/completions", {**body, "stop": [stop]}).json()["choices"][0]
    assert cut["text"] == text[: text.index(stop)]
    assert cut["finish_reason"] == "stop"


def test_seeded_sampling_is_reproducible(server):
    body = {"prompt": "4 4 =", "max_tokens": 12, "temperature": 1.0, "top_k": 5, "seed": 123}
    texts = {post(server, "/v1/completions", body).json()["choices"][0]["text"] for _ in range(3)}
    assert len(texts) == 1


def test_chat_completion(server):
    body = {"messages": [{"role": "user", "content": "1 2 3 ="}], "max_tokens": 8, "temperature": 0}
    resp = post(server, "/v1/chat/completions", body)
    assert resp.status_code == 200, resp.text
    whole = resp.json()
    assert whole["object"] == "chat.completion" and whole["id"].startswith("chatcmpl-")
    [choice] = whole["choices"]
    assert choice["message"]["role"] == "assistant"
    assert choice["finish_reason"] in ("stop", "length")
    # No chat template on the char tokenizer: "user: 1 2 3 =\nassistant:" (+ bos)
    assert whole["usage"]["prompt_tokens"] == 1 + len("user: 1 2 3 =\nassistant:")

    chunks = sse_chunks(post(server, "/v1/chat/completions", {**body, "stream": True}))
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert streamed == choice["message"]["content"]
    assert chunks[-1]["choices"][0] == {
        "index": 0,
        "delta": {},
        "logprobs": None,
        "finish_reason": choice["finish_reason"],
    }


@pytest.mark.parametrize(
    ("data", "status", "code"),
    [
        ('{"prompt": "1 2", ', 400, "invalid_json"),
        ("", 400, "invalid_json"),
        ("[1, 2]", 400, "invalid_value"),
        ('{"max_tokens": 4}', 400, "invalid_value"),
        ('{"prompt": 12}', 400, "invalid_value"),
        ('{"prompt": "1", "max_tokens": "many"}', 400, "invalid_value"),
        ('{"prompt": "1", "temperature": -1}', 400, "invalid_value"),
        ('{"prompt": "1", "n": 0}', 400, "invalid_value"),
        ('{"prompt": "1", "n": 17}', 400, "too_many_samples"),
        ('{"prompt": "1", "logprobs": 21}', 400, "invalid_value"),
        ('{"prompt": "1", "best_of": 2}', 400, "invalid_value"),
        ('{"prompt": []}', 400, "invalid_value"),
        ('{"prompt": "' + "1 " * MAX_PROMPT_TOKENS + '"}', 400, "context_length_exceeded"),
        ('{"prompt": "1", "max_tokens": ' + str(MAX_TOKENS + 1) + "}", 400, "max_tokens_exceeded"),
        ('{"prompt": "1", "model": "gpt-4"}', 404, "model_not_found"),
    ],
)
def test_bad_completion_requests(server, data, status, code):
    resp = requests.post(
        f"{server}/v1/completions",
        data=data,
        headers={"content-type": "application/json"},
        timeout=TIMEOUT,
    )
    assert_error(resp, status, code)


def test_body_is_json_whatever_the_content_type(server):
    # curl -d sends application/x-www-form-urlencoded unless told otherwise
    data = json.dumps({"prompt": "1 2", "max_tokens": 2})
    resp = requests.post(f"{server}/v1/completions", data=data, timeout=TIMEOUT)
    assert resp.status_code == 200, resp.text
    error = assert_error(post(server, "/v1/completions", {"prompt": [1, 2]}), 400)
    assert error["param"] == "prompt"


def test_bad_requests_elsewhere_then_still_serving(server):
    assert_error(requests.get(f"{server}/v1/nope", timeout=TIMEOUT), 404, "unknown_route")
    assert_error(requests.get(f"{server}/v1/completions", timeout=TIMEOUT), 405)
    error = assert_error(post(server, "/v1/chat/completions", {"messages": [{"role": "x"}]}), 400)
    assert "messages.0" in error["message"]
    assert_error(post(server, "/v1/chat/completions", {"messages": []}), 400, "invalid_value")
    assert requests.get(f"{server}/v1/models", timeout=TIMEOUT).status_code == 200
    assert post(server, "/v1/completions", {"prompt": "1", "max_tokens": 2}).status_code == 200


def test_concurrent_requests_are_batched(server):
    before = requests.get(f"{server}/v1/stats", timeout=TIMEOUT).json()
    n = 32
    start = threading.Barrier(n)
    statuses: list[int] = []

    def one(i: int) -> None:
        start.wait()
        body = {"prompt": f"{i % 10} {i // 10} =", "max_tokens": 8, "temperature": 0}
        statuses.append(post(server, "/v1/completions", body).status_code)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    assert statuses == [200] * n
    after = requests.get(f"{server}/v1/stats", timeout=TIMEOUT).json()
    assert after["requests"] - before["requests"] == n
    batches = after["batches"] - before["batches"]
    assert batches < n, after  # some requests shared a forward pass
    assert after["largest_batch"] > 1


def test_detokenize_pieces_join_to_text_and_stop():
    tok = build_tokenizer()
    ids = [*tok.encode("12 ab3", add_special_tokens=False), tok.eos_token_id]

    def decode(t: list[int]) -> str:
        return tok.decode(t, skip_special_tokens=True)

    pieces, n, stopped = detokenize(decode, ids, ())
    assert "".join(pieces) == "12 ab3" and n == len(ids) and not stopped
    pieces, n, stopped = detokenize(decode, ids, ("b3", " a"))
    assert "".join(pieces) == "12" and n == 4 and stopped  # " a" completes at token 4
    assert detokenize(decode, [], ("x",)) == ([], 0, False)


def test_group_requests():
    def req(adapter: str | None = None, **kw: Any) -> EngineRequest:
        return EngineRequest((1,), SamplingSpec(max_tokens=4, **kw), adapter)

    reqs = [
        req(greedy=True),
        req(),
        req(seed=1),
        req(greedy=True, temperature=0.5),
        req(),
        req(seed=1),
        req("a", greedy=True),  # an adapter's requests are generated apart
        req("a", greedy=True),
    ]
    groups = list(group_requests(reqs).values())
    assert groups == [[0, 3], [1, 4], [2], [5], [6, 7]]


def test_deploy_config_passes_serve_schema():
    from ray.serve.schema import ServeDeploySchema

    from rayhf.serve.app import build_app, parse_args

    raw = yaml.safe_load((REPO / "deployments" / "policy.yaml").read_text())
    schema = ServeDeploySchema.model_validate(raw)
    [application] = schema.applications
    assert application.import_path == "rayhf.serve.app:build_app"
    module, attr = application.import_path.split(":")
    assert getattr(__import__(module, fromlist=[attr]), attr) is build_app
    cfg = parse_args(application.args)
    assert cfg.engine == "native"


def test_bad_args_and_checkpoints_are_one_line_errors(tmp_path, checkpoint, monkeypatch):
    from rayhf.serve.app import build_app

    with pytest.raises(RayhfError, match="checkpoint: Field required"):
        build_app({})
    with pytest.raises(RayhfError, match="max_batch_size"):
        build_app({"checkpoint": str(checkpoint), "max_batch_size": 0})
    with pytest.raises(RayhfError, match="not a directory"):
        build_app({"checkpoint": str(tmp_path / "missing")})
    with pytest.raises(RayhfError, match=r"no config\.json"):
        build_app({"checkpoint": str(tmp_path)})
    with pytest.raises(RayhfError, match=r"^--adapter a: .* has no adapter_config\.json"):
        build_app({"checkpoint": str(checkpoint), "adapters": {"a": str(tmp_path)}})
    with pytest.raises(RayhfError, match=r"adapters: 'tiny-policy' is the checkpoint's model id"):
        build_app({"checkpoint": str(checkpoint), "adapters": {"tiny-policy": str(tmp_path)}})
    real = importlib.util.find_spec  # as if vLLM were not installed
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a)
    )
    with pytest.raises(RayhfError, match=r"rayhf\[vllm\]"):
        build_app({"checkpoint": str(checkpoint), "engine": "vllm"})


def test_cli_rejects_a_non_model_directory(tmp_path):
    from typer.testing import CliRunner

    from rayhf.serve.cli import app

    result = CliRunner().invoke(app, [str(tmp_path), "--port", "8123"])
    assert isinstance(result.exception, RayhfError)
    assert "no config.json" in str(result.exception)
    assert "\n" not in str(result.exception)


def test_with_an_api_key_v1_requests_need_it_and_health_does_not(server, checkpoint):
    """A second app on the same Serve instance, under /keyed, started with ``api_key``: no key
    or a wrong one is a 401 in OpenAI's error shape; the key as a bearer token is served."""
    from ray import serve

    from rayhf.serve.app import build_app

    args = {"checkpoint": str(checkpoint), "max_prompt_tokens": MAX_PROMPT_TOKENS,
            "max_tokens": MAX_TOKENS, "api_key": "s3cret"}  # fmt: skip
    serve.run(build_app(args), name="keyed", route_prefix="/keyed")
    try:
        base = f"{server}/keyed"
        body = {"prompt": "1 2 =", "max_tokens": 4, "temperature": 0}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            resp = requests.post(f"{base}/v1/completions", json=body, headers=headers,
                                 timeout=TIMEOUT)  # fmt: skip
            error = assert_error(resp, 401, "invalid_api_key")
            assert error["type"] == "authentication_error" and "s3cret" not in resp.text
            assert resp.headers["WWW-Authenticate"] == "Bearer"
        assert_error(requests.get(f"{base}/v1/models", timeout=TIMEOUT), 401, "invalid_api_key")
        assert requests.get(f"{base}/health", timeout=TIMEOUT).status_code == 200
        good = {"Authorization": "Bearer s3cret"}
        resp = requests.post(f"{base}/v1/completions", json=body, headers=good, timeout=TIMEOUT)
        assert (
            resp.status_code == 200
            and resp.json()["choices"][0]["text"]
            == post(server, "/v1/completions", body).json()["choices"][0]["text"]
        )  # the same checkpoint, greedy: the same text
        models = requests.get(f"{base}/v1/models", headers=good, timeout=TIMEOUT)
        assert models.json()["data"][0]["id"] == checkpoint.name
    finally:
        serve.delete("keyed")


# -- the OpenAI surface through the `openai` client (issue 62) --------------------------------


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=TIMEOUT)


def _token_ids(tokens: list[str]) -> list[int]:
    """Token strings back to ids: the char tokenizer decodes each id to its own string."""
    tok = build_tokenizer()
    ids = {tok.decode([i]): i for i in range(len(tok))}
    assert len(ids) == len(tok)
    return [ids[t] for t in tokens]


def test_openai_client_n_logprobs_seed_and_max_completion_tokens_on_chat(client):
    ask = [{"role": "user", "content": "3 1 4 ="}]
    kw: dict[str, Any] = {"model": "tiny-policy", "messages": ask, "n": 4, "logprobs": True,
                          "top_logprobs": 5, "seed": 7, "max_tokens": 10}  # fmt: skip
    first = client.chat.completions.create(**kw)
    assert [c.index for c in first.choices] == [0, 1, 2, 3]
    contents = [[t.token for t in c.logprobs.content] for c in first.choices]
    assert len(set(map(tuple, contents))) > 1, "four samples, not one repeated"
    specials = set(build_tokenizer().all_special_tokens)  # in the tokens, not in the text
    for choice in first.choices:
        entries = choice.logprobs.content
        text = "".join(e.token for e in entries if e.token not in specials)
        assert text == choice.message.content
        assert entries and all(len(e.top_logprobs) == 5 and e.logprob <= 0 for e in entries)
        assert all(e.bytes == list(e.token.encode()) for e in entries)
    usage = first.usage
    assert usage.prompt_tokens == 1 + len("user: 3 1 4 =\nassistant:"), "the prompt counted once"
    assert usage.completion_tokens == sum(len(c) for c in contents)
    again = client.chat.completions.create(**kw)
    assert [[t.token for t in c.logprobs.content] for c in again.choices] == contents
    capped = client.chat.completions.create(
        model="tiny-policy", messages=ask, max_completion_tokens=3, temperature=0
    )
    assert capped.usage.completion_tokens <= 3 and capped.choices[0].logprobs is None


def test_openai_client_completions_logprobs_prompt_lists_stop_and_streams(client):
    prompts = ["1 2 =", "5 5 5 ="]
    kw: dict[str, Any] = {"model": "tiny-policy", "prompt": prompts, "n": 2, "logprobs": 5,
                          "max_tokens": 8, "seed": 3, "temperature": 0.8}  # fmt: skip
    whole = client.completions.create(**kw)
    assert [c.index for c in whole.choices] == [0, 1, 2, 3]  # prompt * n + sample
    for c in whole.choices:
        lp = c.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs)
        for i, (token, top) in enumerate(zip(lp.tokens, lp.top_logprobs, strict=True)):
            assert 5 <= len(top) <= 6 and token in top  # the sampled token, then the top 5
            assert lp.text_offset[i] == sum(len(t) for t in lp.tokens[:i])
    texts, tokens = ["", "", "", ""], [[], [], [], []]
    for chunk in client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            texts[c.index] += c.text
            tokens[c.index] += c.logprobs.tokens if c.logprobs else []
    assert texts == [c.text for c in whole.choices]
    assert tokens == [c.logprobs.tokens for c in whole.choices]
    # a stop string taken from greedy text, so that it occurs: the same request with it stops
    greedy = {"model": "tiny-policy", "prompt": prompts, "max_tokens": 8, "temperature": 0}
    greedy_texts = [c.text for c in client.completions.create(**greedy).choices]
    i = max(range(len(prompts)), key=lambda j: len(greedy_texts[j]))
    text = greedy_texts[i]
    assert len(text) >= 2, f"the greedy texts are too short to cut: {greedy_texts!r}"
    cut = client.completions.create(**{**greedy, "prompt": prompts[i], "stop": [text[1]]})
    assert cut.choices[0].text == text[: text.index(text[1])]
    assert cut.choices[0].finish_reason == "stop"


def test_openai_client_chat_stream_with_n_and_logprobs(client):
    ask = [{"role": "user", "content": "7 ="}]
    kw: dict[str, Any] = {"model": "tiny-policy", "messages": ask, "n": 2, "logprobs": True,
                          "top_logprobs": 2, "seed": 11, "max_tokens": 6}  # fmt: skip
    whole = client.chat.completions.create(**kw)
    texts, tokens, finish = ["", ""], [[], []], [None, None]
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            tokens[c.index] += [t.token for t in (c.logprobs.content if c.logprobs else [])]
            finish[c.index] = c.finish_reason or finish[c.index]
    assert texts == [c.message.content for c in whole.choices]
    assert tokens == [[t.token for t in c.logprobs.content] for c in whole.choices]
    assert finish == [c.finish_reason for c in whole.choices]


def test_served_log_probs_are_the_trainer_s(client, checkpoint):
    """Greedy and sampled (temperature 0.7) tokens from the server, then a training forward
    over prompt + tokens (``token_logprobs`` at temperature 1: the raw distribution): equal
    within the fp32 bound generation is held to against training (1e-4)."""
    import torch

    from rayhf.algorithms.lm import token_logprobs

    model = load_model(checkpoint, value_head=False, field="checkpoint").eval()
    tok = build_tokenizer()
    prompt = "9 8 7 ="
    ids = [tok.bos_token_id, *tok.encode(prompt, add_special_tokens=False)]
    for temperature in (0.0, 0.7):
        resp = client.completions.create(model="tiny-policy", prompt=prompt, max_tokens=12,
                                         temperature=temperature, seed=5, logprobs=3)  # fmt: skip
        lp = resp.choices[0].logprobs
        sampled = _token_ids(lp.tokens)
        with torch.no_grad():
            logits = model(torch.tensor([ids + sampled])).logits[:, len(ids) - 1 : -1]
        want = token_logprobs(logits, torch.tensor([sampled]))[0]
        torch.testing.assert_close(torch.tensor(lp.token_logprobs), want, atol=1e-4, rtol=0)


# What vLLM's server writes that rayhf does not: vLLM's extensions (token ids, stop reasons,
# prompt log-probs, transfer parameters, metrics) and OpenAI fields rayhf has no use for (all
# null or empty in vLLM's answers here).
VLLM_ONLY = {
    "stop_reason", "token_ids", "prompt_logprobs", "prompt_token_ids", "prompt_text",
    "routed_experts", "kv_transfer_params", "ec_transfer_params", "metrics", "service_tier",
    "system_fingerprint", "refusal", "annotations", "audio", "function_call", "reasoning",
    "tool_calls", "prompt_tokens_details", "completion_tokens_details",
}  # fmt: skip
# The chat rendering rayhf uses for a tokenizer without a template, as a template for vLLM.
SIMPLE_CHAT_JINJA = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
)


def _shape(x: Any, key: str = "") -> Any:
    """A JSON value's structure: dicts by key, lists as the union of their items' shapes,
    leaves as a type name (null: "null", which any shape matches). A completion's
    ``top_logprobs`` dicts are keyed by token: their shape is "token -> number"."""
    by_token = isinstance(x, list) and all(isinstance(d, dict) and "token" not in d for d in x)
    if key == "top_logprobs" and by_token:  # completions: {token: log-prob}
        ok = all(isinstance(v, float | int) for d in x for v in d.values())
        return ["token -> number" if ok else "token -> other"]
    if isinstance(x, dict):
        return {k: _shape(v, k) for k, v in x.items()}
    if isinstance(x, list):
        merged: Any = "null"
        for item in x:
            merged = _merge(merged, _shape(item))
        return [merged]
    if x is None:
        return "null"
    return "number" if isinstance(x, int | float) and not isinstance(x, bool) else type(x).__name__


def _merge(a: Any, b: Any) -> Any:
    if a == "null":
        return b
    if isinstance(a, dict) and isinstance(b, dict):
        return {k: _merge(a.get(k, "null"), b.get(k, "null")) for k in a.keys() | b.keys()}
    if isinstance(a, list) and isinstance(b, list):
        return [_merge(a[0], b[0])]
    return a


def _differences(ours: Any, theirs: Any, path: str = "") -> tuple[list[str], set[str]]:
    """(where rayhf's shape differs from vLLM's, the keys only vLLM writes)."""
    if "null" in (ours, theirs):
        return [], set()
    if isinstance(ours, dict) and isinstance(theirs, dict):
        wrong = [f"{path}.{k}: not in vLLM's" for k in ours.keys() - theirs.keys()]
        only = set(theirs.keys() - ours.keys())
        for k in ours.keys() & theirs.keys():
            w, o = _differences(ours[k], theirs[k], f"{path}.{k}")
            wrong += w
            only |= o
        return wrong, only
    if isinstance(ours, list) and isinstance(theirs, list):
        return _differences(ours[0], theirs[0], f"{path}[]")
    return ([] if ours == theirs else [f"{path}: {ours} vs vLLM's {theirs}"]), set()


def _answers(base: str, model: str) -> dict[str, Any]:
    """Chat and completions, whole and streamed, with n, logprobs, top_logprobs, seed, stop."""
    chat = {"model": model, "messages": [{"role": "user", "content": "3 1 4 ="}], "n": 2,
            "logprobs": True, "top_logprobs": 3, "seed": 7, "max_tokens": 5}  # fmt: skip
    comp = {"model": model, "prompt": ["1 2 =", "5 5 ="], "n": 2, "logprobs": 3, "seed": 7,
            "max_tokens": 5, "stop": ["zz"]}  # fmt: skip
    usage = {"stream": True, "stream_options": {"include_usage": True}}
    answers = {}
    for name, path, body in (("chat", "/v1/chat/completions", chat),
                             ("completion", "/v1/completions", comp)):  # fmt: skip
        whole = requests.post(f"{base}{path}", json=body, timeout=TIMEOUT)
        assert whole.status_code == 200, whole.text
        answers[name] = whole.json()
        answers[f"{name} chunks"] = sse_chunks(
            requests.post(f"{base}{path}", json={**body, **usage}, timeout=TIMEOUT)
        )
    return answers


@pytest.mark.slow
@needs_vllm
def test_responses_have_the_structure_of_vllm_s_server_on_the_same_checkpoint(
    server, checkpoint, tmp_path
):
    """vLLM's own OpenAI server (the CPU build, ~45 s to start) on the module's checkpoint and
    rayhf's, asked the same: every key rayhf writes is where vLLM writes it, with the same kind
    of value, and what rayhf leaves out is only vLLM's extensions (``VLLM_ONLY``)."""
    import os
    import subprocess
    import sys

    template = tmp_path / "chat.jinja"
    template.write_text(SIMPLE_CHAT_JINJA)
    port = free_port()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model",
           str(checkpoint), "--port", str(port), "--max-model-len", "128", "--dtype", "float32",
           "--chat-template", str(template), "--max-num-seqs", "8", "--enforce-eager",
           "--gpu-memory-utilization", "0.2", "--served-model-name", checkpoint.name]  # fmt: skip
    log = (tmp_path / "vllm.log").open("w")
    vllm = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while vllm.poll() is None and time.monotonic() < deadline:
            with contextlib.suppress(requests.RequestException):
                if requests.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            time.sleep(1.0)
        assert vllm.poll() is None, (tmp_path / "vllm.log").read_text()[-3000:]
        theirs = _answers(base, checkpoint.name)
    finally:
        vllm.terminate()
        vllm.wait(30)
    ours = _answers(server, checkpoint.name)
    for name in ours:
        wrong, only = _differences(_shape(ours[name]), _shape(theirs[name]), name)
        assert not wrong, wrong
        assert only <= VLLM_ONLY, only - VLLM_ONLY
    for name in ("chat", "completion"):
        assert [c["index"] for c in ours[name]["choices"]] == [
            c["index"] for c in theirs[name]["choices"]
        ]


def test_a_replica_killed_under_load_is_replaced_and_requests_after_it_succeed(server):
    """Last in this module: it kills the module's one replica. Serve's controller starts a new
    one; requests in flight at the kill may fail, every request after the new one is up must
    not."""
    import ray

    def replicas() -> list[str]:
        named = ray.util.list_named_actors(all_namespaces=True)
        return [a["name"] for a in named if a["name"].startswith("SERVE_REPLICA::")]

    (victim,) = replicas()
    stop = threading.Event()
    during: list[tuple[float, int]] = []  # (when it was sent, status; 0: no answer)
    body = {"prompt": "1 2 =", "max_tokens": 4}

    def load() -> None:
        while not stop.is_set():
            sent = time.monotonic()
            try:
                during.append((sent, post(server, "/v1/completions", body).status_code))
            except requests.RequestException:
                during.append((sent, 0))

    def served_again() -> list[int]:
        """Statuses of the requests sent since the first success sent after the kill."""
        back = min((t for t, code in during if t > killed and code == 200), default=None)
        return [code for t, code in during if back is not None and t >= back]

    threads = [threading.Thread(target=load) for _ in range(4)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
    killed = time.monotonic()
    while time.monotonic() < killed + 90 and len(served_again()) < 12:
        time.sleep(0.5)
    stop.set()
    for t in threads:
        t.join(TIMEOUT)
    again = served_again()
    assert len(again) >= 12 and again == [200] * len(again), f"after the kill: {during[-20:]}"
    after = [post(server, "/v1/completions", {"prompt": "3 =", "max_tokens": 2}) for _ in range(5)]
    assert [r.status_code for r in after] == [200] * 5
    (now,) = replicas()
    assert now != victim, "Serve replaced the replica"
    failed = sum(code != 200 for _, code in during)
    print(f"{len(during)} requests under load, {failed} failed (in flight at the kill)")
