"""The compaction screens through Django's test client: the staff audit with its filters,
the owner's "what the model saw" panel (gauge, records on the path, record pages with
their images) and compaction jobs with progress; for the owner, a stranger (404),
non-staff (403 on the audit) and anonymous users."""

from __future__ import annotations

import datetime
import io
import json
import re
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any
from unittest import mock

import pytest
from django.conf import settings
from django.core.management import call_command
from django.db import connection
from django.test import Client, TestCase, TransactionTestCase, override_settings
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from arbor.procs import process_identity
from compaction import services as compaction
from compaction.models import (
    CompactionJob,
    CompactionRecord,
    JobState,
    RecordStatus,
    SnapshotPage,
    Trigger,
)
from compaction.tasks import run_compaction_job
from conversations import services
from conversations.models import Checkpoint, Conversation
from conversations.providers import resolve_model
from conversations.providers.fake import FakeLLMServer
from tests.builders import gone_process, grow, make_user, new_conversation, tool_turn
from tests.fake_models import serve_fake_models
from tests.live_server import OCR_SECONDS
from tests.test_ui_pages import png_bytes

FAKE = FakeLLMServer()
# A vision model with a small window: a dozen agent turns with eventful (error) results
# overflow it, elision cannot help, and one snapshot page brings it back under budget.
VISION = "openai/vision"
SPEC: dict[str, object] = {"context_window": 4000, "max_output": 256, "vision": True}


@pytest.fixture(scope="module", autouse=True)
def fake_provider() -> Iterator[FakeLLMServer]:
    with serve_fake_models(FAKE, extra={VISION: SPEC}) as server:
        yield server


def long_conversation(owner: Any, title: str = "agent") -> Conversation:
    conv = services.conversation_create(owner=owner, title=title, model=VISION)
    grow(conv, 10, result_chars=1200, error=True)
    return conv


def rung(name: str, before: int, after: int) -> dict[str, Any]:
    return {"rung": name, "tokens_before": before, "tokens_after": after,
            "saved": before - after, "model_calls": 0, "replaced": [], "details": {}}  # fmt: skip


def numbers(html: str) -> dict[str, int]:
    """The gauge's numbers from the context panel: estimate, budget and each section."""
    found = dict(re.findall(r'id="gauge-(\w+)"[^>]*data-tokens="(\d+)"', html))
    found.update(re.findall(r'<tr id="gauge-(\w+)">.*?data-tokens="(\d+)"', html))
    return {name: int(value) for name, value in found.items()}


class Base(TestCase):
    @classmethod
    def setUpTestData(cls) -> None:
        cls.alice = make_user("alice")
        cls.bob = make_user("bob")
        cls.staff = make_user("root", staff=True)
        cls.conv = long_conversation(cls.alice)
        # A real record with a snapshot page, built as the API builds it (no model call).
        context = compaction.context_build(
            conversation=cls.conv, spec=resolve_model(VISION), tip_id=cls.conv.tip_id
        )
        assert context.record is not None and context.record.status == RecordStatus.READY
        cls.record = context.record
        cls.page = cls.record.pages.get()
        SnapshotPage.objects.filter(pk=cls.page.pk).update(ocr_cer=0.0123)
        CompactionRecord.objects.filter(pk=cls.record.pk).update(measured_next_tokens=1811)
        cls.job = CompactionJob.objects.create(
            conversation=cls.conv, anchor_id=cls.conv.tip_id, model=VISION,
            trigger=Trigger.PROACTIVE, state=JobState.RUNNING,
            progress={"stage": "OCR", "done": 1, "total": 3},
        )  # fmt: skip

    def owner_urls(self) -> list[str]:
        c, r = self.conv.pk, self.record.pk
        return [
            f"/c/{c}/context/",
            f"/c/{c}/compactions/{r}/",
            f"/c/{c}/compactions/{r}/blobs/{self.page.blob_id}/",
            f"/c/{c}/compactions/jobs/{self.job.pk}/",
        ]


