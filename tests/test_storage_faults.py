"""A full or read-only media store, for real: the media root is a small tmpfs mounted
for the test (CI runs as root; elsewhere the test is skipped unless CI=true).

A write cut short by a full disk never leaves a truncated file under a blob's real
name; a file already there is trusted only when it holds the right bytes; a full store
answers 507 and a read-only one 503, with a reason, and nothing half-written is kept."""

from __future__ import annotations

import hashlib
import io
import os
import random
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.test import Client, TestCase, override_settings
from PIL import Image

from compaction.models import CompactionRecord
from conversations import services
from conversations.models import Blob, Conversation, ImportJob
from conversations.providers.fake import FakeLLMServer
from tests.builders import grow, make_user
from tests.fake_models import serve_fake_models


def noisy_png(seed: int, size: int = 280) -> bytes:
    """A PNG that does not compress (~230 KB)."""
    rng = random.Random(seed)
    image = Image.frombytes(
        "RGB", (size, size), bytes(rng.getrandbits(8) for _ in range(size * size * 3))
    )
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


class TmpfsStore(TestCase):
    """The media root on a tmpfs of ``size_kb``, and a user with an API client."""

    size_kb = 400

    def setUp(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="arbor-media-"))
        mounted = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={self.size_kb}k", "tmpfs", str(self.root)],
            capture_output=True, text=True,
        )  # fmt: skip
        if mounted.returncode != 0:
            if os.environ.get("CI") == "true":
                self.fail(f"cannot mount a tmpfs for the media store: {mounted.stderr}")
            self.skipTest(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
        self.addCleanup(subprocess.run, ["umount", "-l", str(self.root)], check=False)
        settings = override_settings(MEDIA_ROOT=str(self.root))
        settings.enable()
        self.addCleanup(settings.disable)
        self.user = make_user()
        _, secret = services.api_token_create(user=self.user, name="t")
        self.api = Client(HTTP_AUTHORIZATION=f"Bearer {secret}")
        self.image = noisy_png(1)

    def upload(self, data: bytes) -> Any:
        return self.api.post(
            "/api/blobs", {"file": SimpleUploadedFile("x.png", data, content_type="image/png")}
        )

    def fill(self, leave_kb: int) -> Path:
        """Fill the store until only ``leave_kb`` is free."""
        stat = os.statvfs(self.root)
        free = stat.f_bavail * stat.f_frsize
        filler = self.root / "filler"
        filler.write_bytes(b"\0" * max(0, free - leave_kb * 1024))
        return filler

    def files(self) -> list[str]:
        return sorted(str(p.relative_to(self.root)) for p in self.root.rglob("*") if p.is_file())


class MediaStoreFaultTests(TmpfsStore):
    def test_a_full_store_answers_507_and_keeps_nothing_then_the_retry_is_whole(self) -> None:
        filler = self.fill(leave_kb=60)
        response = self.upload(self.image)
        self.assertEqual(response.status_code, 507, response.content)
        self.assertEqual(response.json()["error"], "storage_full")
        self.assertIn("full", response.json()["detail"])
        self.assertEqual(self.files(), ["filler"])  # no truncated blob, no temporary file
        self.assertFalse(Blob.objects.exists())

        filler.unlink()
        response = self.upload(self.image)
        self.assertEqual(response.status_code, 201, response.content)
        sha = response.json()["sha256"]
        served = b"".join(self.api.get(f"/api/blobs/{sha}").streaming_content)
        self.assertEqual(served, self.image)

    def test_a_truncated_file_under_the_real_name_is_replaced(self) -> None:
        # What a write cut short used to leave: the first 96 KB under the final name.
        import hashlib

        sha = hashlib.sha256(self.image).hexdigest()
        path = self.root / "blobs" / sha[:2] / f"{sha}.png"
        path.parent.mkdir(parents=True)
        path.write_bytes(self.image[: 96 * 1024])
        response = self.upload(self.image)
        self.assertEqual(response.status_code, 201, response.content)
        self.assertEqual(path.read_bytes(), self.image)
        served = b"".join(self.api.get(f"/api/blobs/{sha}").streaming_content)
        self.assertEqual(served, self.image)

    def test_a_read_only_store_answers_503(self) -> None:
        subprocess.run(["mount", "-o", "remount,ro", str(self.root)], check=True)
        self.addCleanup(subprocess.run, ["mount", "-o", "remount,rw", str(self.root)], check=False)
        response = self.upload(self.image)
        self.assertEqual(response.status_code, 503, response.content)
        self.assertEqual(response.json()["error"], "storage_unavailable")
        self.assertFalse(Blob.objects.exists())

    def test_an_import_upload_on_a_full_store_is_a_form_error(self) -> None:
        self.fill(leave_kb=40)
        browser = Client()
        browser.force_login(self.user)
        upload = SimpleUploadedFile("session.jsonl", b'{"type": "user"}\n' * 8000)
        response = browser.post("/import/", {"file": upload, "format": "auto"})
        self.assertEqual(response.status_code, 507)
        self.assertIn("full", response.content.decode())
        self.assertFalse(ImportJob.objects.exists())
        self.assertEqual(self.files(), ["filler"])


VISION = "openai/vision"


@pytest.fixture(scope="module")
def vision_model() -> Iterator[None]:
    with serve_fake_models(
        FakeLLMServer(), extra={VISION: {"context_window": 4000, "vision": True}}
    ):
        yield


@pytest.mark.usefixtures("vision_model")
class RenderingOnAFullStoreTests(TmpfsStore):
    """Compaction writes its snapshot pages to the same store: a full one fails the
    compaction with the reason and keeps no record and no page file; once there is
    room, the same compaction stores whole pages (a truncated page used to be reused
    by every later compaction, failing each turn)."""

    size_kb = 1024

    def compact(self, conv: Conversation) -> Any:
        return self.api.post(
            f"/api/conversations/{conv.pk}/context", content_type="application/json"
        )

    def test_a_store_filled_during_rendering(self) -> None:
        conv = services.conversation_create(owner=self.user, title="agent", model=VISION)
        grow(conv, 10, result_chars=1200, error=True)
        filler = self.fill(leave_kb=0)  # a 1-bit page is a few KB
        response = self.compact(conv)
        assert response.status_code == 507, response.content[:300]
        body = response.json()
        assert body["error"] == "storage_full" and "full" in body["detail"]
        assert not CompactionRecord.objects.exists()
        assert self.files() == ["filler"]  # no page, whole or cut, no temporary file

        filler.unlink()
        response = self.compact(conv)
        assert response.status_code == 200, response.content
        record = CompactionRecord.objects.get()
        assert record.status == "ready"
        pages = list(record.pages.select_related("blob"))
        assert pages
        for page in pages:
            data = (self.root / page.blob.file.name).read_bytes()
            assert hashlib.sha256(data).hexdigest() == page.blob.sha256
            with Image.open(io.BytesIO(data)) as image:
                assert image.size == (page.width, page.height)
