"""The ladder's promises through the real services, the API and the loopback provider:
recovery from the originals, record reuse at the request's own budget, read-only GETs,
images for models without vision, byte limits, calibration that counts what is sent,
provider-ready request bodies, and the 413 before any summary call."""

from __future__ import annotations

import io
import json
import random
from collections.abc import Iterator
from typing import Any

import pytest
from anthropic.types.message_create_params import (
    MessageCreateParamsNonStreaming,
    MessageCreateParamsStreaming,
)
from django.conf import settings
from django.test import Client, TestCase
from openai.types.chat.completion_create_params import CompletionCreateParamsNonStreaming
from PIL import Image
from pydantic import TypeAdapter

from compaction.estimate import Calibration
from compaction.models import CompactionRecord, ModelCalibration
from conversations import services
from conversations.models import Blob, Conversation, Message
from conversations.providers import resolve_model
from conversations.providers.fake import FakeLLMServer, Step, count_openai_request
from tests.builders import grow, make_user, snapshot_page_blobs, text
from tests.fake_models import serve_fake_models

FAKE = FakeLLMServer(context_window=12_000)
MODELS: dict[str, dict[str, object]] = {
    # Vision, billed like OpenAI tiles (the fake decodes every image it is sent).
    "openai/vision": {"context_window": 12_000, "max_output": 256, "vision": True},
    "openai/blind": {"context_window": 12_000, "max_output": 256, "vision": False},
}


@pytest.fixture(scope="module", autouse=True)
def fake_provider() -> Iterator[FakeLLMServer]:
    with serve_fake_models(FAKE, window=12_000, extra=MODELS) as server:
        yield server


