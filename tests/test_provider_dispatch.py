"""The provider layer's classifiers and stream state machines, pinned case by case: which
error an SDK exception becomes, and which events each stream converter emits (ping and
unknown events change nothing). Issue #16 split these into dispatch tables; these tests
hold them to what they did before."""

from __future__ import annotations

from typing import Any

import anthropic
import httpx2
import openai
import pytest

from conversations.gateway.wire import AnthropicAnswer, OpenAIAnswer, anthropic_drafts
from conversations.providers.base import (
    Done,
    TextDelta,
    ThinkingDelta,
    ToolCallFinished,
    ToolCallStarted,
)
from conversations.providers.client import DeadlineExceeded, FirstByteTimeout, normalize_error
from conversations.providers.convert import (
    AnthropicStreamAccumulator,
    OpenAIStreamAccumulator,
    to_openai,
)
from conversations.providers.errors import (
    AuthenticationFailed,
    BadRequest,
    ContextOverflow,
    ProviderError,
    ProviderUnavailable,
    RateLimited,
)

_REQUEST = httpx2.Request("POST", "https://api.example.test/v1/messages")


def _status_error(
    status: int, body: Any, headers: dict[str, str] | None = None
) -> openai.APIStatusError:
    response = httpx2.Response(status, headers=headers or {}, request=_REQUEST)
    return openai.APIStatusError("ignored", response=response, body=body)


# --- normalize_error ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "body", "kind"),
    [
        (400, {"error": {"message": "bad field", "type": "invalid_request_error"}}, BadRequest),
        (
            400,
            {"error": {"message": "prompt is too long: 300 tokens > 200 maximum"}},
            ContextOverflow,
        ),
        (413, {"error": {"message": "request too large"}}, ContextOverflow),
        # A 429 is a rate limit even when its text speaks of tokens.
        (429, {"error": {"message": "prompt is too long: 300 tokens > 200 maximum"}}, RateLimited),
        (400, {"error": {"message": "slow down", "code": "rate_limit_exceeded"}}, RateLimited),
        (401, {"error": {"message": "no"}}, AuthenticationFailed),
        (403, "forbidden", AuthenticationFailed),
        (408, None, ProviderUnavailable),
        (503, {"error": {"message": "down"}}, ProviderUnavailable),
        (400, {"type": "error", "error": {"type": "overloaded_error"}}, ProviderUnavailable),
        (404, {"error": {"message": "no such model"}}, BadRequest),
        (302, None, ProviderError),
    ],
)
def test_it_classifies_an_http_error_by_status_and_code(
    status: int, body: Any, kind: type[ProviderError]
) -> None:
    error = normalize_error(_status_error(status, body), provider="openai")
    assert type(error) is kind
    assert error.status == status
    assert error.provider == "openai"


def test_it_keeps_the_providers_message_request_id_and_retry_after() -> None:
    exc = _status_error(
        429,
        {"error": {"message": "Rate limit reached"}},
        {"retry-after": "3", "request-id": "req_1"},
    )
    error = normalize_error(exc, provider="anthropic")
    assert isinstance(error, RateLimited)
    assert error.message == "Rate limit reached"
    assert error.retry_after == 3
    assert error.request_id == "req_1"


def test_it_says_the_status_when_the_body_has_no_message() -> None:
    error = normalize_error(_status_error(500, None), provider="openai")
    assert error.message == "the provider answered HTTP 500"


@pytest.mark.parametrize(
    ("exc", "kind", "code"),
    [
        (openai.APITimeoutError(request=_REQUEST), ProviderUnavailable, "timeout"),
        (httpx2.ConnectError("refused"), ProviderUnavailable, "connection_failed"),
        (anthropic.APIConnectionError(request=_REQUEST), ProviderUnavailable, "connection_failed"),
        (TypeError("Could not resolve authentication method"), AuthenticationFailed, None),
    ],
)
def test_it_classifies_a_failure_without_an_answer(
    exc: BaseException, kind: type[ProviderError], code: str | None
) -> None:
    error = normalize_error(exc, provider="openai")
    assert type(error) is kind
    if code is not None:
        assert error.code == code