class AccessTests(Base):
    def test_anonymous_is_sent_to_sign_in(self) -> None:
        for url in [*self.owner_urls(), "/audit/", f"/audit/{self.record.pk}/"]:
            response = self.client.get(url)
            assert response.status_code == 302 and "/login/" in response["Location"], url
        response = self.client.post(f"/c/{self.conv.pk}/compact/")
        assert response.status_code == 302 and "/login/" in response["Location"]
        assert CompactionJob.objects.count() == 1

    def test_a_stranger_gets_404_on_every_page_fragment_blob_and_post(self) -> None:
        self.client.force_login(self.bob)
        for url in self.owner_urls():
            assert self.client.get(url).status_code == 404, url
            assert self.client.get(url, headers={"HX-Request": "true"}).status_code == 404, url
        assert self.client.post(f"/c/{self.conv.pk}/compact/").status_code == 404
        assert CompactionJob.objects.count() == 1

    def test_a_record_or_job_of_another_conversation_is_404(self) -> None:
        other, _ = new_conversation(self.alice, "q>a", title="other")
        self.client.force_login(self.alice)
        for url in self.owner_urls()[1:]:
            moved = url.replace(str(self.conv.pk), str(other.pk))
            assert self.client.get(moved).status_code == 404, moved
        c = self.conv.pk
        assert self.client.get(f"/c/{c}/compactions/{uuid.uuid4()}/").status_code == 404
        assert self.client.get(f"/c/{c}/compactions/not-a-uuid/").status_code == 404
        assert self.client.get(f"/c/{c}/compactions/jobs/not-a-uuid/").status_code == 404

    def test_the_audit_is_staff_only(self) -> None:
        urls = [
            "/audit/",
            "/audit/?rung=snapshot",
            f"/audit/{self.record.pk}/",
            f"/audit/{self.record.pk}/blobs/{self.page.blob_id}/",
        ]
        for user in (self.alice, self.bob):
            self.client.force_login(user)
            for url in urls:
                assert self.client.get(url).status_code == 403, url
        self.client.force_login(self.staff)
        for url in urls:
            assert self.client.get(url).status_code == 200, url

    def test_csrf_is_enforced_on_compact_now(self) -> None:
        conv, _ = new_conversation(self.alice, "q>a", title="short")
        client = Client(enforce_csrf_checks=True)
        client.force_login(self.alice)
        url = f"/c/{conv.pk}/compact/"
        assert client.post(url).status_code == 403
        assert CompactionJob.objects.count() == 1
        page = client.get(f"/c/{conv.pk}/context/")
        token = page.cookies["csrftoken"].value
        with mock.patch.object(run_compaction_job, "delay"):
            response = client.post(url, headers={"X-CSRFToken": token, "HX-Request": "true"})
        assert response.status_code == 200
        assert CompactionJob.objects.filter(trigger=Trigger.MANUAL).count() == 1


