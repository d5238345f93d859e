"""The compaction screens in a real browser (the setup of tests/test_browser_ui.py):
the owner's context panel with its gauge, a compaction job whose progress shows and
finishes without a reload, the record with its page images, and the staff audit's
filters."""

from __future__ import annotations

import re
import threading
from typing import Any
from unittest import mock

import pytest
from django.db import connection

from compaction import render
from compaction.models import CompactionJob, CompactionRecord, JobState
from compaction.tasks import run_compaction_job
from conversations import services
from tests.builders import grow, make_user
from tests.live_server import OCR_SECONDS, READY_SECONDS
from tests.test_browser_ui import BrowserTestCase

# The fake provider's Anthropic-style model reads images; its 4000-token window is
# overflowed by ten agent turns with error results, which one snapshot page fixes.
MODEL = "anthropic/test"


def _run_job(job_id: str, errors: list[BaseException]) -> None:
    """What a worker does, on its own thread and database connection."""
    try:
        run_compaction_job(job_id)
    except BaseException as exc:  # reported by the test, not lost in the thread
        errors.append(exc)
    finally:
        connection.close()


class ContextPanelTests(BrowserTestCase):
    def setUp(self) -> None:
        super().setUp()
        self.user = make_user("alice")
        self.conv = services.conversation_create(owner=self.user, title="Agent", model=MODEL)
        grow(self.conv, 10, result_chars=1200, error=True)
        self.sign_in("alice")

    @pytest.mark.slow  # a browser, and the job's OCR (tesseract)
    def test_compact_now_shows_progress_then_the_record_without_a_reload(self) -> None:
        page = self.page
        page.goto(self.url(f"/c/{self.conv.pk}/context/"))
        assert page.locator("svg.gauge rect.seg").count() >= 2
        assert "over the budget" in page.inner_text(".gauge-total")
        assert page.locator("#path-records tr").count() == 0
        url = page.url
        page.evaluate("window.__samePage = true")

        # A broker would take the job later: hold it back to watch it queue and run.
        with mock.patch.object(run_compaction_job, "delay"):
            page.click("#compact-now")
            page.wait_for_selector("#job-list .job.queued")
        job = CompactionJob.objects.get(conversation=self.conv)
        assert job.state == JobState.QUEUED
        # The worker stops at its OCR stage until the page has shown it, then measures
        # the page with the real tesseract.
        release = threading.Event()
        real_ocr = render.ocr_cer

        def ocr(drawn: Any) -> float | None:
            release.wait(READY_SECONDS)
            return real_ocr(drawn)

        errors: list[BaseException] = []
        worker = threading.Thread(target=_run_job, args=(str(job.pk), errors))
        with mock.patch("compaction.render.ocr_cer", side_effect=ocr):
            worker.start()
            self.addCleanup(worker.join)
            self.addCleanup(release.set)
            page.wait_for_selector("#job-list .job.running .stage:has-text('OCR 0/1')")
            assert page.locator("#job-list .job.running progress").count() == 1
            release.set()
            # The result replaces it; the gauge and the record list refresh themselves.
            # (Real OCR of a page: on a loaded machine it takes minutes, not seconds.)
            page.wait_for_selector("#job-list .job.done .job-record a", timeout=OCR_SECONDS * 1000)
            worker.join()
        assert errors == [], errors
        record = CompactionRecord.objects.get(conversation=self.conv)
        page.wait_for_selector(f"#path-records #record-{record.pk}")
        assert "fits" in page.inner_text(".gauge-total")
        assert page.evaluate("window.__samePage") is True and page.url == url  # no reload
        self.shot("context-panel")

        # The record: originals next to what the model saw, pages as images.
        page.click("#job-list .job.done .job-record a")
        page.wait_for_url(f"**/c/{self.conv.pk}/compactions/{record.pk}/")
        images = page.locator(".pages img")
        assert images.count() == record.pages.count() >= 1
        for i in range(images.count()):
            images.nth(i).scroll_into_view_if_needed()
        page.wait_for_function(
            "() => [...document.querySelectorAll('.pages img')]"
            ".every(img => img.complete && img.naturalWidth > 0)"
        )
        assert "billed tokens" in page.inner_text(".pages figcaption")
        measured = record.pages.get().ocr_cer
        assert measured is not None and 0 <= measured < 0.1  # real tesseract, real page
        assert re.search(r"OCR CER \d\.\d{3}", page.inner_text(".pages figcaption"))
        self.assert_clean()


class AuditFilterTests(BrowserTestCase):
    def test_staff_filter_the_records_in_place(self) -> None:
        alice = make_user("alice")
        make_user("root", staff=True)
        records: dict[str, Any] = {}
        for name, rungs in (("elided", ["elision"]), ("paged", ["elision", "snapshot"])):
            conv = services.conversation_create(owner=alice, title=name, model=MODEL)
            grow(conv, 1)
            records[name] = CompactionRecord.objects.create(
                conversation=conv, anchor=conv.messages.order_by("-depth")[0], model=MODEL,
                trigger="manual",
                status="ready", rungs=[{"rung": r} for r in rungs], budget_tokens=2995,
                tokens_before=3500, tokens_after=1900,
            )  # fmt: skip
        self.sign_in("root")
        page = self.page
        page.goto(self.url("/audit/"))
        assert page.locator("#records tbody tr").count() == 2
        page.evaluate("window.__samePage = true")
        page.select_option("select[name=rung]", "snapshot")
        page.wait_for_function("() => document.querySelectorAll('#records tbody tr').length === 1")
        assert page.locator(f"#record-{records['paged'].pk}").count() == 1
        assert "rung=snapshot" in page.url and page.evaluate("window.__samePage") is True
        page.fill("input[name=user]", "alice")
        page.click("#audit-filters button")
        page.wait_for_url("**user=alice**")
        assert page.locator(f"#record-{records['paged'].pk}").count() == 1
        self.shot("audit-filters")
        # A bad value shows the form's error in place (the answer is a 400).
        page.fill("input[name=conversation]", "not-an-id")
        page.click("#audit-filters button")
        page.wait_for_selector("#records [role=alert]")
        self.assert_clean()
