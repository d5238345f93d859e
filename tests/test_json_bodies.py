"""Request bodies a JSON parser reads but Arbor must refuse (issue 31): an escaped lone
surrogate, nesting deeper than 64 levels, a key written twice in one object. The parser
(``conversations.parts.strict_json``) names the problem and, where it can, the field;
the API answers 400 in its shape and the gateway in each protocol's."""

from __future__ import annotations

import json
from typing import Any

import orjson
from django.test import Client, SimpleTestCase, TestCase

from conversations import services
from conversations.errors import InvalidInput
from conversations.models import Message
from conversations.parts import MAX_JSON_DEPTH, NotJSON, clean_messages, strict_json
from tests.builders import make_user, new_conversation

JSON = "application/json"


def refused(raw: str | bytes) -> str:
    try:
        strict_json(raw)
    except NotJSON as exc:
        message = str(exc)
        message.encode("utf-8")  # the message itself is text, whatever the body held
        return message
    raise AssertionError(f"{raw[:80]!r} was accepted")


def nested(depth: int, leaf: str = "1") -> bytes:
    return ("[" * depth + leaf + "]" * depth).encode()


class StrictJsonTests(SimpleTestCase):
    def test_it_refuses_a_lone_surrogate_naming_where(self) -> None:
        for raw in (b'"\\ud83d"', b'"\\ude00 x"', b'"\\ud83dx"', '"\\ud83d"', '["\ud83d"]'):
            with self.subTest(raw=raw):
                assert "lone surrogate" in refused(raw)
        message = refused(b'{"messages": [{"content": [{"text": "ok"}, {"text": "a\\ud83d"}]}]}')
        assert "messages[0].content[1].text" in message, message
        assert "lone surrogate" in refused(b'{"a": {"\\udc00": 1}}')

    def test_a_whole_pair_is_text(self) -> None:
        assert strict_json(b'{"e": "\\ud83d\\ude00"}') == {"e": "\U0001f600"}
        assert strict_json('{"e": "\\ud83d\\ude00"}') == {"e": "\U0001f600"}

    def test_it_refuses_nesting_deeper_than_64(self) -> None:
        assert strict_json(nested(MAX_JSON_DEPTH)) is not None
        for depth in (MAX_JSON_DEPTH + 1, 1_000, 2_000, 100_000):
            for raw in (nested(depth), nested(depth, '{"a": NaN}'), nested(depth)[:-1]):
                with self.subTest(depth=depth, raw=raw[-12:]):
                    assert "deeper than 64" in refused(raw)
        deep = b'{"messages": [{"metadata": ' + b'{"a": ' * 70 + b"1" + b"}" * 71 + b"]}"
        message = refused(deep)
        assert "deeper than 64" in message and "messages[0].metadata.a.a" in message, message
        # Brackets inside strings are text, not nesting.
        assert strict_json(b'{"s": "' + b"[" * 1000 + b'"}') == {"s": "[" * 1000}

    def test_it_refuses_a_key_written_twice_naming_it(self) -> None:
        message = refused(b'{"model": "claude-opus-4-1", "model": "cheap-claude", "x": 1}')
        assert '"model"' in message and "twice" in message, message
        message = refused(b'{"messages": [{"role": "user", "role": "assistant"}]}')
        assert '"role"' in message and "messages[0]" in message, message
        assert "twice" in refused('{"a": 1, "a": 1}')
        assert "twice" in refused(b'{"a" : 1,\n "a"\n:\t2}')
        assert "twice" in refused(b'{"n": 123456789012345678901234567890, "n": 1}')

    def test_what_only_looks_like_a_repeated_key_is_read(self) -> None:
        # Colons, quotes and backslashes inside strings are text: tool arguments are
        # often JSON written into a string.
        for value in (
            {"arguments": '{"path": "a", "path2": "b"}', "k": ":", "q": '":', "b": "\\"},
            {"a": ":x", "b": "\\\\", "c": '\\":', "d": {"e": ' ": '}},
            [{"a": 1}, {"a": 2}, {"a": {"a": [{"a": None}]}}],
        ):
            for raw in (orjson.dumps(value), json.dumps(value, indent=2).encode()):
                with self.subTest(raw=raw):
                    assert strict_json(raw) == value
                    assert strict_json(raw.decode()) == value


