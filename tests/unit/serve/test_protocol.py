"""The HTTP messages of the policy server (``rayhf.serve.protocol``): what requests accept and
refuse, and how responses and stream events are written."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from rayhf.serve.protocol import (
    SSE_DONE,
    ChatCompletionRequest,
    ChatDelta,
    ChatMessage,
    CompletionRequest,
    ModelCard,
    render_simple_chat,
    sse_event,
)


def test_a_completion_request_takes_one_prompt_or_a_list():
    assert CompletionRequest(prompt="1 2 =").prompts() == ["1 2 ="]
    request = CompletionRequest(prompt=["a", "b"], max_tokens=4, temperature=0)
    assert request.prompts() == ["a", "b"] and not request.stream and request.seed is None
    assert not request.include_usage() and request.stop_strings() == ()
    streamed = CompletionRequest(prompt="a", stream=True, stream_options={"include_usage": True})
    assert streamed.include_usage()
    assert CompletionRequest(prompt="a", stop="\n").stop_strings() == ("\n",)
    assert CompletionRequest(prompt="a", stop=["x", "y"]).stop_strings() == ("x", "y")


@pytest.mark.parametrize(
    "body,message",
    [
        ({"prompt": []}, "the prompt list is empty; send at least one prompt"),
        ({"prompt": "a", "n": 0}, "greater than or equal to 1"),
        ({"prompt": "a", "stop": ["a", "b", "c", "d", "e"]}, "stop takes at most 4"),
        ({"prompt": "a", "stop": ["a", ""]}, "stop takes at most 4 non-empty strings"),
        ({"prompt": "a", "logprobs": 21}, "less than or equal to 20"),
        ({"prompt": "a", "best_of": 2}, r"best_of\s+Extra inputs are not permitted"),
        ({"prompt": "a", "presence_penalty": 1}, "Extra inputs are not permitted"),
        ({"prompt": "a", "temperature": -0.5}, "greater than or equal to 0"),
        ({"prompt": "a", "top_p": 0}, "greater than 0"),
        ({"prompt": "a", "top_k": -2}, "greater than or equal to -1"),
        ({"prompt": "a", "max_tokens": 0}, "greater than 0"),
        ({"prompt": "a", "seed": 2**63}, "less than 9223372036854775808"),
    ],
)
def test_what_a_completion_request_refuses(body, message):
    with pytest.raises(ValidationError, match=message):
        CompletionRequest.model_validate(body)


def test_a_chat_request_takes_logprobs_top_logprobs_and_max_completion_tokens():
    hi = [{"role": "user", "content": "hi"}]
    request = ChatCompletionRequest.model_validate({"messages": hi, "n": 4, "logprobs": True})
    assert (request.n, request.logprob_count(), request.token_cap()) == (4, 0, None)
    request = ChatCompletionRequest.model_validate(
        {"messages": hi, "logprobs": True, "top_logprobs": 5, "max_completion_tokens": 7}
    )
    assert (request.logprob_count(), request.token_cap()) == (5, 7)
    assert ChatCompletionRequest.model_validate({"messages": hi}).logprob_count() is None
    with pytest.raises(ValidationError, match="top_logprobs needs logprobs: true"):
        ChatCompletionRequest.model_validate({"messages": hi, "top_logprobs": 2})
    with pytest.raises(ValidationError, match="less than or equal to 20"):
        ChatCompletionRequest.model_validate({"messages": hi, "logprobs": True, "top_logprobs": 21})


def test_a_chat_request_needs_messages_of_known_roles():
    request = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}])  # type: ignore[list-item]
    assert request.messages == [ChatMessage(role="user", content="hi")]
    for messages in ([], [{"role": "tool", "content": "x"}], [{"role": "user"}]):
        with pytest.raises(ValidationError):
            ChatCompletionRequest.model_validate({"messages": messages})


def test_chat_without_a_template_is_rendered_as_role_lines():
    messages = [
        ChatMessage(role="system", content="be brief"),
        ChatMessage(role="user", content="hi"),
    ]
    assert render_simple_chat(messages) == "system: be brief\nuser: hi\nassistant:"


def test_deltas_omit_what_they_do_not_carry_and_events_are_one_json_line():
    assert ChatDelta().model_dump() == {}
    assert ChatDelta(role="assistant", content="").model_dump() == {
        "role": "assistant",
        "content": "",
    }
    assert ChatDelta(content="x").model_dump() == {"content": "x"}
    card = ModelCard(id="actor", created=7)
    assert sse_event(card) == (
        'data: {"id":"actor","object":"model","created":7,"owned_by":"rayhf"}\n\n'
    )
    assert SSE_DONE == "data: [DONE]\n\n"
