"""The provider layer: registry, error parsing, conversions, and real HTTP through the
official SDKs against the loopback fake provider (both protocols)."""

from __future__ import annotations

import base64
import io
import json
import math
import time
from collections.abc import Iterator
from typing import Any

import pytest
from PIL import Image

from conversations.providers import (
    AuthenticationFailed,
    BadRequest,
    ClientSettings,
    ContextOverflow,
    Done,
    ProviderUnavailable,
    RateLimited,
    Reply,
    Request,
    TextDelta,
    ToolCallFinished,
    ToolCallStarted,
    ToolSpec,
    from_anthropic,
    from_openai,
    make_provider,
    parse_overflow,
    redact,
    to_anthropic,
    to_openai,
)
from conversations.providers.client import Provider
from conversations.providers.fake import FakeLLMServer, Step, count_text_tokens

# What the registry knows of any id, without the operator's model policy (its tests:
# tests/test_model_policy.py).
from conversations.providers.registry import describe_model

KEY = "sk-test-SECRET"
PROTOCOLS = ["openai", "anthropic"]
FAST = ClientSettings(max_retries=2, timeout=5.0, connect_timeout=2.0, max_retry_after=5.0)

PROVIDER_ENV = [
    "ARBOR_MODELS",
    "ARBOR_FAKE_BASE_URL",
    "OPENAI_API_KEY",
    "OPENAI_API_KEY_FILE",
    "OPENAI_BASE_URL",
    "ANTHROPIC_API_KEY",
    "ANTHROPIC_API_KEY_FILE",
    "ANTHROPIC_BASE_URL",
    "ANTHROPIC_AUTH_TOKEN",
]


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in PROVIDER_ENV:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def fake() -> Iterator[FakeLLMServer]:
    with FakeLLMServer() as server:
        yield server


def connect(
    fake: FakeLLMServer,
    protocol: str,
    *,
    settings: ClientSettings = FAST,
    api_key: str | None = KEY,
    load_blob: Any = None,
) -> Provider:
    spec = describe_model(f"{protocol}/test-model")
    base_url = fake.openai_base_url if protocol == "openai" else fake.anthropic_base_url
    return make_provider(
        spec, base_url=base_url, api_key=api_key, settings=settings, load_blob=load_blob
    )


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "parts": [{"type": "text", "text": text}]}


def png(width: int, height: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (200, 30, 30)).save(buffer, format="PNG")
    return buffer.getvalue()


ADD = ToolSpec(
    name="add",
    description="Add two numbers",
    parameters={
        "type": "object",
        "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
        "required": ["a", "b"],
    },
)


# --- registry -------------------------------------------------------------------------


def test_it_assumes_defaults_for_unknown_models_and_says_so() -> None:
    local = describe_model("openai/my-local-llama")
    assert (local.provider, local.model) == ("openai", "my-local-llama")
    assert (local.context_window, local.max_output) == (128_000, 4_096)
    assert local.assumed and local.notice and "assumed" in local.notice
    assert local.base_url is None

    claude = describe_model("anthropic/claude-future-9")
    assert (claude.provider, claude.context_window, claude.max_output) == (
        "anthropic",
        200_000,
        8_192,
    )
    assert claude.assumed and claude.vision and claude.image_billing == "claude"


def test_it_knows_well_known_models_and_their_snapshots() -> None:
    sonnet = describe_model("anthropic/claude-sonnet-4-5-20250929")
    assert sonnet.context_window == 200_000 and sonnet.max_output == 64_000
    assert not sonnet.assumed and sonnet.notice is None
    mini = describe_model("openai/gpt-4o-mini")
    assert (mini.max_output, mini.vision, mini.image_billing) == (16_384, True, "openai-tile")
    # A model name may itself contain slashes (OpenRouter, Hugging Face ids).
    assert describe_model("openai/meta-llama/Llama-3-8B").model == "meta-llama/Llama-3-8B"


@pytest.mark.parametrize("bad", ["gpt-4o", "azure/gpt-4o", "openai/", "", "/x"])
def test_it_rejects_an_id_without_a_known_provider_prefix(bad: str) -> None:
    with pytest.raises(ValueError, match=r"openai/<model>|names no model"):
        describe_model(bad)


def test_it_marks_fake_models_as_the_offline_demo() -> None:
    spec = describe_model("fake/echo")
    assert spec.fake and spec.provider == "openai" and not spec.assumed
    assert spec.notice and "offline demo" in spec.notice and "not an LLM" in spec.notice