def force(value: Any) -> Any:
    """Consume pydantic's lazy iterators so every nested item is validated."""
    if isinstance(value, dict):
        return {k: force(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [force(v) for v in value]
    if hasattr(value, "__next__"):
        return [force(v) for v in value]
    return value


ANTHROPIC_BODY = TypeAdapter(MessageCreateParamsNonStreaming)
ANTHROPIC_STREAM = TypeAdapter(MessageCreateParamsStreaming)
OPENAI_BODY = TypeAdapter(CompletionCreateParamsNonStreaming)


def noise_png(width: int, height: int) -> bytes:
    """An incompressible PNG: its bytes are about 3 per pixel."""
    rng = random.Random(width * height)
    image = Image.frombytes("RGB", (width, height), rng.randbytes(width * height * 3))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", compress_level=1)
    return buffer.getvalue()


def sent_texts(body: dict[str, Any]) -> str:
    return json.dumps(body.get("messages"), ensure_ascii=False)


def images_in(body: dict[str, Any]) -> list[str]:
    """The data URLs (OpenAI) or base64 sources (Anthropic) of every image sent."""
    found: list[str] = []

    def walk(value: Any) -> None:
        if isinstance(value, dict):
            if value.get("type") == "image_url":
                found.append(value["image_url"]["url"])
            elif value.get("type") == "image":
                found.append(value["source"].get("data", ""))
            for inner in value.values():
                walk(inner)
        elif isinstance(value, list):
            for inner in value:
                walk(inner)

    walk(body.get("messages"))
    return found


class Base(TestCase):
    @classmethod
    def setUpTestData(cls) -> None:
        cls.user = make_user()
        _, cls.secret = services.api_token_create(user=cls.user, name="t")

    def setUp(self) -> None:
        FAKE.clear()
        FAKE.context_window = 12_000
        FAKE.windows.clear()
        self.api = Client(HTTP_AUTHORIZATION=f"Bearer {self.secret}")

    def chat(self, conv: Conversation, words: str, status: int = 201) -> dict[str, Any]:
        response = self.api.post(
            f"/api/conversations/{conv.pk}/messages",
            {"parts": text(words)},
            content_type="application/json",
        )
        assert response.status_code == status, response.content
        body: dict[str, Any] = response.json()
        return body

    def context(self, conv: Conversation, method: str = "get", **query: Any) -> dict[str, Any]:
        url = f"/api/conversations/{conv.pk}/context"
        if query:
            url += "?" + "&".join(f"{k}={v}" for k, v in query.items())
        response = self.api.get(url) if method == "get" else self.api.post(url)
        assert response.status_code == 200, response.content
        body: dict[str, Any] = response.json()
        return body


class RecoveryTests(Base):
    def test_an_overflow_after_a_snapshot_record_is_recovered_from_the_originals(self) -> None:
        conv = services.conversation_create(owner=self.user, title="agent", model="openai/vision")
        # Error results are eventful: only pages can make room.
        grow(conv, 30, result_chars=1200, error=True)
        made = self.context(conv, "post")
        assert made["fits"] and made["rungs"][-1]["rung"] == "snapshot", made["rungs"]
        pages = len(images_in(made["request"]))
        assert pages >= 1
        # The provider enforces less than declared: the request built from the record
        # is rejected (by a little: pages can still fit), and the turn must recover.
        counted = count_openai_request(made["request"])
        FAKE.context_window = counted - 20
        answer = self.chat(conv, "what now?")
        log = FAKE.requests
        rejected = [r for r in log if r.status == 400]
        assert len(rejected) == 1, [(r.status, r.prompt_tokens) for r in log]
        # The retry is the request right after the rejected one (a proactive job may
        # follow the turn with requests of its own).
        retry = log[log.index(rejected[0]) + 1]
        assert retry.status == 200 and (retry.prompt_tokens or 0) <= counted - 20
        body = retry.body
        # The middle is still there as pages, never stripped as "images".
        assert images_in(body), "the retry lost the snapshot pages"
        page_blobs = snapshot_page_blobs(conv)
        for sha in page_blobs:
            assert f"[image {sha}" not in sent_texts(body)
        record = CompactionRecord.objects.get(conversation=conv, trigger="reactive")
        assert record.status == "ready" and "snapshot" in record.rung_names
        assert json.dumps(rejected[0].body, sort_keys=True) != json.dumps(body, sort_keys=True)
        assert Message.objects.get(pk=answer["tip"]).role == "assistant"


class ReuseTests(Base):
    def test_a_record_made_for_a_tiny_budget_is_not_reused_at_the_models_own(self) -> None:
        conv = services.conversation_create(owner=self.user, title="t", model="openai/blind")
        grow(conv, 60)  # uneventful results: elision alone fits the model's budget
        tiny = self.context(conv, "post", budget=700)
        assert "summary" in [r["rung"] for r in tiny["rungs"]]
        summary_text = CompactionRecord.objects.get(pk=tiny["record"]).summary
        assert summary_text  # the summary text is kept on the record (the audit shows it)
        FAKE.clear()
        self.chat(conv, "and now?")
        [turn] = [r for r in FAKE.requests if r.status == 200]
        assert summary_text[:40] not in sent_texts(turn.body)
        assert "[elided tool result" in sent_texts(turn.body)


class ReadOnlyGetTests(Base):
    def test_a_get_writes_nothing_and_calls_no_model(self) -> None:
        conv = services.conversation_create(owner=self.user, title="t", model="openai/blind")
        grow(conv, 30, result_chars=1200, error=True)  # only a summary would fit
        blobs = Blob.objects.count()
        body = self.context(conv)
        assert not body["fits"] and body["needs_summary"] and body["record"] is None
        assert FAKE.requests == []
        assert not CompactionRecord.objects.filter(conversation=conv).exists()
        assert Blob.objects.count() == blobs

    def test_a_get_shows_the_pages_the_next_request_would_carry(self) -> None:
        conv = services.conversation_create(owner=self.user, title="t", model="openai/vision")
        grow(conv, 30, result_chars=1200, error=True)
        blobs = Blob.objects.count()
        body = self.context(conv)
        assert body["fits"] and body["record"] is None
        assert body["rungs"][-1]["rung"] == "snapshot"
        urls = images_in(body["request"])
        assert urls and all(u.startswith("data:image/png;base64,") for u in urls)
        assert Blob.objects.count() == blobs and FAKE.requests == []


class ImageTests(Base):
    def shown(self, conv: Conversation, data: bytes, words: str) -> Blob:
        """A first turn: the user shows an image (stored as a blob) with ``words``."""
        blob = services.blob_store(owner=self.user, data=data)
        image = {"type": "image", "blob": blob.sha256, "mime": "image/png"}
        response = self.api.post(
            f"/api/conversations/{conv.pk}/turns",
            {
                "parent": None,
                "expected_version": 0,
                "messages": [{"role": "user", "parts": [*text(words), image]}],
            },
            content_type="application/json",
        )
        assert response.status_code == 201, response.content
        conv.refresh_from_db()
        return blob

    def test_a_model_without_vision_never_receives_an_image(self) -> None:
        conv = services.conversation_create(owner=self.user, title="t", model="openai/blind")
        blob = self.shown(conv, noise_png(64, 48), "this chart")
        self.chat(conv, "what does it show?")
        body = FAKE.requests[-1].body
        assert images_in(body) == []
        assert f"[image {blob.sha256} 64x48 not sent" in sent_texts(body)

    def test_an_image_over_the_providers_byte_limit_is_recompressed(self) -> None:
        conv = services.conversation_create(owner=self.user, title="t", model="anthropic/test")
        FAKE.windows["test"] = 12_000
        data = noise_png(1400, 1400)
        assert len(data) > 5 * 1024 * 1024  # over Anthropic's 5 MB an image
        blob = self.shown(conv, data, "this photo")
        self.chat(conv, "describe it")
        [sent] = FAKE.requests
        assert sent.status == 200
        [payload] = images_in(sent.body)
        assert len(payload) * 3 // 4 <= 5 * 1024 * 1024
        # The original stays in the tree, untouched; the smaller copy is a blob of its own.
        first = Message.objects.get(conversation=conv, depth=0)
        assert first.parts[1]["blob"] == blob.sha256


class CalibrationTests(Base):
    def test_one_small_request_with_tools_barely_moves_the_factor(self) -> None:
        conv = services.conversation_create(owner=self.user, title="t", model="openai/test")
        self.chat(conv, "Hi!")
        [request] = FAKE.requests
        assert request.body.get("tools")  # three tools were sent and must be counted
        key = resolve_model("openai/test").calibration_key
        factor = ModelCalibration.objects.get(model=key).factor
        assert 0.8 <= factor <= 1.3, factor

    def test_a_small_request_moves_less_than_a_large_one(self) -> None:
        small = Calibration().observe(40, 160)
        large = Calibration().observe(20_000, 80_000)
        assert small.factor < 1.1 < 1.2 <= large.factor


class ProviderReadyTests(Base):
    def test_context_bodies_validate_against_the_official_sdk_types(self) -> None:
        for model, adapter in (("anthropic/test", ANTHROPIC_BODY), ("openai/test", OPENAI_BODY)):
            conv = services.conversation_create(owner=self.user, title=model, model=model)
            grow(conv, 2)  # the history holds tool calls and results
            body = self.context(conv)["request"]
            force(adapter.validate_python(body))
            assert body["tools"], model  # a history with tool calls needs definitions
            if model.startswith("anthropic"):
                assert body["max_tokens"] == 256
                # The fake enforces what the real API does: this body is accepted.
                response = self.api.post(
                    f"/api/conversations/{conv.pk}/messages",
                    {"parts": text("go on")},
                    content_type="application/json",
                )
                assert response.status_code == 201, response.content

    def test_the_last_tool_round_keeps_the_definitions(self) -> None:
        conv = services.conversation_create(owner=self.user, title="t", model="anthropic/test")
        FAKE.windows["test"] = 12_000
        call = {"name": "current_time", "arguments": {}}
        rounds = settings.ARBOR_MAX_TOOL_ROUNDS
        FAKE.push(*[Step.tools(call) for _ in range(rounds + 1)])
        self.chat(conv, "loop")
        last = FAKE.requests[-1]
        assert last.status == 200 and last.body["tools"]
        assert last.body["tool_choice"] == {"type": "none"}
        for request in FAKE.requests:
            adapter = ANTHROPIC_STREAM if request.body.get("stream") else ANTHROPIC_BODY
            force(adapter.validate_python(request.body))


class TooLargeTests(Base):
    def test_a_message_over_the_window_is_a_413_before_any_summary(self) -> None:
        conv = services.conversation_create(owner=self.user, title="t", model="openai/blind")
        grow(conv, 10, result_chars=1200, error=True)
        body = self.chat(conv, "word " * 60_000, status=413)
        assert body["error"] == "context_overflow"
        assert FAKE.requests == []
        assert not CompactionRecord.objects.filter(conversation=conv).exists()


class RecallTests(Base):
    def test_the_recall_tool_takes_a_full_id_or_the_page_headers_recall_id(self) -> None:
        from compaction.render.engine import recall_id
        from conversations.tools import ToolContext, run_tool

        conv = services.conversation_create(owner=self.user, title="t")
        grow(conv, 2)
        other = services.conversation_create(owner=self.user, title="other")
        grow(other, 1)
        target = Message.objects.filter(conversation=conv, role="tool").first()
        assert target is not None
        context = ToolContext(conversation=conv)
        for given in (str(target.pk), recall_id(str(target.pk)), recall_id(str(target.pk)).upper()):
            out, is_error = run_tool("recall", {"message_id": given}, context)
            assert not is_error and json.loads(out)["id"] == str(target.pk), given
        # A recall id names a message of this conversation only.
        elsewhere = Message.objects.filter(conversation=other).first()
        assert elsewhere is not None
        out, is_error = run_tool("recall", {"message_id": recall_id(str(elsewhere.pk))}, context)
        assert is_error and "no such message" in out


class CalculatorTests(Base):
    def test_a_result_too_large_is_a_tool_error_not_a_failed_turn(self) -> None:
        from conversations.tools import ToolContext, run_tool

        conv = services.conversation_create(owner=self.user, title="t")
        context = ToolContext(conversation=conv)
        # A float overflow, and an integer of 4,800 digits (more than Python writes out).
        for expression in ("999999**100*1.0", "*".join(["999999**100"] * 8)):
            out, is_error = run_tool("calculator", {"expression": expression}, context)
            assert is_error and "too large" in out, (expression, out)
        assert run_tool("calculator", {"expression": "6*7"}, context) == ("42", False)


class RateLimitTests(Base):
    def test_a_429_keeps_retry_after_in_the_body_and_the_header(self) -> None:
        conv = services.conversation_create(owner=self.user, title="t", model="openai/test")
        # Longer than the client waits on its own: the turn fails with the provider's 429.
        FAKE.push(Step.error(429, "slow down", retry_after=3600))
        response = self.api.post(
            f"/api/conversations/{conv.pk}/messages",
            {"parts": text("hello?")},
            content_type="application/json",
        )
        assert response.status_code == 429, response.content
        body = response.json()
        assert body["error"] == "rate_limited" and body["retry_after"] == 3600
        assert response["Retry-After"] == "3600"
        assert body["attempt"]  # the failed attempt, for a retry


class PathLoadTests(Base):
    def test_a_turn_of_three_rounds_loads_the_archived_path_once(self) -> None:
        from django.db import connection
        from django.test.utils import CaptureQueriesContext

        conv = services.conversation_create(owner=self.user, title="t", model="openai/test")
        grow(conv, 3)
        call = {"name": "current_time", "arguments": {}}
        FAKE.push(Step.tools(call), Step.tools(call), Step.reply("done"))
        with CaptureQueriesContext(connection) as queries:
            self.chat(conv, "what time is it, twice?")
        assert len([r for r in FAKE.requests if r.status == 200]) == 3
        paths = [q for q in queries.captured_queries if "WITH RECURSIVE path" in q["sql"]]
        assert len(paths) == 1, len(paths)
