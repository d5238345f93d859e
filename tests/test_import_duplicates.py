"""Importing a file again does not silently duplicate it (#15): a conversation imported
before (the same source id in the same format, for the same user) is skipped and listed
with the conversation it already is, and can be imported again as a copy — from the
import's page (the file is kept for that), the upload form, or the API."""

from __future__ import annotations

import json
import tempfile
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

from django.core.files.uploadedfile import SimpleUploadedFile
from django.test import TestCase
from django.utils import timezone

from conversations import services
from conversations.importers import transcript_import
from conversations.models import Conversation, ImportJob, ImportState
from tests.builders import make_user

SAMPLE = Path(__file__).resolve().parent / "data" / "chatgpt" / "browsing.json"
BOTH = json.loads(SAMPLE.read_text())


def chatgpt_file(conversations: list[dict[str, Any]]) -> Path:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as handle:
        json.dump(conversations, handle)
    return Path(handle.name)


class DuplicateImportTests(TestCase):
    def setUp(self) -> None:
        self.user = make_user()

    def test_a_second_import_skips_what_the_first_imported_and_says_where_it_is(self) -> None:
        first = transcript_import(owner_id=self.user.pk, path=SAMPLE)
        assert len(first.conversations) == 2
        keys = sorted(Conversation.objects.values_list("source_key", flat=True))
        assert keys == ["chatgpt:browse-2023", "chatgpt:browse-2025"]

        again = transcript_import(owner_id=self.user.pk, path=SAMPLE)
        assert again.conversations == [] and Conversation.objects.count() == 2
        listed = {d["source_key"]: d for d in again.duplicates}
        assert set(listed) == set(keys)
        for conversation_report in first.conversations:
            key = f"chatgpt:{conversation_report.source_id}"
            assert listed[key]["existing"] == str(conversation_report.id)
            assert listed[key]["title"] == conversation_report.title
        assert again.as_dict()["duplicates"] == again.duplicates

        copies = transcript_import(owner_id=self.user.pk, path=SAMPLE, duplicates="copy")
        assert len(copies.conversations) == 2 and copies.duplicates == []
        assert Conversation.objects.filter(source_key="chatgpt:browse-2023").count() == 2

    def test_only_the_ones_imported_before_are_skipped(self) -> None:
        transcript_import(owner_id=self.user.pk, path=chatgpt_file(BOTH[:1]))
        report = transcript_import(owner_id=self.user.pk, path=SAMPLE)
        assert [c.source_id for c in report.conversations] == ["browse-2025"]
        assert [d["source_key"] for d in report.duplicates] == ["chatgpt:browse-2023"]

    def test_another_users_import_is_not_a_duplicate(self) -> None:
        transcript_import(owner_id=self.user.pk, path=SAMPLE)
        other = make_user("bob")
        report = transcript_import(owner_id=other.pk, path=SAMPLE)
        assert len(report.conversations) == 2 and report.duplicates == []

    def test_a_bad_choice_is_refused(self) -> None:
        from conversations.errors import InvalidInput

        with self.assertRaises(InvalidInput):
            transcript_import(owner_id=self.user.pk, path=SAMPLE, duplicates="merge")