class AuditTests(Base):
    @classmethod
    def setUpTestData(cls) -> None:
        super().setUpTestData()
        cls.bob_conv, _ = new_conversation(cls.bob, "q>a", title="Bob's")
        now = timezone.now()

        def record(conv: Conversation, **fields: Any) -> CompactionRecord:
            return CompactionRecord.objects.create(
                conversation=conv, anchor=conv.messages.order_by("-depth")[0],
                model=fields.pop("model", "openai/test"), trigger=Trigger.MANUAL,
                status=fields.pop("status", RecordStatus.READY), **fields,
            )  # fmt: skip

        cls.summary = record(
            cls.bob_conv,
            rungs=[rung("elision", 900, 800), rung("summary", 800, 300)],
            summary='they decided "rung": "snapshot"',  # quotes that must not match
            summary_model="openai/test",
            summary_prompt="Summarise the middle",
            created_at=now - datetime.timedelta(days=10),
        )
        cls.failed = record(
            cls.bob_conv,
            status=RecordStatus.FAILED,
            error="RuntimeError: boom",
            model="anthropic/test",
            created_at=now - datetime.timedelta(days=3),
        )

    def setUp(self) -> None:
        self.client.force_login(self.staff)

    def shown(self, query: str) -> set[uuid.UUID]:
        response = self.client.get(f"/audit/{query}")
        assert response.status_code == 200, response.content
        ids = re.findall(r'id="record-([0-9a-f-]{36})"', response.content.decode())
        return {uuid.UUID(i) for i in ids}

    def test_each_filter(self) -> None:
        everything = {self.record.pk, self.summary.pk, self.failed.pk}
        assert self.shown("") == everything
        assert self.shown("?user=alice") == {self.record.pk}
        assert self.shown("?user=bob") == {self.summary.pk, self.failed.pk}
        assert self.shown("?user=nobody") == set()
        assert self.shown(f"?conversation={self.bob_conv.pk}") == {self.summary.pk, self.failed.pk}
        assert self.shown("?rung=snapshot") == {self.record.pk}
        assert self.shown("?rung=summary") == {self.summary.pk}
        assert self.shown("?rung=elision") == {self.summary.pk}
        assert self.shown("?rung=image_stripping") == set()
        assert self.shown("?status=failed") == {self.failed.pk}
        assert self.shown("?trigger=reactive") == set()
        assert self.shown("?model=anthropic/test") == {self.failed.pk}
        today = timezone.now().date()
        week_ago = (today - datetime.timedelta(days=7)).isoformat()
        assert self.shown(f"?date_from={week_ago}") == {self.record.pk, self.failed.pk}
        assert self.shown(f"?date_to={week_ago}") == {self.summary.pk}
        assert self.shown(f"?date_from={week_ago}&date_to={today.isoformat()}&user=bob") == {
            self.failed.pk
        }

    def test_bad_filters_answer_400_with_the_errors(self) -> None:
        for query in ("?conversation=nope", "?rung=everything", "?date_from=yesterday",
                      "?status=sleeping", "?date_from=2025-02-01&date_to=2025-01-01"):  # fmt: skip
            response = self.client.get(f"/audit/{query}")
            body = response.content.decode()
            assert response.status_code == 400, query
            assert 'role="alert"' in body and 'id="record-' not in body, query
        fragment = self.client.get("/audit/?date_to=soon", headers={"HX-Request": "true"})
        assert fragment.status_code == 400
        assert fragment.content.decode().lstrip().startswith('<div id="records">')

    def test_the_list_fragment_varies_and_history_restore_gets_the_page(self) -> None:
        fragment = self.client.get("/audit/?rung=snapshot", headers={"HX-Request": "true"})
        assert fragment.content.decode().lstrip().startswith('<div id="records">')
        assert "HX-Request" in fragment["Vary"]
        restore = self.client.get(
            "/audit/?rung=snapshot",
            headers={"HX-Request": "true", "HX-History-Restore-Request": "true"},
        )
        assert "<html" in restore.content.decode()

    def test_the_list_costs_the_same_queries_for_any_number_of_records(self) -> None:
        def count() -> int:
            with CaptureQueriesContext(connection) as queries:
                assert self.client.get("/audit/").status_code == 200
            return len(queries)

        few = count()
        for i in range(12):
            conv, _ = new_conversation(make_user(f"user{i}"), "q>a", title=f"c{i}")
            CompactionRecord.objects.create(
                conversation=conv, anchor=conv.messages.all()[0], model="m",
                trigger=Trigger.PROACTIVE, rungs=[rung("elision", 10, 5)],
            )  # fmt: skip
        assert count() == few
        assert "user11" in self.client.get("/audit/").content.decode()

    def test_the_detail_shows_pages_rungs_summary_and_measured_tokens(self) -> None:
        body = self.client.get(f"/audit/{self.record.pk}/").content.decode()
        blob_url = f"/audit/{self.record.pk}/blobs/{self.page.blob_id}/"
        assert f'src="{blob_url}"' in body
        assert f"{self.page.billed_tokens} billed tokens" in body and "OCR CER 0.012" in body
        snapshot = self.record.rungs[-1]
        assert snapshot["rung"] == "snapshot"
        assert (
            f"<td>snapshot</td><td>{snapshot['tokens_before']}</td>"
            f"<td>{snapshot['tokens_after']}</td>" in body
        )
        assert '<dd id="record-measured">1811 tokens</dd>' in body
        assert "(user alice)" in body
        # What the model saw: the page inline, next to the originals it stands for.
        assert 'alt="snapshot page 0"' in body and "log line ok" in body
        image = self.client.get(blob_url)
        assert image.status_code == 200 and image["Content-Type"] == "image/png"
        summary = self.client.get(f"/audit/{self.summary.pk}/").content.decode()
        assert '<code id="summary-model">openai/test</code>' in summary
        assert "Summarise the middle" in summary and "not measured yet" in summary
        assert "<td>summary</td><td>800</td><td>300</td>" in summary
        failed = self.client.get(f"/audit/{self.failed.pk}/").content.decode()
        assert "RuntimeError: boom" in failed

    def test_a_blob_the_record_does_not_show_is_404(self) -> None:
        stray = services.blob_store(owner=self.alice, data=png_bytes("blue"))
        assert self.client.get(f"/audit/{self.record.pk}/blobs/{stray.pk}/").status_code == 404
        assert self.client.get(f"/audit/{uuid.uuid4()}/").status_code == 404


