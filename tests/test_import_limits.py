"""Browser imports are bounded: the upload is deleted however its import ends, the form
refuses a file over the limit, a user has at most a few imports open at once, and one
JSON document (or line) is bounded far below the file limit (read as Python objects a
JSON of tiny objects takes ~26× its size; whole files stream).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from django.core.files.uploadedfile import SimpleUploadedFile
from django.test import TestCase, override_settings
from django.urls import reverse

from conversations.importers import ImportRejected, transcript_import
from conversations.models import Conversation, ImportJob, ImportState
from tests.builders import make_user, openwebui_chat


class BrowserImportLimitTests(TestCase):
    def setUp(self) -> None:
        self.media = tempfile.TemporaryDirectory()
        self.addCleanup(self.media.cleanup)
        self.enterContext(override_settings(MEDIA_ROOT=self.media.name))
        self.user = make_user("importer")
        self.client.force_login(self.user)

    def kept_uploads(self) -> list[str]:
        folder = Path(self.media.name) / "imports"
        return sorted(p.name for p in folder.iterdir()) if folder.exists() else []

    def send(self, name: str, data: bytes) -> Any:
        with self.captureOnCommitCallbacks(execute=True):
            return self.client.post(
                reverse("conversations:import"),
                {"file": SimpleUploadedFile(name, data), "format": "auto"},
            )

    def test_a_failed_import_deletes_its_upload(self) -> None:
        response = self.send("notes.txt", b"this is not a transcript")
        self.assertEqual(response.status_code, 302)
        job = ImportJob.objects.get(owner=self.user)
        self.assertEqual(job.state, ImportState.FAILED)
        self.assertIn("neither JSON nor JSON Lines", job.error)
        self.assertEqual(self.kept_uploads(), [])
        self.assertFalse(job.upload)

    def test_a_finished_import_deletes_its_upload(self) -> None:
        data = openwebui_chat()
        self.send("chat.json", data)
        job = ImportJob.objects.get(owner=self.user)
        self.assertEqual(job.state, ImportState.DONE)
        self.assertEqual(self.kept_uploads(), [])

    def test_the_form_refuses_a_file_over_the_limit(self) -> None:
        with override_settings(ARBOR_IMPORT_MAX_UPLOAD_BYTES=100):
            response = self.send("big.json", b"[" + b" " * 200 + b"]")
        self.assertEqual(response.status_code, 400)
        self.assertIn("imports are limited to 100 bytes", response.content.decode())
        self.assertFalse(ImportJob.objects.exists())
        self.assertEqual(self.kept_uploads(), [])

    def test_a_user_has_at_most_a_few_imports_open(self) -> None:
        for _ in range(3):
            ImportJob.objects.create(owner=self.user, filename="x.json", state=ImportState.QUEUED)
        with override_settings(ARBOR_IMPORT_MAX_OPEN=3):
            response = self.send("chat.json", b"[]")
        self.assertEqual(response.status_code, 429)
        self.assertIn("wait for one to finish", response.content.decode())
        self.assertEqual(ImportJob.objects.filter(owner=self.user).count(), 3)
        self.assertEqual(self.kept_uploads(), [])
        # Another user is not held up by them.
        other = make_user("other")
        self.client.force_login(other)
        data = openwebui_chat()
        with override_settings(ARBOR_IMPORT_MAX_OPEN=3):
            self.send("chat.json", data)
        self.assertEqual(Conversation.objects.filter(owner=other).count(), 1)


class DocumentLimitTests(TestCase):
    def test_one_document_past_its_limit_is_refused_before_it_is_parsed(self) -> None:
        """A single JSON document of 33 MiB of empty objects (which json.loads would
        turn into ~850 MB of dicts) is refused from its size alone."""
        path = Path(tempfile.mkdtemp()) / "objects.json"
        with open(path, "w") as out:
            out.write('{"history": {"messages": {')
            out.write(",".join(f'"k{i}": {{}}' for i in range(3_000_000)))
            out.write('}, "currentId": null}}')
        self.assertGreater(path.stat().st_size, 32 * 1024**2)
        with self.assertRaises(ImportRejected) as caught:
            transcript_import(owner_id=make_user().pk, path=path)
        self.assertIn("larger than the limit", str(caught.exception))
        self.assertFalse(Conversation.objects.exists())

    def test_an_array_still_streams_element_by_element(self) -> None:
        """The bound is per element: a file far over it, made of small conversations,
        imports (the file limit is what bounds a whole file)."""
        doc = json.loads(openwebui_chat())
        path = Path(tempfile.mkdtemp()) / "many.json"
        with open(path, "w") as out:
            out.write("[" + ",".join(json.dumps(doc) for _ in range(50)) + "]")
        report = transcript_import(owner_id=make_user().pk, path=path)
        self.assertEqual(len(report.conversations), 50)
