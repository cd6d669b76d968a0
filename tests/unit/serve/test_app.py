"""The Ray Serve application's pure parts (``rayhf.serve.app``): its arguments, the engine's
view of a request, responses and stream events, and error bodies. The FastAPI app answers
unknown routes without a replica; building the application starts no Ray."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError

from rayhf.errors import RayhfError
from rayhf.serve.app import (
    ServeConfig,
    Unauthorized,
    api,
    build_app,
    chat_events,
    chat_response,
    check_api_key,
    completion_events,
    completion_response,
    parse_args,
    sampling_spec,
    usage_of,
    validation_error_response,
)
from rayhf.serve.engine import EngineOutput, SamplingSpec, TokenLogprob
from rayhf.serve.protocol import ChatCompletionRequest, CompletionRequest

OUTS = [
    EngineOutput((5, 6, 2), ("1", " 2", ""), "stop", 4),
    EngineOutput((7,), ("x",), "length", 3),
]
PER_PROMPT = [[o] for o in OUTS]  # two prompts, n = 1
TOP = ((("1", -0.1), ("2", -2.5)), (("3", -0.5), (" ", -1.0)), (("</s>", -0.2), ("x", -3.0)))
WITH_LOGPROBS = EngineOutput(
    (5, 6, 2), ("1", " 2", ""), "stop", 4,
    tuple(TokenLogprob(t, lp, top) for t, lp, top in
          zip(("1", " 2", "</s>"), (-0.1, -1.5, float("-inf")), TOP, strict=True)),
)  # fmt: skip


@pytest.mark.parametrize(
    "args,message",
    [
        ({}, "serve args: checkpoint: Field required"),
        ({"checkpoint": "c", "num_replicas": 0}, "serve args: num_replicas: Input should be "
                                                 "greater than 0"),
        ({"checkpoint": "c", "default_max_tokens": 300}, "serve args: args: Value error, "
                                                         "default_max_tokens must be <="),
        ({"checkpoint": "c", "bogus": 1}, "serve args: bogus: Extra inputs are not permitted"),
    ],
)  # fmt: skip
def test_bad_args_are_one_line_naming_the_field(args, message):
    with pytest.raises(RayhfError) as err:
        parse_args(args)
    assert str(err.value).startswith(message)


def test_the_served_model_id_and_queue_depth_come_from_the_args():
    cfg = parse_args({"checkpoint": "/runs/x/step_000010/actor", "max_batch_size": 4})
    assert isinstance(cfg, ServeConfig) and cfg.served_model_id == "actor"
    assert cfg.max_ongoing_requests == 8
    assert parse_args({"checkpoint": "c", "model_id": "policy"}).served_model_id == "policy"


def test_temperature_zero_is_greedy_and_missing_fields_take_the_server_s_defaults():
    cfg = parse_args({"checkpoint": "c", "default_max_tokens": 7})
    greedy = CompletionRequest(prompt="a", temperature=0, top_k=-1, stop="\n", seed=5)
    assert sampling_spec(greedy, cfg) == SamplingSpec(
        max_tokens=7, greedy=True, temperature=1.0, top_k=0, top_p=1.0, seed=5, stop=("\n",)
    )
    asked = CompletionRequest(prompt="a", n=3, logprobs=0)
    assert (sampling_spec(asked, cfg).n, sampling_spec(asked, cfg).logprobs) == (3, 0)
    chat = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
         "max_completion_tokens": 3, "logprobs": True, "top_logprobs": 4}
    )  # fmt: skip
    assert (sampling_spec(chat, cfg).max_tokens, sampling_spec(chat, cfg).logprobs) == (3, 4)
    sampled = CompletionRequest(prompt="a", temperature=0.5, top_k=3, top_p=0.9, max_tokens=2)
    assert sampling_spec(sampled, cfg) == SamplingSpec(2, False, 0.5, 3, 0.9)


def test_responses_carry_every_choice_and_the_usage():
    assert usage_of(PER_PROMPT).model_dump() == {
        "prompt_tokens": 7, "completion_tokens": 4, "total_tokens": 11,
    }  # fmt: skip
    response = completion_response("cmpl-1", "actor", PER_PROMPT)
    assert [(c.index, c.text, c.finish_reason) for c in response.choices] == [
        (0, "1 2", "stop"), (1, "x", "length"),
    ]  # fmt: skip
    assert response.model == "actor" and response.object == "text_completion"
    chat = chat_response("chat-1", "actor", OUTS[:1])
    assert chat.choices[0].message.model_dump() == {"role": "assistant", "content": "1 2"}
    assert chat.usage.total_tokens == 7 and chat.choices[0].logprobs is None


def test_n_samples_are_choices_prompt_times_n_plus_j_and_the_prompt_counts_once():
    two = [[OUTS[0], OUTS[0]], [OUTS[1], OUTS[1]]]  # two prompts, n = 2
    response = completion_response("cmpl-1", "actor", two)
    assert [(c.index, c.text) for c in response.choices] == [
        (0, "1 2"), (1, "1 2"), (2, "x"), (3, "x"),
    ]  # fmt: skip
    assert response.usage.model_dump() == {
        "prompt_tokens": 7, "completion_tokens": 8, "total_tokens": 15,
    }  # fmt: skip
    chat = chat_response("chat-1", "actor", [OUTS[0], OUTS[1]])
    assert [c.index for c in chat.choices] == [0, 1] and chat.usage.prompt_tokens == 4


def test_log_probs_in_openai_s_two_formats():
    chat = chat_response("chat-1", "actor", [WITH_LOGPROBS]).model_dump()["choices"][0]
    first, _, last = chat["logprobs"]["content"]
    assert first == {
        "token": "1", "logprob": -0.1, "bytes": [49],
        "top_logprobs": [{"token": "1", "logprob": -0.1, "bytes": [49]},
                         {"token": "2", "logprob": -2.5, "bytes": [50]}],
    }  # fmt: skip
    assert last["logprob"] == -9999.0, "-inf is written as vLLM writes it"
    [choice] = completion_response("cmpl-1", "actor", [[WITH_LOGPROBS]]).model_dump()["choices"]
    assert choice["logprobs"] == {
        "text_offset": [0, 1, 3],
        "token_logprobs": [-0.1, -1.5, -9999.0],
        "tokens": ["1", " 2", "</s>"],
        "top_logprobs": [{"1": -0.1, "2": -2.5}, {" 2": -1.5, "3": -0.5, " ": -1.0},
                         {"</s>": -0.2, "x": -3.0}],
    }  # fmt: skip


def test_with_log_probs_a_stream_has_a_chunk_per_token_carrying_its_log_probs():
    chunks = _events(completion_events("cmpl-1", "actor", [[WITH_LOGPROBS]], False))
    got = [(c["choices"][0]["text"], c["choices"][0]["logprobs"]) for c in chunks]
    assert [text for text, _ in got] == ["1", " 2", "", ""]
    assert [lp["text_offset"] for _, lp in got[:3]] == [[0], [1], [3]] and got[3][1] is None
    chat = _events(chat_events("chat-1", "actor", [WITH_LOGPROBS, OUTS[1]], False))
    tokens = [
        (c["choices"][0]["index"], [t["token"] for t in c["choices"][0]["logprobs"]["content"]])
        for c in chat if c["choices"][0]["logprobs"]
    ]  # fmt: skip
    assert tokens == [(0, ["1"]), (0, [" 2"]), (0, ["</s>"])]
    assert [c["choices"][0]["index"] for c in chat] == [0] * 5 + [1] * 3


def _events(stream) -> list:
    events = list(stream)
    assert events[-1] == "data: [DONE]\n\n" and all(e.endswith("\n\n") for e in events)
    return [json.loads(e.removeprefix("data: ")) for e in events[:-1]]


def test_completion_events_replay_each_choice_s_pieces_then_its_finish():
    chunks = _events(completion_events("cmpl-1", "actor", PER_PROMPT, include_usage=True))
    firsts = [c["choices"][0] for c in chunks[:-1]]
    texts = [(f["index"], f["text"], f["finish_reason"]) for f in firsts]
    assert texts == [
        (0, "1", None), (0, " 2", None), (0, "", "stop"), (1, "x", None), (1, "", "length"),
    ]  # fmt: skip
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] == 11
    assert {c["id"] for c in chunks} == {"cmpl-1"} and len({c["created"] for c in chunks}) == 1
    plain = _events(completion_events("cmpl-1", "actor", PER_PROMPT, include_usage=False))
    assert all(c.get("usage") is None for c in plain) and len(plain) == 5


def test_chat_events_open_with_the_role_and_close_with_an_empty_delta():
    chunks = _events(chat_events("chat-1", "actor", OUTS[:1], include_usage=True))
    deltas = [(c["choices"][0]["delta"], c["choices"][0]["finish_reason"]) for c in chunks[:-1]]
    assert deltas == [
        ({"role": "assistant", "content": ""}, None), ({"content": "1"}, None),
        ({"content": " 2"}, None), ({}, "stop"),
    ]  # fmt: skip
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)


def _error(body: str, model=CompletionRequest) -> dict:
    with pytest.raises(ValidationError) as err:
        model.model_validate_json(body)
    response = validation_error_response(list(err.value.errors()))
    assert response.status_code == 400
    return json.loads(response.body)["error"]


def test_a_bad_body_is_a_400_naming_the_field_or_the_json():
    assert _error('{"prompt": "x", "temperature": -1}') == {
        "message": "temperature: Input should be greater than or equal to 0",
        "type": "invalid_request_error", "code": "invalid_value", "param": "temperature",
    }  # fmt: skip
    broken = _error("{bad")
    assert broken["code"] == "invalid_json" and broken["param"] is None
    assert broken["message"].startswith("the body is not valid JSON: ")
    nested = _error('{"messages": [{"role": "user"}]}', ChatCompletionRequest)
    assert nested["message"] == "messages.0.content: Field required"
    assert nested["param"] == "messages"


def test_unknown_routes_and_methods_get_openai_style_errors():
    client = TestClient(api)
    missing = client.get("/v2/models")
    assert missing.status_code == 404
    assert missing.json()["error"] == {
        "message": "no route GET /v2/models; see /v1/models", "type": "not_found_error",
        "code": "unknown_route", "param": None,
    }  # fmt: skip
    wrong = client.post("/v1/models")
    assert wrong.status_code == 405 and wrong.json()["error"]["code"] == "http_405"


def test_building_the_app_checks_the_checkpoint_before_ray_starts(tmp_path: Path, monkeypatch):
    with pytest.raises(RayhfError, match=r"checkpoint: .* is not a directory"):
        build_app({"checkpoint": str(tmp_path / "missing")})
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "tokenizer.json").write_text("{}")
    app = build_app({"checkpoint": str(tmp_path), "num_replicas": 2})
    assert type(app).__name__ == "Application"
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(RayhfError, match="engine: vllm needs vLLM"):
        build_app({"checkpoint": str(tmp_path / "missing"), "engine": "vllm"})


@pytest.mark.parametrize(
    "header", [None, "", "Bearer", "Bearer wrong", "s3cret", "Basic s3cret", "Bearer s3cret2"]
)
def test_a_request_without_the_api_key_is_refused(header):
    with pytest.raises(Unauthorized, match="Authorization: Bearer <key>"):
        check_api_key("s3cret", header)


def test_the_api_key_as_a_bearer_token_passes_and_no_key_lets_everything_through():
    check_api_key("s3cret", "Bearer s3cret")
    check_api_key("s3cret", "bearer  s3cret ")
    check_api_key(None, None)
    assert "s3cret" not in repr(ServeConfig(checkpoint="c", api_key="s3cret"))
    with pytest.raises(RayhfError, match="api_key: String should have at least 1 character"):
        parse_args({"checkpoint": "c", "api_key": ""})


def test_the_cli_takes_the_api_key_from_the_environment(monkeypatch, tmp_path: Path):
    from typer.testing import CliRunner

    from rayhf.serve import cli

    seen = {}
    monkeypatch.setattr("rayhf.serve.engine.check_checkpoint", lambda path: None)  # serve reads it
    monkeypatch.setattr("rayhf.serve.app.serve_checkpoint", lambda c, **kw: seen.update(kw))
    result = CliRunner().invoke(cli.app, [str(tmp_path)], env={"RAYHF_API_KEY": "from-env"})
    assert result.exit_code == 0, result.output
    assert seen["api_key"] == "from-env"
    CliRunner().invoke(cli.app, [str(tmp_path), "--api-key", "flag"], env={"RAYHF_API_KEY": "e"})
    assert seen["api_key"] == "flag"
    with pytest.raises(RayhfError, match="serve --api-key: the vllm engine"):
        build_app({"checkpoint": "c", "engine": "vllm", "api_key": "k"})