class ContextPanelTests(Base):
    def setUp(self) -> None:
        FAKE.clear()
        self.client.force_login(self.alice)
        _, self.secret = services.api_token_create(user=self.alice, name="t")
        self.api = Client(HTTP_AUTHORIZATION=f"Bearer {self.secret}")

    def api_context(self, conv: Conversation) -> dict[str, Any]:
        """Compact through the API (a POST; the GET only reads)."""
        response = self.api.post(f"/api/conversations/{conv.pk}/context")
        assert response.status_code == 200, response.content
        body: dict[str, Any] = response.json()
        return body

    def panel(self, conv: Conversation) -> tuple[str, dict[str, int]]:
        response = self.client.get(f"/c/{conv.pk}/context/")
        assert response.status_code == 200
        body = response.content.decode()
        return body, numbers(body)

    def assert_gauge_matches(self, gauge: dict[str, int], api: dict[str, Any]) -> None:
        assert gauge["estimate"] == api["estimate"] and gauge["budget"] == api["budget"]
        parts = ("head", "summary", "pages", "tail", "images")
        assert sum(gauge[p] for p in parts) == gauge["estimate"]

    def test_the_nav_links_the_panel(self) -> None:
        body = self.client.get(f"/c/{self.conv.pk}/").content.decode()
        assert f'href="/c/{self.conv.pk}/context/"' in body

    def test_a_short_conversation_fits_and_matches_the_api(self) -> None:
        conv, _ = new_conversation(self.alice, "hello>hi there>more", title="short")
        body, gauge = self.panel(conv)
        api = self.api_context(conv)
        assert api["fits"] and api["record"] is None
        self.assert_gauge_matches(gauge, api)
        assert "Sent as it is" in body and api["model"] in body  # the default model
        assert gauge["head"] > 0 and gauge["tail"] > 0 and gauge["pages"] == 0

    def test_a_long_conversation_reuses_its_record_like_the_api(self) -> None:
        body, gauge = self.panel(self.conv)
        first, second = self.api_context(self.conv), self.api_context(self.conv)
        assert first["record"] == second["record"] == str(self.record.pk) and second["reused"]
        self.assert_gauge_matches(gauge, first)
        self.assert_gauge_matches(gauge, second)
        assert gauge["pages"] >= self.page.billed_tokens and gauge["head"] > 0
        assert f'href="/c/{self.conv.pk}/compactions/{self.record.pk}/"' in body
        assert f'id="record-{self.record.pk}"' in body  # on the path
        # The gauge is drawn with SVG attributes and classes: no inline style.
        assert "<svg" in body and 'class="seg seg-pages"' in body and "style=" not in body

    def test_a_get_never_compacts_nor_calls_a_model(self) -> None:
        conv = long_conversation(self.alice, "fresh")
        body, gauge = self.panel(conv)
        assert not CompactionRecord.objects.filter(conversation=conv).exists()
        assert FAKE.requests == []
        assert "over the budget" in body and gauge["estimate"] > gauge["budget"]
        assert 'id="compact-now"' in body
        # The API compacts the same path; then the panel shows what the API sends.
        api = self.api_context(conv)
        _, after = self.panel(conv)
        self.assert_gauge_matches(after, api)

    def test_a_get_leaves_a_checkpoint_on_a_trimmed_call_alone(self) -> None:
        conv, _ = new_conversation(self.alice)
        turn = services.turn_append(
            conversation=conv, parent_id=None, expected_version=0, messages=tool_turn("go")
        )
        call_id = turn.message_ids[1]
        services.tip_move(conversation=conv, message_id=call_id, expected_version=turn.version)
        # An imported checkpoint on the unanswered call (importers keep what files say).
        imported = Checkpoint.objects.create(
            conversation=conv, label="odd", message_id=call_id, source="user"
        )
        self.panel(conv)
        imported.refresh_from_db()
        assert imported.state == "live"  # the panel only looks
        self.api_context(conv)  # compacting through the API trims, and drops it
        imported.refresh_from_db()
        assert imported.state == "dropped"

    def test_records_off_the_path_are_not_listed(self) -> None:
        first = self.conv.messages.get(depth=0)
        services.turn_append(
            conversation=self.conv, parent_id=first.pk, expected_version=None,
            messages=[{"role": "assistant", "parts": [{"type": "text", "text": "elsewhere"}]}],
        )  # fmt: skip
        body, _ = self.panel(self.conv)
        assert f'id="record-{self.record.pk}"' not in body

    def test_the_panel_fragment_varies_and_history_restore_gets_the_page(self) -> None:
        url = f"/c/{self.conv.pk}/context/"
        fragment = self.client.get(url, headers={"HX-Request": "true"})
        assert fragment.content.decode().lstrip().startswith('<section id="context-overview"')
        assert "HX-Request" in fragment["Vary"]
        restore = self.client.get(
            url, headers={"HX-Request": "true", "HX-History-Restore-Request": "true"}
        )
        assert "<html" in restore.content.decode()

    def test_an_unknown_model_is_reported_not_a_500(self) -> None:
        Conversation.objects.filter(pk=self.conv.pk).update(model="nowhere/nothing")
        response = self.client.get(f"/c/{self.conv.pk}/context/")
        body = response.content.decode()
        assert response.status_code == 200 and 'role="alert"' in body
        assert 'id="compact-now"' not in body  # nothing to press that cannot work

    def test_the_owner_sees_the_record_with_its_pages_served(self) -> None:
        c, r = self.conv.pk, self.record.pk
        body = self.client.get(f"/c/{c}/compactions/{r}/").content.decode()
        blob_url = f"/c/{c}/compactions/{r}/blobs/{self.page.blob_id}/"
        assert f'src="{blob_url}"' in body and "/audit/" not in body
        assert f"{self.page.billed_tokens} billed tokens" in body and "OCR CER 0.012" in body
        assert "1811 tokens" in body and "(user alice)" not in body
        image = self.client.get(blob_url)
        assert image.status_code == 200 and image["Content-Type"] == "image/png"
        assert b"".join(image.streaming_content).startswith(b"\x89PNG")
        stray = services.blob_store(owner=self.alice, data=png_bytes("green"))
        assert self.client.get(f"/c/{c}/compactions/{r}/blobs/{stray.pk}/").status_code == 404