def test_our_own_deadlines_win_over_the_sdks_timeout_error() -> None:
    for cause, code in ((DeadlineExceeded("late"), "deadline"), (FirstByteTimeout("x"), None)):
        wrapper = openai.APITimeoutError(request=_REQUEST)
        wrapper.__cause__ = cause
        error = normalize_error(wrapper, provider="openai")
        assert isinstance(error, ProviderUnavailable)
        assert error.code == (code or "first_byte_timeout")


def test_it_passes_a_provider_error_through_and_raises_anything_else() -> None:
    given = BadRequest("no", provider="openai")
    assert normalize_error(given, provider="openai") is given
    with pytest.raises(KeyError):
        normalize_error(KeyError("a bug of ours"), provider="openai")


# --- to_openai ---------------------------------------------------------------------------


def test_tool_images_wait_for_the_last_of_consecutive_tool_messages() -> None:
    def result(call_id: str) -> dict[str, Any]:
        return {
            "role": "tool",
            "parts": [
                {
                    "type": "tool_result",
                    "call_id": call_id,
                    "parts": [{"type": "image", "blob": "b", "mime": "image/png"}],
                }
            ],
        }

    payload = to_openai(
        [result("a"), result("b"), {"role": "user", "parts": [{"type": "text", "text": "ok"}]}],
        load_blob=lambda ref: b"\x89PNG",
    )
    roles = [m["role"] for m in payload.messages]
    assert roles == ["tool", "tool", "user", "user"]
    assert len(payload.messages[2]["content"]) == 2  # both images, in one message


def test_it_still_rejects_an_unknown_role() -> None:
    with pytest.raises(ValueError, match="unknown message role 'robot'"):
        to_openai([{"role": "robot", "parts": []}])


# --- stream converters -------------------------------------------------------------------


def test_the_anthropic_accumulator_emits_each_event_once_in_order() -> None:
    acc = AnthropicStreamAccumulator()
    stream: list[dict[str, Any]] = [
        {"type": "message_start", "message": {"id": "m1", "model": "c", "usage": {}}},
        {"type": "ping"},
        {"type": "content_block_start", "index": 0, "content_block": {"type": "thinking"}},
        {
            "type": "content_block_delta",
            "index": 0,
            "delta": {"type": "thinking_delta", "thinking": "hm"},
        },
        {
            "type": "content_block_delta",
            "index": 0,
            "delta": {"type": "signature_delta", "signature": "s"},
        },
        {"type": "content_block_stop", "index": 0},
        {"type": "content_block_start", "index": 1, "content_block": {"type": "text", "text": "A"}},
        {"type": "content_block_delta", "index": 1, "delta": {"type": "text_delta", "text": "B"}},
        {
            "type": "content_block_start",
            "index": 2,
            "content_block": {"type": "tool_use", "id": "t", "name": "f", "input": {}},
        },
        {
            "type": "content_block_delta",
            "index": 2,
            "delta": {"type": "input_json_delta", "partial_json": '{"x":'},
        },
        {
            "type": "content_block_delta",
            "index": 2,
            "delta": {"type": "input_json_delta", "partial_json": "1}"},
        },
        {"type": "some_future_event", "index": 2},
        {"type": ["not", "a", "name"]},
        {
            "type": "message_delta",
            "delta": {"stop_reason": "tool_use"},
            "usage": {"output_tokens": 5},
        },
    ]
    events = [e for event in stream for e in acc.feed(event)]
    assert events == [
        ThinkingDelta("hm"),
        TextDelta("A"),
        TextDelta("B"),
        ToolCallStarted(index=0, id="t", name="f"),
    ]
    # No content_block_stop came for the call: finish() closes it, once.
    *closing, done = acc.finish()
    call = {"type": "tool_call", "id": "t", "name": "f", "arguments": {"x": 1}}
    assert closing == [ToolCallFinished(index=0, part=call)]
    assert isinstance(done, Done)
    assert done.reply.finish_reason == "tool_calls"
    assert done.reply.parts == [
        {"type": "thinking", "text": "hm", "signature": "s"},
        {"type": "text", "text": "AB"},
        call,
    ]


