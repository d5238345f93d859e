"""Compaction over the tree: records, reuse by branches, failures, and the reactive path
against the fake provider (DESIGN.md invariants 8, 9, 11)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any
from unittest import mock

import pytest
from django.test import Client, TestCase, override_settings

from compaction import services as compaction
from compaction.ladder import ContextView
from compaction.models import CompactionRecord, ModelCalibration
from compaction.render import tesseract_available
from conversations import services
from conversations.models import Conversation, Message
from conversations.providers import resolve_model
from conversations.providers.fake import FakeLLMServer, Step
from conversations.services import transcript_resume
from tests.builders import grow, make_user, text
from tests.fake_models import serve_fake_models

FAKE = FakeLLMServer(context_window=4000)
# Declared with twice the window the fake enforces: Arbor's budget lets requests through
# that the provider rejects, as when a local estimate undercounts.
LIAR: dict[str, object] = {"context_window": 8000, "max_output": 256, "vision": False}


# A vision model billed like Claude, with room for a few snapshot pages.
VISION: dict[str, object] = {"context_window": 12000, "max_output": 256, "vision": True}


@pytest.fixture(scope="module", autouse=True)
def fake_provider() -> Iterator[FakeLLMServer]:
    with serve_fake_models(FAKE, extra={"openai/liar": LIAR, "openai/vision": VISION}) as server:
        yield server


class ContextTests(TestCase):
    @classmethod
    def setUpTestData(cls) -> None:
        cls.user = make_user()
        _, cls.secret = services.api_token_create(user=cls.user, name="t")

    def setUp(self) -> None:
        FAKE.clear()
        self.api = Client(HTTP_AUTHORIZATION=f"Bearer {self.secret}")
        self.spec = resolve_model("openai/textonly")

    def context(self, conv: Conversation, *, method: str = "post", **params: Any) -> Any:
        """POST compacts (and keeps a record); GET only reads."""
        url = f"/api/conversations/{conv.pk}/context"
        query = {"model": "openai/textonly", **params}
        if method == "post":
            url += "?" + "&".join(f"{k}={v}" for k, v in query.items())
            response = self.api.post(url)
        else:
            response = self.api.get(url, query)
        assert response.status_code == 200, response.content
        return response.json()

    def test_a_path_that_fits_is_sent_as_it_is(self) -> None:
        conv = services.conversation_create(owner=self.user, title="short")
        grow(conv, 2)
        body = self.context(conv)
        assert body["fits"] and body["record"] is None and body["rungs"] == []
        assert len(body["request"]["messages"]) == 8
        assert not CompactionRecord.objects.exists()

    def test_elision_is_recorded_with_the_originals_reachable(self) -> None:
        conv = services.conversation_create(owner=self.user, title="long")
        grow(conv, 16)
        body = self.context(conv)
        assert body["fits"] and body["rungs"][0]["rung"] == "elision"
        record = CompactionRecord.objects.get(pk=body["record"])
        assert record.anchor_id == conv.tip_id and record.status == "ready"
        assert record.tokens_after < record.tokens_before <= 10**6
        sent = json.dumps(body["request"]["messages"])
        elided = [r["message"] for r in body["rungs"][0]["replaced"]]
        assert elided and all(f"[elided tool result {mid}:" in sent for mid in elided)
        # Every elided original is still in the tree, untouched.
        for mid in elided:
            assert "log line ok" in json.dumps(Message.objects.get(pk=mid).parts)
        # Narration is never elided.
        for i in range(16):
            assert f"step {i}: read the log" in sent and f"step {i} done" in sent

    def test_branches_below_the_anchor_reuse_the_record_and_above_it_do_not(self) -> None:
        conv = services.conversation_create(owner=self.user, title="long")
        grow(conv, 16)
        first = self.context(conv)
        anchor = conv.tip_id
        # Two branches below the anchor.
        for word in ("left", "right"):
            services.turn_append(
                conversation=conv,
                parent_id=anchor,
                expected_version=None,
                messages=[{"role": "user", "parts": text(word)}],
            )
            conv.refresh_from_db()
            body = self.context(conv)
            assert body["record"] == first["record"] and body["reused"], word
            assert word in json.dumps(body["request"]["messages"])
        # A branch that leaves the path above the anchor gets its own compaction.
        early = Message.objects.filter(conversation=conv, depth=59).get()
        services.turn_append(
            conversation=conv,
            parent_id=early.id,
            expected_version=None,
            messages=[{"role": "user", "parts": text("another way")}],
        )
        conv.refresh_from_db()
        body = self.context(conv)
        assert body["record"] != first["record"] and not body["reused"]
        assert CompactionRecord.objects.filter(conversation=conv).count() == 2

    def test_a_failed_compaction_leaves_no_record_in_use(self) -> None:
        conv = services.conversation_create(owner=self.user, title="long")
        grow(conv, 16)
        real = compaction.run_ladder

        def boom(view: ContextView, **options: Any) -> Any:
            if options.get("summarize") is not None:  # the compaction, not the free look
                raise RuntimeError("boom")
            return real(view, **options)

        with mock.patch("compaction.services.run_ladder", side_effect=boom):
            response = self.api.post(f"/api/conversations/{conv.pk}/context?model=openai/textonly")
        # Never a 200 that looks like an empty context: a 502 naming the failure.
        assert response.status_code == 502, response.content
        failed = response.json()
        assert failed["error"] == "compaction_failed" and "boom" in failed["detail"]
        record = CompactionRecord.objects.get(pk=failed["record"])
        assert "boom" in record.error and record.view == []
        # The conversation works as before: the next call compacts afresh.
        body = self.context(conv)
        assert body["record"] != failed["record"] and body["fits"]

    def test_a_stranger_cannot_read_the_context(self) -> None:
        conv = services.conversation_create(owner=self.user, title="mine")
        grow(conv, 1)
        other = make_user("mallory")
        _, secret = services.api_token_create(user=other, name="m")
        response = Client(HTTP_AUTHORIZATION=f"Bearer {secret}").get(
            f"/api/conversations/{conv.pk}/context"
        )
        assert response.status_code == 404


class ReactiveTests(TestCase):
    """The provider rejects a request the local estimate let through."""

    @classmethod
    def setUpTestData(cls) -> None:
        cls.user = make_user()
        _, cls.secret = services.api_token_create(user=cls.user, name="t")

    def test_overflow_recovers_without_resending_or_oversized_summaries(self) -> None:
        FAKE.clear()
        api = Client(HTTP_AUTHORIZATION=f"Bearer {self.secret}")
        conv = services.conversation_create(owner=self.user, title="big", model="openai/liar")
        # Eventful results (errors are never elided), so only a summary can save room.
        grow(conv, 14, result_chars=1200, error=True)
        # Every summary call (chunks, then a merge) answers with this; the final answer
        # comes from the fake's default reply once the script runs out.
        FAKE.push(*[Step.reply("Summary: steps read logs that failed.")] * 3)
        response = api.post(
            f"/api/conversations/{conv.pk}/messages",
            {"parts": text("how far are we?")},
            content_type="application/json",
        )
        assert response.status_code == 201, response.content
        log = FAKE.requests
        rejected = [r for r in log if (r.prompt_tokens or 0) > 4000]
        assert len(rejected) == 1, [r.prompt_tokens for r in log]
        bodies = [json.dumps(r.body, sort_keys=True) for r in log]
        # The rejected payload was never sent again.
        assert bodies.count(json.dumps(rejected[0].body, sort_keys=True)) == 1
        # Every request after it fit the provider's window with room to spare.
        after = log[log.index(rejected[0]) + 1 :]
        assert after and all((r.prompt_tokens or 0) < 4000 for r in after)
        calibration = ModelCalibration.objects.get(
            model=resolve_model("openai/liar").calibration_key
        )
        assert calibration.reported_limit == 4000 and calibration.factor >= 1.0
        record = CompactionRecord.objects.get(conversation=conv, trigger="reactive")
        assert record.status == "ready" and [r["rung"] for r in record.rungs] == ["summary"]
        assert record.head_end_id is not None
        # The provider's own count of the request built from the record is kept on it.
        assert record.measured_next_tokens == log[-1].prompt_tokens
        # Summary only because nothing cheaper could help: every result was an error.
        summaries = after[: record.model_calls]
        assert len(summaries) == record.model_calls >= 1
        assert all("summar" in json.dumps(r.body).lower() for r in summaries)
        # The final request carried the summary and the new question, not the logs.
        final = json.dumps(log[-1].body)
        assert "Summary: steps read logs that failed." in final and "how far are we?" in final
        assert final.count("log line ok") < 14 * 100
        # The answer is persisted on the tree, the originals untouched.
        answer = Message.objects.get(pk=response.json()["tip"])
        assert answer.parent.parts == text("how far are we?")
        assert Message.objects.filter(conversation=conv).count() == 14 * 4 + 2
        assert all(
            "log line ok" in json.dumps(m.parts)
            for m in Message.objects.filter(conversation=conv, role="tool")
        )


class SnapshotJobTests(TestCase):
    # OCR takes seconds a dense page: this job measures one of its pages.
    @override_settings(ARBOR_OCR_MAX_PAGES=1)
    def test_a_job_renders_pages_from_the_originals_and_measures_them(self) -> None:
        user = make_user()
        conv = services.conversation_create(owner=user, title="agent", model="openai/vision")
        # Error results are eventful: elision cannot help, pages must.
        grow(conv, 40, result_chars=1200, error=True)
        assert conv.tip_id is not None
        with self.captureOnCommitCallbacks(execute=True):
            job = compaction.job_enqueue(
                conversation=conv, anchor_id=conv.tip_id, model_id="openai/vision",
                trigger="proactive",
            )  # fmt: skip
        assert job is not None
        job.refresh_from_db()
        assert job.state == "done", job.error
        assert job.record_id is not None
        record = CompactionRecord.objects.get(pk=job.record_id)
        assert [r["rung"] for r in record.rungs][-1] == "snapshot", record.rungs
        assert record.model_calls == 0 and record.tokens_after <= record.budget_tokens
        # The head kept verbatim ends with the first turn, just above the first page.
        assert record.head_end_id is not None
        head_last = Message.objects.get(pk=record.head_end_id, conversation=conv)
        first_covered = Message.objects.get(pk=record.rungs[-1]["replaced"][0]["message"])
        assert first_covered.depth == head_last.depth + 1
        pages = list(record.pages.all())
        assert len(pages) >= 2
        for page in pages:
            assert page.blob.mime == "image/png" and page.billed_tokens > 0
            assert page.blob.owners.filter(pk=user.pk).exists()
        if tesseract_available():
            first, *rest = pages
            assert first.ocr_cer is not None and first.ocr_cer < 0.1
            assert all(page.ocr_cer is None for page in rest)  # over the limit: not measured
        # Re-rendering the same originals gives the same pages: same blobs.
        again = compaction.compaction_run(
            conversation=conv,
            spec=resolve_model("openai/vision"),
            view=ContextView.build(
                transcript_resume(conversation=conv, tip_id=conv.tip_id)[0],
                budget_tokens=record.budget_tokens,
                model=compaction.model_info(resolve_model("openai/vision")),
            ),
            anchor_id=conv.tip_id,
            trigger="manual",
            summarize=None,
        )
        assert [p.blob_id for p in again[0].pages.all()] == [p.blob_id for p in pages]


def test_the_pages_measured_are_spread_from_the_first_to_the_last() -> None:
    pages = list(range(10))
    assert compaction.pages_to_measure(pages, 4) == [0, 3, 6, 9]
    assert compaction.pages_to_measure(pages, 1) == [0]
    assert compaction.pages_to_measure(pages, 0) == []
    assert compaction.pages_to_measure(pages, 20) == pages


class RenderCacheTests(TestCase):
    def test_pages_are_cached_by_the_hash_of_their_text_and_settings(self) -> None:
        from compaction.render import Segment, render_pages

        renderer = compaction.CapturingRenderer("claude")
        segments = [Segment("user", "m1", "the same archived text " * 50)]
        with mock.patch.object(renderer, "render", wraps=renderer.render) as spy:
            first = renderer(segments)
            second = renderer(segments)
            other = renderer([Segment("user", "m1", "different text " * 50)])
        assert spy.call_count == 2  # the repeat came from the cache
        assert [p.png for p in first.pages] == [p.png for p in second.pages]
        assert [p.png for p in first.pages] == [p.png for p in render_pages(segments).pages]
        assert other.pages[0].png != first.pages[0].png