class DuplicatePagesTests(TestCase):
    """The browser's flow, with jobs run in-process (inline, as in the tests)."""

    def setUp(self) -> None:
        self.user = make_user()
        self.client.force_login(self.user)

    def upload(self, path: Path, **extra: str) -> ImportJob:
        with path.open("rb") as handle:
            upload = SimpleUploadedFile("conversations.json", handle.read())
        with self.captureOnCommitCallbacks(execute=True):
            response = self.client.post("/import/", {"file": upload, "format": "auto", **extra})
        assert response.status_code == 302, response.content
        job = ImportJob.objects.latest("created_at")
        assert job.state == ImportState.DONE, job.error
        return job

    def test_the_page_lists_them_and_imports_them_again_as_copies(self) -> None:
        self.upload(chatgpt_file(BOTH[:1]))
        job = self.upload(SAMPLE)
        assert [c["source_id"] for c in job.report["conversations"]] == ["browse-2025"]
        assert job.upload, "the file is kept for importing the skipped ones again"
        page = self.client.get(f"/import/{job.pk}/").content.decode()
        existing = Conversation.objects.get(source_key="chatgpt:browse-2023")
        assert "1 conversation of this file was imported before" in page
        assert f'href="/c/{existing.pk}/"' in page
        assert f'action="/import/{job.pk}/again/"' in page
        kept = job.upload.name

        with self.captureOnCommitCallbacks(execute=True):
            response = self.client.post(f"/import/{job.pk}/again/")
        again = ImportJob.objects.latest("created_at")
        assert response.status_code == 302 and response["Location"] == f"/import/{again.pk}/"
        again.refresh_from_db()
        assert again.state == ImportState.DONE and again.on_duplicate == "copy"
        # Only the skipped one came in again, as a second conversation; not the other.
        assert [c["source_id"] for c in again.report["conversations"]] == ["browse-2023"]
        assert Conversation.objects.filter(source_key="chatgpt:browse-2023").count() == 2
        assert Conversation.objects.filter(source_key="chatgpt:browse-2025").count() == 1
        # The file moved to the new job, which dropped it when done.
        job.refresh_from_db()
        assert not job.upload and not again.upload
        assert not Path(services.default_storage.path(kept)).exists()
        # Once more: the file is gone, and the page says what to do instead.
        response = self.client.post(f"/import/{job.pk}/again/", follow=True)
        assert "upload it again" in response.content.decode()
        assert Conversation.objects.count() == 3

    def test_the_form_can_ask_for_copies_at_once(self) -> None:
        self.upload(SAMPLE)
        job = self.upload(SAMPLE, copies="on")
        assert job.on_duplicate == "copy" and len(job.report["conversations"]) == 2
        assert not job.upload
        assert Conversation.objects.count() == 4

    def test_a_kept_file_is_dropped_after_a_day(self) -> None:
        self.upload(SAMPLE)
        job = self.upload(SAMPLE)
        path = Path(job.upload.path)
        assert path.exists()
        ImportJob.objects.filter(pk=job.pk).update(updated_at=timezone.now() - timedelta(days=2))
        self.client.get("/import/")  # the page sweeps its recent jobs
        job.refresh_from_db()
        assert not job.upload and not path.exists()
        page = self.client.get(f"/import/{job.pk}/").content.decode()
        assert "upload the file again" in page

    def test_a_malformed_or_unknown_id_is_a_404(self) -> None:
        assert self.client.post("/import/not-a-uuid/again/").status_code == 404
        assert self.client.post(f"/import/{uuid.uuid4()}/again/").status_code == 404

    def test_the_day_old_sweep_leaves_a_file_another_job_took_over(self) -> None:
        self.upload(SAMPLE)
        job = self.upload(SAMPLE)
        stale = ImportJob.objects.get(pk=job.pk)  # read before the file moved
        with self.captureOnCommitCallbacks(execute=False):  # the copy job is not run
            again = services.import_job_again(owner=self.user, job_id=job.pk)
        ImportJob.objects.filter(pk=job.pk).update(updated_at=timezone.now() - timedelta(days=2))
        stale.updated_at = timezone.now() - timedelta(days=2)
        services.import_job_sweep(stale)
        again.refresh_from_db()
        assert again.upload and Path(again.upload.path).exists()

    def test_deleting_the_user_deletes_the_kept_file(self) -> None:
        self.upload(SAMPLE)
        job = self.upload(SAMPLE)
        path = Path(job.upload.path)
        assert path.exists()
        with self.captureOnCommitCallbacks(execute=True):
            self.user.delete()
        assert not path.exists()

    def test_a_stranger_cannot_import_someone_elses_file_again(self) -> None:
        self.upload(SAMPLE)
        job = self.upload(SAMPLE)
        self.client.force_login(make_user("mallory"))
        assert self.client.post(f"/import/{job.pk}/again/").status_code == 404
        assert not ImportJob.objects.filter(owner__username="mallory").exists()


class DuplicateApiTests(TestCase):
    def test_all_imported_before_is_a_409_and_copy_imports_them(self) -> None:
        user = make_user()
        _, token = services.api_token_create(user=user, name="t")
        auth = {"Authorization": f"Bearer {token}"}
        body = SAMPLE.read_bytes()
        first = self.client.post(
            "/api/imports", body, content_type="application/json", headers=auth
        )
        assert first.status_code == 201
        again = self.client.post(
            "/api/imports", body, content_type="application/json", headers=auth
        )
        assert again.status_code == 409, again.content
        error = again.json()
        assert error["error"] == "already_imported" and "duplicates=copy" in error["detail"]
        assert len(error["report"]["duplicates"]) == 2
        copied = self.client.post(
            "/api/imports?duplicates=copy", body, content_type="application/json", headers=auth
        )
        assert copied.status_code == 201 and len(copied.json()["conversation_ids"]) == 2
        bad = self.client.post(
            "/api/imports?duplicates=merge", body, content_type="application/json", headers=auth
        )
        assert bad.status_code == 422 and bad.json()["error"] == "bad_duplicates"