class JobTests(Base):
    def setUp(self) -> None:
        FAKE.clear()
        self.client.force_login(self.alice)
        # OCR takes seconds a page: the screens only need a number.
        patcher = mock.patch("compaction.render.ocr_cer", return_value=0.02)
        patcher.start()
        self.addCleanup(patcher.stop)

    def test_the_panel_shows_open_jobs_with_their_progress(self) -> None:
        body = self.client.get(f"/c/{self.conv.pk}/context/").content.decode()
        assert f'id="job-{self.job.pk}"' in body and 'hx-trigger="every 1s"' in body
        assert "OCR 1/3" in body and '<progress value="1" max="3"' in body

    def fragment(self, job: CompactionJob) -> Any:
        url = f"/c/{job.conversation_id}/compactions/jobs/{job.pk}/"
        return self.client.get(url, headers={"HX-Request": "true"})

    def test_compact_now_runs_a_job_whose_fragment_shows_the_record(self) -> None:
        conv = long_conversation(self.alice, "fresh")
        # Without a broker the job runs in-process once the request's work commits (in
        # a TestCase: when the captured on-commit callbacks run).
        with self.captureOnCommitCallbacks(execute=True):
            response = self.client.post(f"/c/{conv.pk}/compact/", headers={"HX-Request": "true"})
        job = CompactionJob.objects.get(conversation=conv)
        assert response.content.decode().lstrip().startswith(f'<article id="job-{job.pk}"')
        assert "HX-Request" in response["Vary"]
        assert job.state == JobState.DONE and job.trigger == Trigger.MANUAL, job.error
        assert job.record is not None and job.progress["stage"] == "done"
        fragment = self.fragment(job)
        body = fragment.content.decode()
        assert body.lstrip().startswith(f'<article id="job-{job.pk}" class="job done"')
        assert f'href="/c/{conv.pk}/compactions/{job.record_id}/"' in body
        assert "every 1s" not in body and fragment["HX-Trigger"] == "arbor:compacted"
        page = job.record.pages.get()
        assert page.ocr_cer == 0.02

    @override_settings(ARBOR_COMPACTION_MAX_OPEN=3)
    def test_a_user_has_at_most_so_many_jobs_open(self) -> None:
        # Alice has one job running (setUpTestData); two more wait in the queue.
        for title in ("one", "two"):
            conv = long_conversation(self.alice, title)
            assert conv.tip_id is not None
            CompactionJob.objects.create(
                conversation=conv, anchor_id=conv.tip_id, model=VISION, trigger=Trigger.MANUAL
            )
        fourth = long_conversation(self.alice, "four")
        assert fourth.tip_id is not None
        with self.captureOnCommitCallbacks(execute=True):
            response = self.client.post(f"/c/{fourth.pk}/compact/", headers={"HX-Request": "true"})
        assert response.status_code == 429
        assert "3 compaction jobs waiting or running" in response.content.decode()
        assert not CompactionJob.objects.filter(conversation=fourth).exists()
        # Without HTMX: back to the panel, with the reason as a message.
        page = self.client.post(f"/c/{fourth.pk}/compact/", follow=True)
        assert "the limit is 3" in page.content.decode()
        # A turn's proactive check is not refused, it just does not queue (the next
        # turn asks again).
        assert (
            compaction.job_enqueue(
                conversation=fourth,
                anchor_id=fourth.tip_id,
                model_id=VISION,
                trigger=Trigger.PROACTIVE,
            )
            is None
        )
        # Bob is not held by Alice's jobs.
        assert compaction.jobs_open_for_owner(self.bob.pk) == 0
        # A job dead for an hour stops counting.
        CompactionJob.objects.filter(conversation__owner=self.alice).update(
            updated_at=timezone.now() - datetime.timedelta(hours=2)
        )
        with self.captureOnCommitCallbacks(execute=True):
            ok = self.client.post(f"/c/{fourth.pk}/compact/", headers={"HX-Request": "true"})
        assert ok.status_code == 200
        assert CompactionJob.objects.get(conversation=fourth).state == JobState.DONE

    def test_a_job_no_worker_takes_says_so_and_runs_on_request(self) -> None:
        conv = long_conversation(self.alice, "stranded")
        # What a lost send leaves (a broker restart, a server killed before its thread
        # ran the job): the job's row, queued, and no worker that will ever take it.
        assert conv.tip_id is not None
        CompactionJob.objects.create(
            conversation=conv, anchor_id=conv.tip_id, model=VISION, trigger=Trigger.MANUAL
        )
        job = CompactionJob.objects.get(conversation=conv)
        body = self.fragment(job).content.decode()
        assert "No worker has" not in body  # queued a moment ago: it is just waiting
        CompactionJob.objects.filter(pk=job.pk).update(
            updated_at=timezone.now() - datetime.timedelta(minutes=5)
        )
        body = self.fragment(job).content.decode()
        assert "No worker has picked this job up" in body and "Run it now" in body
        run = f"/c/{conv.pk}/compactions/jobs/{job.pk}/run/"
        response = self.client.post(run, headers={"HX-Request": "true"})
        job.refresh_from_db()
        assert job.state == JobState.DONE and job.record is not None, job.error
        assert 'class="job done"' in response.content.decode()
        # Running it again does nothing: it is not stranded any more.
        self.client.post(run, headers={"HX-Request": "true"})
        assert CompactionRecord.objects.filter(conversation=conv).count() == 1

    def test_a_queued_job_polls_until_it_is_done(self) -> None:
        conv = long_conversation(self.alice, "fresh")
        with mock.patch.object(run_compaction_job, "delay"):
            response = self.client.post(f"/c/{conv.pk}/compact/", headers={"HX-Request": "true"})
        job = CompactionJob.objects.get(conversation=conv)
        url = f"/c/{conv.pk}/compactions/jobs/{job.pk}/"
        body = response.content.decode()
        assert job.state == JobState.QUEUED and f'hx-get="{url}"' in body
        assert 'hx-trigger="every 1s"' in body and "HX-Trigger" not in response
        # A second click while it is queued shows the same job.
        with mock.patch.object(run_compaction_job, "delay"):
            again = self.client.post(f"/c/{conv.pk}/compact/", headers={"HX-Request": "true"})
        assert f'id="job-{job.pk}"' in again.content.decode()
        assert CompactionJob.objects.filter(conversation=conv).count() == 1
        # The worker takes it; the next poll shows the result and stops polling.
        run_compaction_job(str(job.pk))
        fragment = self.client.get(url, headers={"HX-Request": "true"})
        body = fragment.content.decode()
        assert 'class="job done"' in body and "every 1s" not in body and "<html" not in body
        assert fragment["HX-Trigger"] == "arbor:compacted" and "HX-Request" in fragment["Vary"]
        job.refresh_from_db()
        assert f"/c/{conv.pk}/compactions/{job.record_id}/" in body
        # The job's own URL is a whole page without HTMX, and on history restore.
        assert "<html" in self.client.get(url).content.decode()
        restore = self.client.get(
            url, headers={"HX-Request": "true", "HX-History-Restore-Request": "true"}
        )
        assert "<html" in restore.content.decode()

    def test_without_javascript_compact_now_redirects_to_the_panel(self) -> None:
        conv = long_conversation(self.alice, "fresh")
        with self.captureOnCommitCallbacks(execute=True):
            response = self.client.post(f"/c/{conv.pk}/compact/")
        assert response.status_code == 302 and response["Location"] == f"/c/{conv.pk}/context/"
        record = CompactionRecord.objects.get(conversation=conv)
        body = self.client.get(response["Location"]).content.decode()
        assert f'id="record-{record.pk}"' in body and "compaction record" in body

    def test_a_job_with_nothing_to_compact_says_so(self) -> None:
        conv, _ = new_conversation(self.alice, "q>a", title="short")
        with self.captureOnCommitCallbacks(execute=True):
            self.client.post(f"/c/{conv.pk}/compact/", headers={"HX-Request": "true"})
        job = CompactionJob.objects.get(conversation=conv)
        assert "Nothing to compact" in self.fragment(job).content.decode()
        empty = services.conversation_create(owner=self.alice, title="empty")
        assert self.client.post(f"/c/{empty.pk}/compact/").status_code == 400

    def test_a_failed_job_shows_its_error(self) -> None:
        conv = long_conversation(self.alice, "fresh")
        with (
            mock.patch("compaction.services.run_ladder", side_effect=RuntimeError("boom")),
            self.captureOnCommitCallbacks(execute=True),
        ):
            self.client.post(f"/c/{conv.pk}/compact/", headers={"HX-Request": "true"})
        body = self.fragment(CompactionJob.objects.get(conversation=conv)).content.decode()
        assert 'class="job failed"' in body and "RuntimeError: boom" in body
        assert 'role="alert"' in body

    def test_job_run_writes_each_stage_as_it_starts(self) -> None:
        conv = long_conversation(self.alice, "fresh")
        assert conv.tip_id is not None
        job = CompactionJob.objects.create(
            conversation=conv, anchor_id=conv.tip_id, model=VISION, trigger=Trigger.MANUAL
        )
        seen: list[dict[str, Any]] = []
        update = CompactionJob.objects.filter(pk=job.pk).update

        def spy(**fields: Any) -> int:
            if "progress" in fields:
                seen.append(dict(fields["progress"]))
            return update(**fields)

        claimed = compaction.job_claim(job_id=job.pk)
        assert claimed is not None
        with mock.patch.object(CompactionJob.objects, "filter", return_value=mock.Mock(update=spy)):
            compaction.job_run(job=claimed)
        stages = [s["stage"] for s in seen]
        assert stages[0] == "ladder" and stages[-1] == "done"
        assert {"rendering pages", "saving", "OCR"} <= set(stages)
        ocr = [s for s in seen if s["stage"] == "OCR"]
        assert ocr[0] == {"stage": "OCR", "done": 0, "total": 1}
        rendered = [s for s in seen if s["stage"] == "rendering pages"]
        assert rendered[-1]["pages"] >= 1


