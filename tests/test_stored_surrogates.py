"""Text that is not text: an escaped lone surrogate (``"\\ud83d"``, what JavaScript makes
of an emoji cut in half) is now refused at every JSON entry (tests/test_json_bodies.py),
but a conversation that already holds one (stored on SQLite before the refusal existed)
still renders, exports, is searched and continues, with U+FFFD in its place: no page
answers 500 on stored data (issue 31)."""

from __future__ import annotations

import json
from typing import Any
from unittest import skipIf

from django.db import connection
from django.test import Client, TestCase

from conversations import services
from conversations.models import Message
from conversations.providers.fake import FakeLLMServer, Step
from tests.builders import make_user, new_conversation, text
from tests.fake_models import serve_fake_models

JSON = "application/json"
HALF_EMOJI = "cut \ud83d here"


@skipIf(
    connection.vendor == "postgresql",
    "PostgreSQL's jsonb refuses a lone surrogate, so no conversation there can hold one",
)
class StoredSurrogateTests(TestCase):
    @classmethod
    def setUpTestData(cls) -> None:
        cls.user = make_user("alice")
        _, cls.secret = services.api_token_create(user=cls.user, name="t")
        cls.conv, cls.n = new_conversation(cls.user, "a>b>c", title="half emoji")
        # As an older Arbor stored it on SQLite: the parts hold the lone surrogate
        # (SQLite's JSON keeps it escaped), the search text holds it replaced.
        Message.objects.filter(pk=cls.n["b"].pk).update(
            parts=[
                {"type": "text", "text": HALF_EMOJI},
                {"type": "thinking", "text": "\udc00 alone"},
                {"type": "tool_call", "id": "c1", "name": "f", "arguments": {"k\ud83d": "v"}},
            ],
            search_text="cut \ufffd here",
            metadata={"note": "\ud83d"},
        )
        Message.objects.filter(pk=cls.n["c"].pk).update(parts=text("second \ud83d half"))

    def setUp(self) -> None:
        self.client.force_login(self.user)
        self.api = Client(HTTP_AUTHORIZATION=f"Bearer {self.secret}")

    def ok(self, response: Any) -> Any:
        assert response.status_code == 200, (response.status_code, response.content[:500])
        return response

    def test_it_renders_the_chat_and_tree_pages(self) -> None:
        cid = self.conv.pk
        page = self.ok(self.client.get(f"/c/{cid}/")).content.decode()
        assert "cut \ufffd here" in page
        self.ok(self.client.get(f"/c/{cid}/tree/"))
        self.ok(self.client.get(f"/c/{cid}/history/", {"before": self.n["c"].pk}))
        self.ok(self.client.get(f"/c/{cid}/m/{self.n['b'].pk}/text/"))
        self.ok(self.client.get("/"))

    def test_it_answers_the_api(self) -> None:
        cid = self.conv.pk
        for url in (
            f"/api/conversations/{cid}",
            f"/api/conversations/{cid}/path",
            f"/api/conversations/{cid}/tree",
            f"/api/messages/{self.n['b'].pk}",
            "/api/conversations",
            f"/api/conversations/{cid}/context",
        ):
            with self.subTest(url=url):
                body = self.ok(self.api.get(url)).content
                json.loads(body)  # valid JSON, whatever it replaced
                body.decode("utf-8")  # and valid UTF-8

    def test_it_builds_the_context_for_the_next_request(self) -> None:
        response = self.api.post(
            f"/api/conversations/{self.conv.pk}/context", {}, content_type=JSON
        )
        assert response.status_code == 200, response.content[:500]

    def test_it_exports_every_format(self) -> None:
        for fmt in ("markdown", "arbor", "chatgpt", "claude-code", "pi"):
            with self.subTest(format=fmt):
                response = self.ok(
                    self.api.get(f"/api/conversations/{self.conv.pk}/export?format={fmt}")
                )
                response.content.decode("utf-8")

    def test_the_next_turn_sends_it_as_text(self) -> None:
        with serve_fake_models(FakeLLMServer()) as fake:
            fake.push(Step.reply("understood"))
            response = self.api.post(
                f"/api/conversations/{self.conv.pk}/messages",
                {"parts": text("go on"), "model": "openai/test"},
                content_type=JSON,
            )
            assert response.status_code == 201, response.content[:500]
            sent = json.dumps(fake.requests[-1].body["messages"], ensure_ascii=False)
        assert "cut \ufffd here" in sent and "second \ufffd half" in sent

    def test_it_is_found_by_search(self) -> None:
        page = self.ok(self.client.get("/", {"q": "cut"})).content.decode()
        assert "here" in page
        self.ok(self.client.get("/", {"q": "half"}))