def test_the_openai_accumulator_starts_a_call_once_it_has_a_name() -> None:
    acc = OpenAIStreamAccumulator()
    chunks: list[dict[str, Any]] = [
        {"id": "r", "choices": [{"delta": {"reasoning_content": "hm", "content": "Hi"}}]},
        {"choices": [{"index": 1, "delta": {"content": "another choice"}}]},
        {"choices": [{"delta": {"tool_calls": [{"index": 0, "id": "c1"}]}}]},
        {
            "choices": [
                {
                    "delta": {
                        "tool_calls": [{"index": 0, "function": {"name": "f", "arguments": "{"}}]
                    }
                }
            ]
        },
        {
            "choices": [
                {
                    "delta": {"tool_calls": [{"index": 0, "function": {"arguments": "}"}}]},
                    "finish_reason": "tool_calls",
                }
            ]
        },
    ]
    per_chunk = [acc.feed(chunk) for chunk in chunks]
    call = {"type": "tool_call", "id": "c1", "name": "f", "arguments": {}}
    assert per_chunk == [
        [ThinkingDelta("hm"), TextDelta("Hi")],
        [],
        [],
        [ToolCallStarted(index=0, id="c1", name="f")],
        [ToolCallFinished(index=0, part=call)],
    ]
    (done,) = acc.finish()
    assert isinstance(done, Done)
    assert done.reply.parts == [
        {"type": "thinking", "text": "hm"},
        {"type": "text", "text": "Hi"},
        call,
    ]


def test_the_gateways_answers_ignore_events_they_do_not_know() -> None:
    answer = AnthropicAnswer()
    for event in (
        {"type": "message_start", "message": {"id": "m", "usage": {"input_tokens": 3}}},
        {"type": "ping"},
        {"type": "error", "error": {"type": "overloaded_error"}},
        {"type": "content_block_start", "index": 0, "content_block": {"type": "tool_use"}},
        {
            "type": "content_block_delta",
            "index": 0,
            "delta": {"type": "input_json_delta", "partial_json": "{bad"},
        },
        {"type": "content_block_stop", "index": 0},
        {
            "type": "message_delta",
            "delta": {"stop_reason": "end_turn"},
            "usage": {"output_tokens": 2},
        },
    ):
        answer.feed(event)
    assert not answer.complete
    answer.feed({"type": "message_stop"})
    assert answer.complete
    assert answer.result() == {
        "id": "m",
        "usage": {"input_tokens": 3, "output_tokens": 2},
        "stop_reason": "end_turn",
        "content": [{"type": "tool_use", "input": {}}],
    }

    chat = OpenAIAnswer()
    chat.feed({"id": "r", "choices": [{"delta": {"content": "a", "reasoning": "r"}}]})
    chat.feed({"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"name": "f"}}]}}]})
    chat.feed({"choices": [{"index": 2, "delta": {"content": "ignored"}}]})
    assert chat.result() == {
        "role": "assistant",
        "content": "a",
        "reasoning": "r",
        "tool_calls": [{"id": "", "type": "function", "function": {"name": "f", "arguments": ""}}],
    }


def test_an_anthropic_user_message_splits_into_tool_results_then_the_rest() -> None:
    drafts = anthropic_drafts(
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "also"},
                {"type": "tool_result", "tool_use_id": "t", "content": "done"},
            ],
        }
    )
    assert drafts == [
        {
            "role": "tool",
            "parts": [
                {
                    "type": "tool_result",
                    "call_id": "t",
                    "is_error": False,
                    "parts": [{"type": "text", "text": "done"}],
                }
            ],
        },
        {"role": "user", "parts": [{"type": "text", "text": "also"}]},
    ]
    assert anthropic_drafts({"role": "assistant", "content": []}) == [
        {"role": "assistant", "parts": [{"type": "text", "text": ""}]}
    ]