class CompactNowWithoutBrokerTests(TransactionTestCase):
    """Autocommit, as in a real request: without a broker the job runs inside the POST
    (the TestCase classes above only run it after the response)."""

    def test_a_job_that_fails_inside_the_request_is_shown_failed_not_a_500(self) -> None:
        alice = make_user("alice")
        conv, _ = new_conversation(alice, "hello>hi")
        Conversation.objects.filter(pk=conv.pk).update(model="nowhere/nothing")
        self.client.force_login(alice)
        response = self.client.post(f"/c/{conv.pk}/compact/", headers={"HX-Request": "true"})
        assert response.status_code == 200, response.content
        job = CompactionJob.objects.get(conversation=conv)
        assert job.state == JobState.FAILED and "nowhere" in job.error
        body = response.content.decode()
        assert 'class="job failed"' in body and 'role="alert"' in body


@pytest.mark.slow  # the job reads its pages back with tesseract
class CompactNowOnAWorkerThreadTests(TransactionTestCase):
    """The default without a broker: the POST is answered at once, and a worker thread
    of the process runs the job (legibility measurement included) after it."""

    def test_the_post_answers_before_the_job_runs_and_the_job_finishes_after(self) -> None:
        alice = make_user("alice")
        conv = services.conversation_create(owner=alice, title="agent", model=VISION)
        grow(conv, 12, result_chars=1200, error=True)
        self.client.force_login(alice)
        started, release = threading.Event(), threading.Event()
        real = compaction.job_run

        def held(*, job: CompactionJob) -> Any:
            started.set()
            release.wait(30)
            return real(job=job)

        with (
            override_settings(ARBOR_INPROCESS_JOBS="thread"),
            mock.patch("compaction.services.job_run", side_effect=held),
        ):
            response = self.client.post(f"/c/{conv.pk}/compact/", headers={"HX-Request": "true"})
            assert response.status_code == 200, response.content
            assert started.wait(10), "no worker thread picked the job up"
            job = CompactionJob.objects.get(conversation=conv)
            # The response is out while the job is still running.
            assert job.state == JobState.RUNNING
            assert 'class="job running"' in response.content.decode() or (
                'class="job queued"' in response.content.decode()
            )
            release.set()
            # A ceiling, not a measure: the job measures its pages with tesseract, which
            # on a busy machine takes minutes.
            deadline = time.monotonic() + OCR_SECONDS
            while job.state not in (JobState.DONE, JobState.FAILED):
                assert time.monotonic() < deadline, job.progress
                time.sleep(0.1)
                job.refresh_from_db()
        assert job.state == JobState.DONE, job.error
        assert CompactionRecord.objects.filter(conversation=conv, status="ready").exists()