def test_it_reads_a_toml_models_file(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "models.toml"
    path.write_text(
        """
[models."openai/llama3"]
model = "llama3.1:8b"
base_url = "http://127.0.0.1:11434/v1"
api_key_env = "OLLAMA_API_KEY"
context_window = 8192
max_output = 2048

[models."anthropic/claude-sonnet-4-5"]
max_output = 16000
""",
        encoding="utf-8",
    )
    monkeypatch.setenv("ARBOR_MODELS", str(path))
    llama = describe_model("openai/llama3")
    assert llama.model == "llama3.1:8b"
    assert llama.base_url == "http://127.0.0.1:11434/v1"
    assert llama.api_key_env == "OLLAMA_API_KEY"
    assert (llama.context_window, llama.max_output, llama.assumed) == (8192, 2048, False)
    # The file overrides one field and keeps the built-in rest.
    sonnet = describe_model("anthropic/claude-sonnet-4-5")
    assert (sonnet.context_window, sonnet.max_output) == (200_000, 16_000)
    # Models the file does not name still resolve.
    assert describe_model("openai/other").assumed


def test_it_reads_a_json_models_file(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "models.json"
    path.write_text(
        json.dumps(
            {
                "models": {
                    "openai/tiny": {
                        "context_window": 4000,
                        "max_output": 500,
                        "vision": True,
                        "image_billing": "openai-patch",
                    },
                    "fake/small": {"context_window": 600, "max_output": 100},
                }
            }
        ),
        encoding="utf-8",
    )
    monkeypatch.setenv("ARBOR_MODELS", str(path))
    tiny = describe_model("openai/tiny")
    assert (tiny.context_window, tiny.vision, tiny.image_billing) == (4000, True, "openai-patch")
    small = describe_model("fake/small")
    assert small.fake and small.context_window == 600


@pytest.mark.parametrize(
    ("name", "content", "problem"),
    [
        ("bad.toml", '[models."openai/x"\ncontext_window = 1', "is not valid TOML"),
        ("bad.json", '{"models": {', "is not valid JSON"),
        ("m.toml", '[models."openai/x"]\nwindow = 1000', "unknown settings ['window']"),
        ("m.toml", '[models."openai/x"]\ncontext_window = "big"', "context_window must be a int"),
        ("m.toml", '[models."openai/x"]\ncontext_window = true', "context_window must be a int"),
        ("m.toml", '[models."openai/x"]\nmax_output = -5', "max_output must be positive"),
        ("m.toml", '[models."openai/x"]\nimage_billing = "per-pixel"', "image_billing must be"),
        ("m.toml", '[models."gpt-4o"]\nmax_output = 5', "needs a provider prefix"),
        ("m.toml", '[model."openai/x"]\nmax_output = 5', "top-level 'models' table"),
    ],
)
def test_it_names_the_problem_in_a_malformed_models_file(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, name: str, content: str, problem: str
) -> None:
    path = tmp_path / name
    path.write_text(content, encoding="utf-8")
    monkeypatch.setenv("ARBOR_MODELS", str(path))
    with pytest.raises(ValueError) as err:
        describe_model("openai/x")
    message = str(err.value)
    assert "ARBOR_MODELS file" in message and name in message
    assert problem in message


def test_it_rejects_an_output_limit_as_large_as_the_window(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "m.json"
    path.write_text('{"models": {"openai/x": {"context_window": 100, "max_output": 100}}}')
    monkeypatch.setenv("ARBOR_MODELS", str(path))
    with pytest.raises(ValueError, match=r"max_output \(100\) must be smaller"):
        describe_model("openai/x")


def test_it_names_a_missing_models_file(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ARBOR_MODELS", str(tmp_path / "nope.toml"))
    with pytest.raises(ValueError, match=r"ARBOR_MODELS file .*nope\.toml.* cannot be read"):
        describe_model("openai/x")


# --- overflow parsing -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("message", "code", "expected"),
    [
        (
            "This model's maximum context length is 8192 tokens. However, your messages "
            "resulted in 9000 tokens. Please reduce the length of the messages.",
            "context_length_exceeded",
            (9000, 8192),
        ),
        (
            "This model's maximum context length is 128000 tokens. However, your messages "
            "resulted in 130512 tokens (129900 in the messages, 612 in the functions). "
            "Please reduce the length of the messages or functions.",
            None,
            (130512, 128000),
        ),
        (
            # The requested total includes tokens reserved for the answer; the prompt is
            # the part in the messages.
            "This model's maximum context length is 4096 tokens. However, you requested "
            "5000 tokens (4000 in the messages, 1000 in the completion). Please reduce the "
            "length of the messages or completion.",
            None,
            (4000, 4096),
        ),
        (
            "Your input exceeds the context window of this model. Please adjust your input "
            "and try again.",
            "context_length_exceeded",
            (None, None),
        ),
        ("Request too large for this model.", "context_length_exceeded", (None, None)),
        ("prompt is too long: 208310 tokens > 200000 maximum", None, (208310, 200000)),
        (
            "input length and `max_tokens` exceed context limit: 198000 + 8192 > 200000, "
            "decrease input length or `max_tokens` and try again",
            None,
            (198000, 200000),
        ),
        (
            "The input token count (1200000) exceeds the maximum number of tokens allowed "
            "(1048576).",
            None,
            (1200000, 1048576),
        ),
        (
            "request (9000 tokens) exceeds the available context size (8192 tokens), try "
            "increasing it",
            "exceed_context_size_error",
            (9000, 8192),
        ),
        (
            "Prompt contains 40000 tokens and 0 draft tokens, too large for model with 32768 "
            "maximum context length",
            None,
            (40000, 32768),
        ),
        (
            "This model's maximum context length is 32768 tokens. However, your request has "
            "40001 input tokens. Please reduce the length of the input messages.",
            None,
            (40001, 32768),
        ),
    ],
)
def test_it_parses_each_providers_overflow_message(
    message: str, code: str | None, expected: tuple[int | None, int | None]
) -> None:
    assert parse_overflow(message, code) == expected


@pytest.mark.parametrize(
    "message",
    [
        "Rate limit reached for gpt-4o in organization org-x on tokens per min (TPM)",
        "messages.1: `tool_use` ids were found without `tool_result` blocks immediately after",
        "Invalid 'max_tokens': integer below minimum value.",
        "",
    ],
)
def test_it_does_not_mistake_other_errors_for_overflow(message: str) -> None:
    assert parse_overflow(message, "invalid_request_error") is None


def test_it_redacts_keys_from_text(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "plain-secret-value-123")
    text = redact(
        "Incorrect API key provided: sk-proj-abc***wxyz; env plain-secret-value-123; "
        "Authorization: Bearer abcdefghijklmnop"
    )
    assert "sk-proj" not in text and "plain-secret" not in text and "abcdefghij" not in text
    assert text.count("[redacted]") == 3


# --- conversions ----------------------------------------------------------------------

BLOB = "a" * 64
IMAGE = png(100, 80)


def load_blob(sha: str) -> bytes:
    assert sha == BLOB
    return IMAGE


TRANSCRIPT: list[dict[str, Any]] = [
    {
        "role": "user",
        "parts": [
            {"type": "text", "text": "What is in this picture, and what is 2+3?"},
            {"type": "image", "blob": BLOB, "mime": "image/png", "width": 100, "height": 80},
        ],
    },
    {
        "role": "assistant",
        "parts": [
            {"type": "thinking", "text": "I should add.", "signature": "sig-1"},
            {"type": "text", "text": "Let me add."},
            {"type": "tool_call", "id": "c1", "name": "add", "arguments": {"a": 2, "b": 3}},
            {"type": "tool_call", "id": "c2", "name": "add", "arguments": {"_raw": '{"a": 1,'}},
        ],
    },
    {
        "role": "tool",
        "parts": [
            {"type": "tool_result", "call_id": "c1", "is_error": False, "parts": []},
            {
                "type": "tool_result",
                "call_id": "c2",
                "is_error": True,
                "parts": [{"type": "text", "text": "bad arguments"}],
            },
        ],
    },
    {"role": "user", "parts": [{"type": "text", "text": "thanks"}]},
]


def test_it_converts_a_transcript_to_openai_chat_messages() -> None:
    payload = to_openai(TRANSCRIPT, system="Be brief.", tools=[ADD], load_blob=load_blob)
    roles = [m["role"] for m in payload.messages]
    assert roles == ["system", "user", "assistant", "tool", "tool", "user"]
    image = payload.messages[1]["content"][1]
    assert image["type"] == "image_url"
    assert image["image_url"]["url"] == "data:image/png;base64," + base64.b64encode(IMAGE).decode(
        "ascii"
    )
    assistant = payload.messages[2]
    # Thinking is dropped; arguments are JSON strings, invalid ones sent back verbatim.
    assert assistant["content"] == "Let me add."
    assert [c["function"]["arguments"] for c in assistant["tool_calls"]] == [
        '{"a": 2, "b": 3}',
        '{"a": 1,',
    ]
    assert payload.messages[3] == {
        "role": "tool",
        "tool_call_id": "c1",
        "content": "(empty result)",
    }
    assert payload.messages[4]["content"] == "Error: bad arguments"
    assert payload.messages[5] == {"role": "user", "content": "thanks"}
    assert payload.tools == [
        {
            "type": "function",
            "function": {
                "name": "add",
                "description": "Add two numbers",
                "parameters": dict(ADD.parameters),
            },
        }
    ]


def test_it_sends_tool_images_to_openai_in_a_user_message_after_the_results() -> None:
    messages = [
        user("look"),
        {
            "role": "assistant",
            "parts": [{"type": "tool_call", "id": "s", "name": "screenshot", "arguments": {}}],
        },
        {
            "role": "tool",
            "parts": [
                {
                    "type": "tool_result",
                    "call_id": "s",
                    "is_error": False,
                    "parts": [{"type": "image", "blob": BLOB, "mime": "image/png"}],
                }
            ],
        },
    ]
    out = to_openai(messages, load_blob=load_blob).messages
    assert [m["role"] for m in out] == ["user", "assistant", "tool", "user"]
    assert "attached in the next message" in out[2]["content"]
    assert out[3]["content"][0]["type"] == "image_url"


def test_it_converts_a_transcript_to_anthropic_messages() -> None:
    payload = to_anthropic(
        [{"role": "system", "parts": [{"type": "text", "text": "Use tools."}]}, *TRANSCRIPT],
        system="Be brief.",
        tools=[ADD],
        load_blob=load_blob,
    )
    assert payload.system == "Be brief.\n\nUse tools."
    # The tool results and the next user text merge into one user turn: alternation.
    assert [m["role"] for m in payload.messages] == ["user", "assistant", "user"]
    image = payload.messages[0]["content"][1]
    assert image == {
        "type": "image",
        "source": {
            "type": "base64",
            "media_type": "image/png",
            "data": base64.b64encode(IMAGE).decode("ascii"),
        },
    }
    assistant = payload.messages[1]["content"]
    assert [b["type"] for b in assistant] == ["thinking", "text", "tool_use", "tool_use"]
    assert assistant[0] == {"type": "thinking", "thinking": "I should add.", "signature": "sig-1"}
    assert assistant[2] == {
        "type": "tool_use",
        "id": "c1",
        "name": "add",
        "input": {"a": 2, "b": 3},
    }
    results = payload.messages[2]["content"]
    assert [b["type"] for b in results] == ["tool_result", "tool_result", "text"]
    assert results[0] == {"type": "tool_result", "tool_use_id": "c1"}
    assert results[1] == {
        "type": "tool_result",
        "tool_use_id": "c2",
        "content": [{"type": "text", "text": "bad arguments"}],
        "is_error": True,
    }
    assert payload.tools == [
        {"name": "add", "description": "Add two numbers", "input_schema": dict(ADD.parameters)}
    ]


def test_it_keeps_only_signed_thinking_for_anthropic() -> None:
    messages = [
        user("hi"),
        {
            "role": "assistant",
            "parts": [
                {"type": "thinking", "text": "unsigned, from another provider"},
                {"type": "text", "text": "hello"},
            ],
        },
    ]
    content = to_anthropic(messages).messages[1]["content"]
    assert content == [{"type": "text", "text": "hello"}]


def test_it_round_trips_assistant_parts_through_openai() -> None:
    parts = [
        {"type": "text", "text": "Let me add."},
        {"type": "tool_call", "id": "c1", "name": "add", "arguments": {"a": 2, "b": 3}},
        {"type": "tool_call", "id": "c2", "name": "add", "arguments": {"_raw": '{"a": 1,'}},
    ]
    wire = to_openai([{"role": "assistant", "parts": parts}]).messages[0]
    reply = from_openai(
        {
            "id": "chatcmpl-1",
            "model": "gpt-4o-mini",
            "choices": [{"index": 0, "message": wire, "finish_reason": "tool_calls"}],
            "usage": {"prompt_tokens": 50, "completion_tokens": 20, "total_tokens": 70},
        }
    )
    assert reply.parts == parts
    assert reply.finish_reason == "tool_calls"
    assert reply.usage is not None
    assert reply.usage.as_dict() == {"input_tokens": 50, "output_tokens": 20}
    assert reply.message()["metadata"] == {
        "finish_reason": "tool_calls",
        "model": "gpt-4o-mini",
        "usage": {"input_tokens": 50, "output_tokens": 20},
    }


def test_it_round_trips_assistant_parts_through_anthropic() -> None:
    parts = [
        {"type": "thinking", "text": "I should add.", "signature": "sig-1"},
        {"type": "text", "text": "Let me add."},
        {"type": "tool_call", "id": "toolu_1", "name": "add", "arguments": {"a": 2, "b": 3}},
    ]
    wire = to_anthropic([user("q"), {"role": "assistant", "parts": parts}]).messages[1]
    reply = from_anthropic(
        {
            "id": "msg_1",
            "type": "message",
            "role": "assistant",
            "model": "claude-sonnet-4-5",
            "content": wire["content"],
            "stop_reason": "tool_use",
            "usage": {
                "input_tokens": 10,
                "output_tokens": 7,
                "cache_read_input_tokens": 90,
                "cache_creation_input_tokens": 0,
            },
        }
    )
    assert reply.parts == parts
    assert reply.finish_reason == "tool_calls" and reply.raw_finish_reason == "tool_use"
    # The whole prompt, cached part included, is what the estimator compares against.
    assert reply.usage is not None
    assert reply.usage.input_tokens == 100 and reply.usage.cache_read_tokens == 90


def test_it_keeps_invalid_tool_arguments_instead_of_crashing() -> None:
    reply = from_openai(
        {
            "choices": [
                {
                    "message": {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [
                            {"id": "x", "function": {"name": "f", "arguments": "{oops"}},
                            {"id": "y", "function": {"name": "g", "arguments": "[1, 2]"}},
                            {"id": "z", "function": {"name": "h", "arguments": ""}},
                        ],
                    },
                    "finish_reason": "tool_calls",
                }
            ]
        }
    )
    assert [c["arguments"] for c in reply.tool_calls] == [
        {"_raw": "{oops"},
        {"_raw": "[1, 2]"},
        {},
    ]


# --- the fake's own accounting --------------------------------------------------------


def test_the_fake_counts_json_and_korean_above_a_chars_over_four_guess() -> None:
    payload = json.dumps({"rows": [{"id": i, "ok": True, "tags": ["a", "b"]} for i in range(20)]})
    korean = "안녕하세요. 오늘 회의는 세 시에 시작합니다. 자료를 미리 읽어 주세요." * 5
    for text in (payload, korean):
        assert count_text_tokens(text) > 1.5 * math.ceil(len(text) / 4)
    assert count_text_tokens("안녕") == 3


@pytest.mark.parametrize(
    ("protocol", "billed"),
    [("openai", 85 + 170), ("anthropic", math.ceil(100 / 28) * math.ceil(80 / 28))],
)
def test_the_fake_bills_images_by_the_providers_rule(
    fake: FakeLLMServer, protocol: str, billed: int
) -> None:
    with connect(fake, protocol, load_blob=load_blob) as provider:
        provider.complete(Request(messages=[user("describe")]))
        provider.complete(
            Request(
                messages=[
                    {
                        "role": "user",
                        "parts": [
                            {"type": "text", "text": "describe"},
                            {"type": "image", "blob": BLOB, "mime": "image/png"},
                        ],
                    }
                ]
            )
        )
    plain, with_image = fake.requests
    assert plain.prompt_tokens is not None and with_image.prompt_tokens is not None
    assert with_image.prompt_tokens - plain.prompt_tokens == billed


# --- real HTTP through the SDKs ---------------------------------------------------------


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_it_completes_a_plain_request(fake: FakeLLMServer, protocol: str) -> None:
    fake.push(Step.reply("Hello, Arbor."))
    with connect(fake, protocol) as provider:
        reply = provider.complete(Request(messages=[user("hi")], system="Be kind."))
    assert reply.parts == [{"type": "text", "text": "Hello, Arbor."}]
    assert reply.finish_reason == "stop"
    (sent,) = fake.requests
    assert reply.usage is not None and reply.usage.input_tokens == sent.prompt_tokens
    assert reply.usage.output_tokens == count_text_tokens("Hello, Arbor.")
    assert sent.authenticated and not sent.stream
    if protocol == "openai":
        assert sent.body["messages"][0] == {"role": "system", "content": "Be kind."}
    else:
        assert sent.body["system"] == "Be kind."


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_it_streams_deltas_and_ends_with_the_whole_reply(
    fake: FakeLLMServer, protocol: str
) -> None:
    text = "The quick brown fox jumps over the lazy dog."
    fake.push(Step.reply(text))
    with connect(fake, protocol) as provider:
        events = list(provider.stream(Request(messages=[user("tell me")])))
    deltas = [e.text for e in events if isinstance(e, TextDelta)]
    assert len(deltas) > 3 and "".join(deltas) == text
    assert isinstance(events[-1], Done)
    reply = events[-1].reply
    assert reply.text == text and reply.finish_reason == "stop"
    assert reply.usage is not None and reply.usage.input_tokens == fake.requests[0].prompt_tokens
    assert reply.usage.output_tokens == count_text_tokens(text)
    assert fake.requests[0].stream


@pytest.mark.parametrize("streamed", [False, True])
def test_openai_requests_go_out_as_built_without_the_sdks_param_walk(
    fake: FakeLLMServer, monkeypatch: pytest.MonkeyPatch, streamed: bool
) -> None:
    """``chat.completions.create`` walks every message against the SDK's TypedDicts
    before sending (26 ms of CPU at 70 messages, growing with the history); the body
    ``openai_body`` builds is plain JSON already, so it is posted as it is."""
    from openai.resources.chat.completions import completions

    def walk(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the request body went through the SDK's maybe_transform")

    monkeypatch.setattr(completions, "maybe_transform", walk)
    history = [user(f"question {i}") for i in range(40)]
    fake.push(Step.reply("Answered."))
    with connect(fake, "openai") as provider:
        request = Request(messages=history, system="Be brief.", tools=[ADD])
        built = provider._kwargs(request)
        if streamed:
            events = list(provider.stream(request))
            reply = events[-1].reply
        else:
            reply = provider.complete(request)
    assert reply.text == "Answered."
    (sent,) = fake.requests
    extra = {"stream": True, "stream_options": {"include_usage": True}} if streamed else {}
    assert sent.body == json.loads(json.dumps({**built, **extra}))


@pytest.mark.parametrize(
    ("content_type", "body", "answer"),
    [
        # JSON labelled as text still answers.
        ("text/plain", json.dumps({"choices": [{"message": {"content": "Hi."}}]}), "Hi."),
        ("text/html", "<html>502 Bad Gateway</html>", None),
        ("application/json", json.dumps(["not", "an", "object"]), None),
        ("text/event-stream", 'data: ["not", "an", "object"]\n\n', None),
    ],
)
def test_an_openai_answer_that_is_not_a_json_object_is_a_provider_error(
    content_type: str, body: str, answer: str | None
) -> None:
    import http.server
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["content-length"]))
            payload = body.encode()
            self.send_response(200)
            self.send_header("content-type", content_type)
            self.send_header("content-length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        spec = describe_model("openai/test-model")
        url = f"http://127.0.0.1:{server.server_address[1]}/v1"
        with make_provider(spec, base_url=url, api_key=KEY, settings=FAST) as provider:
            if content_type == "text/event-stream":
                with pytest.raises(ProviderUnavailable, match="not a JSON object"):
                    list(provider.stream(Request(messages=[user("hi")])))
            elif answer is None:
                with pytest.raises(ProviderUnavailable, match="not a JSON object"):
                    provider.complete(Request(messages=[user("hi")]))
            else:
                assert provider.complete(Request(messages=[user("hi")])).text == answer
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("streamed", [False, True])
def test_it_runs_two_tool_rounds_with_results_from_the_caller(
    fake: FakeLLMServer, protocol: str, streamed: bool
) -> None:
    fake.push(
        Step.tools({"name": "add", "arguments": {"a": 2, "b": 3}}, text="Adding first."),
        Step.tools({"name": "add", "arguments": {"a": 5, "b": 10}}),
        Step.reply("The total is 15."),
    )
    transcript: list[dict[str, Any]] = [user("What is 2+3+10?")]
    started: list[str] = []
    with connect(fake, protocol) as provider:
        for _ in range(5):
            request = Request(messages=transcript, tools=[ADD])
            if streamed:
                events = list(provider.stream(request))
                started += [e.name for e in events if isinstance(e, ToolCallStarted)]
                finished = [e.part for e in events if isinstance(e, ToolCallFinished)]
                done = events[-1]
                assert isinstance(done, Done)
                reply: Reply = done.reply
                assert finished == reply.tool_calls
            else:
                reply = provider.complete(request)
            transcript.append(reply.message())
            if not reply.tool_calls:
                break
            assert reply.finish_reason == "tool_calls"
            results = [
                {
                    "type": "tool_result",
                    "call_id": call["id"],
                    "is_error": False,
                    "parts": [
                        {
                            "type": "text",
                            "text": str(call["arguments"]["a"] + call["arguments"]["b"]),
                        }
                    ],
                }
                for call in reply.tool_calls
            ]
            transcript.append({"role": "tool", "parts": results})
    assert transcript[-1]["parts"] == [{"type": "text", "text": "The total is 15."}]
    assert [m["role"] for m in transcript] == [
        "user",
        "assistant",
        "tool",
        "assistant",
        "tool",
        "assistant",
    ]
    assert transcript[1]["parts"][0] == {"type": "text", "text": "Adding first."}
    if streamed:
        assert started == ["add", "add"]
    # The provider saw each result paired with its call, in its own protocol.
    assert len(fake.requests) == 3
    last = fake.requests[-1].body["messages"]
    if protocol == "openai":
        assert [m["role"] for m in last] == ["user", "assistant", "tool", "assistant", "tool"]
        assert last[4]["content"] == "15"
        assert last[4]["tool_call_id"] == last[3]["tool_calls"][0]["id"]
    else:
        assert [m["role"] for m in last] == ["user", "assistant", "user", "assistant", "user"]
        assert last[4]["content"][0]["type"] == "tool_result"
        assert last[4]["content"][0]["tool_use_id"] == last[3]["content"][0]["id"]
    assert all(r.status == 200 for r in fake.requests)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_it_retries_a_server_error(fake: FakeLLMServer, protocol: str) -> None:
    fake.push(Step.error(500), Step.reply("recovered"))
    with connect(fake, protocol) as provider:
        reply = provider.complete(Request(messages=[user("hi")]))
    assert reply.text == "recovered"
    assert [r.status for r in fake.requests] == [500, 200]
    assert fake.requests[1].headers.get("x-stainless-retry-count") == "1"


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_it_gives_up_on_persistent_server_errors(fake: FakeLLMServer, protocol: str) -> None:
    fake.push(Step.error(503), Step.error(503), Step.error(503))
    settings = ClientSettings(max_retries=1, timeout=5.0, max_retry_after=5.0)
    with (
        connect(fake, protocol, settings=settings) as provider,
        pytest.raises(ProviderUnavailable) as err,
    ):
        provider.complete(Request(messages=[user("hi")]))
    assert err.value.status == 503 and err.value.code == "provider_unavailable"
    assert len(fake.requests) == 2  # the first try and one retry, no more


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_it_waits_out_a_rate_limit_as_retry_after_says(fake: FakeLLMServer, protocol: str) -> None:
    fake.push(Step.error(429, retry_after=1), Step.reply("after the wait"))
    with connect(fake, protocol) as provider:
        reply = provider.complete(Request(messages=[user("hi")]))
    assert reply.text == "after the wait"
    first, second = fake.requests
    assert (first.status, second.status) == (429, 200)
    # The SDK's own backoff would start at ~0.5 s; waiting the header's 1 s shows it was
    # honoured.
    assert 0.9 <= second.received_at - first.received_at < 3.0


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_it_does_not_wait_longer_than_the_retry_after_bound(
    fake: FakeLLMServer, protocol: str
) -> None:
    fake.push(Step.error(429, retry_after=3600), Step.reply("never sent"))
    with connect(fake, protocol) as provider, pytest.raises(RateLimited) as err:
        provider.complete(Request(messages=[user("hi")]))
    assert err.value.retry_after == 3600 and err.value.status == 429
    assert len(fake.requests) == 1
    assert err.value.as_dict()["error"] == "rate_limited"


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("streamed", [False, True])
def test_it_reports_an_overflow_with_the_providers_numbers(protocol: str, streamed: bool) -> None:
    with FakeLLMServer(context_window=60) as fake:
        fake.push(Step.reply("never used"))
        long = "Arbor keeps every branch of a long conversation. " * 10
        with connect(fake, protocol) as provider:
            request = Request(messages=[user(long)])
            with pytest.raises(ContextOverflow) as err:
                if streamed:
                    list(provider.stream(request))
                else:
                    provider.complete(request)
        (sent,) = fake.requests  # a 400 is not retried
        assert sent.status == 400
        assert err.value.limit == 60
        assert err.value.measured_tokens == sent.prompt_tokens
        assert sent.prompt_tokens is not None and sent.prompt_tokens > 60
        assert err.value.as_dict()["error"] == "context_overflow"
        # The scripted reply was not used up by the rejected request.
        assert fake.pending_steps == 1


@pytest.mark.parametrize(
    ("protocol", "expected"),
    [
        (
            "openai",
            "An assistant message with 'tool_calls' must be followed by tool messages "
            "responding to each 'tool_call_id'. The following tool_call_ids did not have "
            "response messages: call_1",
        ),
        (
            "anthropic",
            "messages.1: `tool_use` ids were found without `tool_result` blocks immediately "
            "after: call_1. Each `tool_use` block must have a corresponding `tool_result` "
            "block in the next message.",
        ),
    ],
)
def test_it_passes_on_the_providers_rejection_of_an_unpaired_tool_call(
    fake: FakeLLMServer, protocol: str, expected: str
) -> None:
    messages = [
        user("weather?"),
        {
            "role": "assistant",
            "parts": [{"type": "tool_call", "id": "call_1", "name": "weather", "arguments": {}}],
        },
        user("never mind"),
    ]
    with connect(fake, protocol) as provider, pytest.raises(BadRequest) as err:
        provider.complete(Request(messages=messages))
    assert str(err.value) == expected
    assert err.value.status == 400
    assert len(fake.requests) == 1


@pytest.mark.parametrize(
    ("protocol", "expected"),
    [
        ("openai", "messages with role 'tool' must be a response to a preceeding message"),
        ("anthropic", "messages.0.content.0: unexpected `tool_use_id` found in `tool_result`"),
    ],
)
def test_it_passes_on_the_providers_rejection_of_an_orphan_tool_result(
    fake: FakeLLMServer, protocol: str, expected: str
) -> None:
    orphan = {
        "role": "tool",
        "parts": [{"type": "tool_result", "call_id": "ghost", "is_error": False, "parts": []}],
    }
    with connect(fake, protocol) as provider, pytest.raises(BadRequest, match=expected):
        provider.complete(Request(messages=[orphan, user("and?")]))


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_it_fails_a_stalled_stream_within_the_timeout(fake: FakeLLMServer, protocol: str) -> None:
    fake.push(Step.stall("one two three four five six seven", after=4, hang=10))
    settings = ClientSettings(max_retries=0, timeout=0.5, connect_timeout=2.0)
    received: list[str] = []
    with (
        connect(fake, protocol, settings=settings) as provider,
        pytest.raises(ProviderUnavailable) as err,
    ):
        for event in provider.stream(Request(messages=[user("go")])):
            if isinstance(event, TextDelta):
                received.append(event.text)
    assert err.value.code == "timeout"
    # Some deltas arrived before the stall; no Done was produced for a partial answer.
    assert received and "".join(received) != "one two three four five six seven"


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_stream_of_keep_alives_fails_at_the_calls_deadline(
    fake: FakeLLMServer, protocol: str
) -> None:
    # Bytes keep coming (SSE comments), so no read ever times out: only the call's
    # overall deadline ends it, retries included.
    fake.push(Step.trickle("one two three four five", after=3, every=0.1, hang=30))
    settings = ClientSettings(max_retries=2, timeout=20.0, connect_timeout=2.0, deadline=1.5)
    started = time.monotonic()
    with (
        connect(fake, protocol, settings=settings) as provider,
        pytest.raises(ProviderUnavailable) as err,
    ):
        list(provider.stream(Request(messages=[user("go")])))
    elapsed = time.monotonic() - started
    assert err.value.code == "deadline", err.value
    assert "deadline" in str(err.value)
    assert elapsed < 10, elapsed  # not 30 s of keep-alives, nor three attempts of them


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_silent_server_fails_at_the_deadline_before_the_read_timeout(
    fake: FakeLLMServer, protocol: str
) -> None:
    fake.push(Step.wait(30, "late"), Step.wait(30, "late"), Step.wait(30, "late"))
    settings = ClientSettings(max_retries=2, timeout=20.0, connect_timeout=2.0, deadline=1.0)
    started = time.monotonic()
    with connect(fake, protocol, settings=settings) as provider, pytest.raises(ProviderUnavailable):
        provider.complete(Request(messages=[user("go")]))
    assert time.monotonic() - started < 10


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_stream_that_does_not_begin_fails_at_the_first_byte_deadline(
    fake: FakeLLMServer, protocol: str
) -> None:
    # The server takes the request and says nothing: each try gives up after the
    # first-byte wait, not the (long) read timeout, and says which limit it was.
    fake.push(Step.wait(5, "late"), Step.wait(5, "late"), Step.wait(5, "late"))
    settings = ClientSettings(max_retries=2, timeout=20.0, connect_timeout=2.0, first_byte=0.3)
    with (
        connect(fake, protocol, settings=settings) as provider,
        pytest.raises(ProviderUnavailable) as err,
    ):
        list(provider.stream(Request(messages=[user("go")])))
    assert err.value.code == "first_byte_timeout", err.value
    assert "ARBOR_PROVIDER_FIRST_BYTE" in str(err.value)
    assert len(fake.requests) == 3  # every try was made, each cut at its first byte


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_the_first_byte_deadline_does_not_cut_a_stream_that_began(
    fake: FakeLLMServer, protocol: str
) -> None:
    # Once events flow, a pause longer than the first-byte wait is the read timeout's
    # business: this stream pauses 1 s and then drops, and is reported as cut off.
    fake.push(Step.stall("one two three four five", after=2, hang=1.0))
    settings = ClientSettings(max_retries=0, timeout=20.0, connect_timeout=2.0, first_byte=0.3)
    with (
        connect(fake, protocol, settings=settings) as provider,
        pytest.raises(ProviderUnavailable) as err,
    ):
        list(provider.stream(Request(messages=[user("go")])))
    assert err.value.code == "stream_incomplete", err.value


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_an_answer_sent_whole_has_no_first_byte_deadline(
    fake: FakeLLMServer, protocol: str
) -> None:
    # A non-streamed answer arrives whole: its wait is bounded by the read timeout only.
    fake.push(Step.wait(0.8, "slow but whole"))
    settings = ClientSettings(max_retries=0, timeout=20.0, connect_timeout=2.0, first_byte=0.3)
    with connect(fake, protocol, settings=settings) as provider:
        reply = provider.complete(Request(messages=[user("go")]))
    assert reply.text == "slow but whole"


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_it_rejects_a_stream_cut_off_mid_answer(fake: FakeLLMServer, protocol: str) -> None:
    # The server drops the connection after a few events: a partial answer is an error,
    # never a Done with half a reply.
    fake.push(Step.stall("one two three four five six seven", after=4, hang=0.05))
    with connect(fake, protocol) as provider, pytest.raises(ProviderUnavailable) as err:
        list(provider.stream(Request(messages=[user("go")])))
    assert err.value.code == "stream_incomplete"


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_it_keeps_invalid_tool_json_from_the_model(fake: FakeLLMServer, protocol: str) -> None:
    fake.push(
        Step.tools({"id": "c9", "name": "add", "arguments": '{"a": 1,'}),
        Step.tools({"id": "c10", "name": "add", "arguments": '{"a": 1,'}),
    )
    with connect(fake, protocol) as provider:
        plain = provider.complete(Request(messages=[user("add")], tools=[ADD]))
        done = list(provider.stream(Request(messages=[user("add")], tools=[ADD])))[-1]
    assert isinstance(done, Done)
    assert plain.tool_calls[0]["arguments"] == {"_raw": '{"a": 1,'}
    assert done.reply.tool_calls[0]["arguments"] == {"_raw": '{"a": 1,'}


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_it_never_shows_the_key_in_errors_or_the_fake_log(protocol: str) -> None:
    with FakeLLMServer(require_api_key="the-right-key") as fake:
        with connect(fake, protocol) as provider:
            with pytest.raises(AuthenticationFailed) as err:
                provider.complete(Request(messages=[user("hi")]))
            # A provider that echoes the key in an error body is redacted too.
            fake.require_api_key = None
            fake.push(Step.error(400, f"bad request from key {KEY} (Bearer {KEY})"))
            with pytest.raises(BadRequest) as echoed:
                provider.complete(Request(messages=[user("hi")]))
        log = fake.log_text()
    for exc in (err.value, echoed.value):
        shown = f"{exc} {exc!r} {exc.as_dict()} {exc.args}"
        assert KEY not in shown and "SECRET" not in shown
        assert exc.__cause__ is None and exc.__suppress_context__
    assert "[redacted]" in str(echoed.value)
    assert KEY not in log and "SECRET" not in log
    assert all(r.authenticated for r in fake.requests)
    assert all(
        "authorization" not in r.headers and "x-api-key" not in r.headers for r in fake.requests
    )


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_it_reads_the_key_from_a_file_variable(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, protocol: str
) -> None:
    key_file = tmp_path / "key"
    key_file.write_text("file-held-key-123\n", encoding="utf-8")
    env = "OPENAI_API_KEY_FILE" if protocol == "openai" else "ANTHROPIC_API_KEY_FILE"
    monkeypatch.setenv(env, str(key_file))
    with FakeLLMServer(require_api_key="file-held-key-123") as fake:
        with connect(fake, protocol, api_key=None) as provider:
            assert provider.complete(Request(messages=[user("hi")])).text.startswith("Echo: hi")
        assert "file-held-key-123" not in fake.log_text()


def test_it_refuses_to_call_openai_without_a_key() -> None:
    with pytest.raises(AuthenticationFailed, match="set OPENAI_API_KEY"):
        make_provider("openai/gpt-4o-mini")


def test_the_fake_demo_model_answers_offline_with_an_echo() -> None:
    with make_provider("fake/echo", settings=FAST) as provider:
        reply = provider.complete(Request(messages=[user("안녕하세요")]))
        events = list(provider.stream(Request(messages=[user("stream me")])))
    assert reply.text.startswith("Echo: 안녕하세요")
    assert "offline demo model" in reply.text
    done = events[-1]
    assert isinstance(done, Done) and done.reply.text.startswith("Echo: stream me")


def test_the_demo_servers_log_is_bounded() -> None:
    from conversations.providers.fake import SHARED_LOG_LIMIT

    with FakeLLMServer(log_limit=SHARED_LOG_LIMIT) as server:
        with connect(server, "openai") as provider:
            for i in range(SHARED_LOG_LIMIT + 10):
                provider.complete(Request(messages=[user(f"message {i}")]))
        log = server.requests
    assert len(log) == SHARED_LOG_LIMIT
    assert "message 59" in json.dumps(log[-1].body)  # the newest are the ones kept


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_paced_stream_spreads_its_deltas_out(fake: FakeLLMServer, protocol: str) -> None:
    # The fake paces its events like a model's tokens (the browser tests rely on seeing
    # an answer grow): ten words 150 ms apart are sent over ~1.4 s, in order, and arrive
    # spread out (a reader a busy machine holds up for a second still sees that).
    words = "one two three four five six seven eight nine ten"
    fake.push(Step.reply(words, pace=0.15))
    arrivals: list[float] = []
    text = ""
    with connect(fake, protocol) as provider:
        for event in provider.stream(Request(messages=[user("go")])):
            delta = getattr(event, "text", None)
            if isinstance(delta, str) and delta:
                arrivals.append(time.monotonic())
                text += delta
    assert text == words
    assert len(arrivals) >= 5 and arrivals[-1] - arrivals[0] >= 0.3