class MessageValidationTests(SimpleTestCase):
    def test_parts_holding_a_lone_surrogate_are_invalid_whatever_the_entry(self) -> None:
        # What reaches the services without strict_json (a form, a provider's answer
        # read by its SDK) is checked again where every message is validated.
        call = {"type": "tool_call", "id": "c1", "name": "f", "arguments": {"k": "\udc00"}}
        raw = [
            {"role": "user", "parts": [{"type": "text", "text": "a\ud83d"}]},
            {"role": "assistant", "parts": [call], "metadata": {"m": ["\ud83d"]}},
        ]
        with self.assertRaises(InvalidInput) as caught:
            clean_messages(raw, max_messages=10, max_chars=1000)
        errors = {e["loc"]: e["msg"] for e in caught.exception.extra["errors"]}
        assert "lone surrogate" in errors["messages[0].parts[0].text"], errors
        assert "lone surrogate" in errors["messages[1].parts[0].arguments"], errors
        assert "lone surrogate" in errors["messages[1].metadata"], errors


class ApiBodyTests(TestCase):
    @classmethod
    def setUpTestData(cls) -> None:
        cls.user = make_user("alice")
        _, cls.secret = services.api_token_create(user=cls.user, name="t")
        cls.conv, cls.n = new_conversation(cls.user, "a>b", title="main")

    def setUp(self) -> None:
        self.api = Client(HTTP_AUTHORIZATION=f"Bearer {self.secret}")

    def turn(self, messages: str) -> Any:
        head = {"parent": str(self.n["b"].pk), "expected_version": self.conv.version}
        raw = json.dumps(head)[:-1] + ', "messages": ' + messages + "}"
        before = Message.objects.count()
        response = self.api.post(
            f"/api/conversations/{self.conv.pk}/turns", raw.encode(), content_type=JSON
        )
        assert Message.objects.count() == before, "a refused body wrote a message"
        assert response.status_code == 400, (response.status_code, response.content[:300])
        body = response.json()
        assert body["error"] == "bad_request", body
        return body["detail"]

    def test_a_turn_with_a_lone_surrogate_is_400_naming_the_field(self) -> None:
        detail = self.turn('[{"role": "user", "parts": [{"type": "text", "text": "a\\ud83d"}]}]')
        assert "lone surrogate" in detail and "messages[0].parts[0].text" in detail, detail

    def test_a_turn_nested_too_deep_is_400(self) -> None:
        deep = "[" * 100_000 + "]" * 100_000
        detail = self.turn(
            '[{"role": "user", "parts": [{"type": "text", "text": "a"}], "metadata": {"x": '
            + deep
            + "}}]"
        )
        assert "deeper than 64" in detail, detail

    def test_a_key_written_twice_is_400_naming_it(self) -> None:
        detail = self.turn(
            '[{"role": "user", "role": "assistant", "parts": [{"type": "text", "text": "a"}]}]'
        )
        assert '"role"' in detail and "twice" in detail, detail


class GatewayBodyTests(TestCase):
    """The gateway answers each problem as its protocol's 400 (``invalid_json``)."""

    @classmethod
    def setUpTestData(cls) -> None:
        cls.user = make_user("alice")
        _, cls.secret = services.api_token_create(user=cls.user, name="t")

    def post(self, protocol: str, raw: bytes) -> dict[str, Any]:
        url = {
            "anthropic": "/gateway/anthropic/v1/messages",
            "openai": "/gateway/openai/v1/chat/completions",
        }[protocol]
        response = self.client.post(
            url, raw, content_type=JSON, HTTP_AUTHORIZATION=f"Bearer {self.secret}"
        )
        assert response.status_code == 400, (response.status_code, response.content[:300])
        assert response["Content-Type"].startswith(JSON)
        body: dict[str, Any] = response.json()
        if protocol == "anthropic":
            assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
        else:
            assert body["error"]["type"] == "invalid_request_error"
            assert body["error"]["code"] == "invalid_json", body
        message: str = body["error"]["message"]
        return {"message": message}

    def test_each_problem_is_a_400_in_the_protocols_shape(self) -> None:
        head = b'{"model": "claude-sonnet-4-5", "max_tokens": 10, "messages": '
        cases = {
            "lone surrogate": head + b'[{"role": "user", "content": "a\\ud83d"}]}',
            "deeper than 64": head + b'[{"role": "user", "content": ' + nested(100_000) + b"}]}",
            '"model" appears twice': head + b'[{"role": "user", "content": "a"}], "model": "x"}',
        }
        for protocol in ("anthropic", "openai"):
            for expected, raw in cases.items():
                with self.subTest(protocol=protocol, problem=expected):
                    assert expected in self.post(protocol, raw)["message"]