class JobLeaseTests(TransactionTestCase):
    """The lease is renewed from a thread with its own connection: committed rows."""

    @override_settings(ARBOR_JOB_LEASE_SECONDS=1)
    def test_a_running_job_renews_its_lease_on_a_timer(self) -> None:
        alice = make_user("alice")
        conv = services.conversation_create(owner=alice, title="agent", model=VISION)
        grow(conv, 2)
        assert conv.tip_id is not None
        job = CompactionJob.objects.create(
            conversation=conv, anchor_id=conv.tip_id, model=VISION, trigger="manual"
        )
        claimed = compaction.job_claim(job_id=job.pk)
        assert claimed is not None and claimed.lease_until is not None
        first = claimed.lease_until
        with compaction._job_lease(claimed):
            time.sleep(1.6)
        job.refresh_from_db()
        assert job.lease_until is not None
        assert job.lease_until > first + datetime.timedelta(seconds=0.5)
        # Once the work ends, it stops: the lease runs out, as a dead worker's would.
        stopped = job.lease_until
        time.sleep(0.6)
        job.refresh_from_db()
        assert job.lease_until == stopped


@pytest.mark.slow  # the job reads its pages back with tesseract
class StrandedJobTests(TestCase):
    """A job whose worker died (or whose send was lost) is sent again by the next
    "Compact now", and still runs once."""

    def setUp(self) -> None:
        self.alice = make_user("alice")
        self.conv = services.conversation_create(owner=self.alice, title="agent", model=VISION)
        grow(self.conv, 12, result_chars=1200, error=True)
        assert self.conv.tip_id is not None
        self.tip = self.conv.tip_id

    def enqueue(self) -> CompactionJob | None:
        with self.captureOnCommitCallbacks(execute=True):
            return compaction.job_enqueue(
                conversation=self.conv, anchor_id=self.tip, model_id=VISION,
                trigger=Trigger.MANUAL,
            )  # fmt: skip

    def stuck(self, **fields: Any) -> CompactionJob:
        job = CompactionJob.objects.create(
            conversation=self.conv, anchor_id=self.tip, model=VISION, trigger="manual"
        )
        CompactionJob.objects.filter(pk=job.pk).update(**fields)
        return job

    def test_a_job_running_past_its_lease_is_run_again(self) -> None:
        past = timezone.now() - datetime.timedelta(minutes=1)
        job = self.stuck(state=JobState.RUNNING, attempts=1, lease_until=past)
        assert self.enqueue() == job
        job.refresh_from_db()
        assert job.state == JobState.DONE and job.attempts == 2, job.error
        assert CompactionJob.objects.filter(conversation=self.conv).count() == 1

    def test_a_job_left_in_the_queue_is_sent_again(self) -> None:
        old = timezone.now() - datetime.timedelta(seconds=settings.ARBOR_JOB_REQUEUE_SECONDS + 5)
        job = self.stuck(state=JobState.QUEUED, updated_at=old)
        assert self.enqueue() == job
        job.refresh_from_db()
        assert job.state == JobState.DONE and job.attempts == 1, job.error

    def test_a_job_that_is_running_is_left_alone(self) -> None:
        later = timezone.now() + datetime.timedelta(minutes=5)
        job = self.stuck(state=JobState.RUNNING, attempts=1, lease_until=later)
        assert self.enqueue() is None
        job.refresh_from_db()
        assert job.state == JobState.RUNNING and job.attempts == 1
        # A second delivery of its task waits for the lease instead of dropping the job.
        with self.assertRaises(compaction.JobBusy) as busy:
            compaction.job_claim(job_id=job.pk)
        assert 250 < busy.exception.retry_in <= 302

    def test_a_job_whose_worker_process_is_gone_is_taken_at_once(self) -> None:
        # The lease still holds, but the pool process that took the job is gone from
        # this host (killed): a redelivery takes it without waiting for the lease.
        later = timezone.now() + datetime.timedelta(minutes=5)
        job = self.stuck(
            state=JobState.RUNNING, attempts=1, lease_until=later, worker=gone_process()
        )
        job.refresh_from_db()
        assert compaction.job_stranded(job)
        claimed = compaction.job_claim(job_id=job.pk)
        assert claimed is not None and claimed.attempts == 2
        assert claimed.worker == process_identity()
        # The claim is ours now: another delivery finds it busy.
        with self.assertRaises(compaction.JobBusy):
            compaction.job_claim(job_id=job.pk)

    @override_settings(ARBOR_JOB_MAX_ATTEMPTS=3)
    def test_a_job_whose_workers_keep_dying_is_failed_with_the_reason(self) -> None:
        past = timezone.now() - datetime.timedelta(minutes=1)
        job = self.stuck(state=JobState.RUNNING, attempts=3, lease_until=past)
        assert compaction.job_claim(job_id=job.pk) is None
        job.refresh_from_db()
        assert job.state == JobState.FAILED and job.attempts == 3
        assert "stopped 3 times" in job.error
        assert not CompactionRecord.objects.filter(conversation=self.conv).exists()
        # Nothing is left open: "Compact now" queues a fresh job.
        fresh = self.enqueue()
        assert fresh is not None and fresh.pk != job.pk

    def test_the_sweeper_sends_again_what_no_worker_has(self) -> None:
        old = timezone.now() - datetime.timedelta(seconds=settings.ARBOR_JOB_REQUEUE_SECONDS + 5)
        lost = self.stuck(state=JobState.QUEUED, updated_at=old)
        other = services.conversation_create(owner=self.alice, title="b", model=VISION)
        grow(other, 12, result_chars=1200, error=True)
        assert other.tip_id is not None
        fresh = CompactionJob.objects.create(
            conversation=other, anchor_id=other.tip_id, model=VISION, trigger="manual"
        )
        with self.captureOnCommitCallbacks(execute=True):
            swept = compaction.jobs_sweep()
        assert swept["compaction_sent"] == 1
        lost.refresh_from_db()
        fresh.refresh_from_db()
        assert lost.state == JobState.DONE and lost.attempts == 1, lost.error
        assert fresh.state == JobState.QUEUED  # queued a moment ago: just waiting
        # The command an operator runs from cron does the same, and says what it did.
        out = io.StringIO()
        call_command("sweep_jobs", stdout=out)
        assert json.loads(out.getvalue()) == {
            "compaction_sent": 0, "imports_sent": 0, "imports_ended": 0
        }  # fmt: skip
